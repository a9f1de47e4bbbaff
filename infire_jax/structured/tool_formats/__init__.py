"""Tool-call formats, one module per family, under vLLM's `--tool-call-parser` names.

Each is a `Format` (base.py): where its call blocks begin and how one is read. The stream that turns
output text into content and calls is the same for all (tool_parsers.ToolCallStream).
"""

from __future__ import annotations

from infire_jax.structured.tool_formats.base import Block, Format, ToolCall
from infire_jax.structured.tool_formats.gemma4 import Gemma4
from infire_jax.structured.tool_formats.glm45 import Glm45
from infire_jax.structured.tool_formats.json_calls import Hermes, Llama3Json, Mistral
from infire_jax.structured.tool_formats.minimax_m2 import MiniMaxM2
from infire_jax.structured.tool_formats.pythonic import Pythonic
from infire_jax.structured.tool_formats.qwen3_coder import Qwen3Coder
from infire_jax.structured.tool_formats.special_tokens import DeepSeekV3, DeepSeekV31, KimiK2

FORMATS: dict[str, type[Format]] = {
    "hermes": Hermes,
    "llama3_json": Llama3Json,
    "mistral": Mistral,
    "pythonic": Pythonic,
    "llama4_pythonic": Pythonic,  # the same syntax; Llama 4 wraps it in <|python_start|> … <|python_end|>
    "kimi_k2": KimiK2,
    "deepseek_v3": DeepSeekV3,
    "deepseek_v31": DeepSeekV31,
    "qwen3_coder": Qwen3Coder,
    "glm45": Glm45,
    "minimax_m2": MiniMaxM2,
    "gemma4": Gemma4,
}

__all__ = ["FORMATS", "Block", "Format", "ToolCall"]
