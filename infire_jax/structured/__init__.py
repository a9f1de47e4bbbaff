"""Structured outputs: constraints (spec.py), their grammars (backend.py, llguidance), per-request
matchers that fill each step's token bitmask (matcher.py), tool calling (tool_*.py, tool_formats/),
and reasoning split from the answer (reasoning_parsers.py)."""

from infire_jax.structured.reasoning_parsers import (REASONING_PARSERS, ReasoningStream, parse_reasoning,
                                                     stream_reasoning)
from infire_jax.structured.spec import StructuredOutputs
from infire_jax.structured.tool_parsers import (TOOL_PARSERS, ToolCall, ToolCallStream, detect_format, parse_tool_calls,
                                                stream_tool_calls)

__all__ = ["REASONING_PARSERS", "TOOL_PARSERS", "ReasoningStream", "StructuredOutputs", "ToolCall", "ToolCallStream",
           "detect_format", "parse_reasoning", "parse_tool_calls", "stream_reasoning", "stream_tool_calls"]
