"""An HF `config.json` -> ModelConfig: picks the family's parser by `model_type`.

Each parser module names the model types it reads; a new family is one more line in `_PARSERS`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from infire_jax.errors import UnsupportedModelError
from infire_jax.models import (deepseek_config, gemma3_config, gemma4_config, glm4_config, gpt_oss_config,
                               llama4_config, llama_config, minimax_m2_config, qwen3_5_config)
from infire_jax.models.config import ModelConfig

_PARSERS: dict[str, Callable[[Mapping[str, Any]], ModelConfig]] = {
    **dict.fromkeys(llama_config.MODEL_TYPES, llama_config.config_from_llama_hf),
    **dict.fromkeys(deepseek_config.MODEL_TYPES, deepseek_config.config_from_deepseek_hf),
    **dict.fromkeys(llama4_config.MODEL_TYPES, llama4_config.config_from_llama4_hf),
    **dict.fromkeys(gpt_oss_config.MODEL_TYPES, gpt_oss_config.config_from_gpt_oss_hf),
    **dict.fromkeys(gemma3_config.MODEL_TYPES, gemma3_config.config_from_gemma3_hf),
    **dict.fromkeys(gemma4_config.MODEL_TYPES, gemma4_config.config_from_gemma4_hf),
    **dict.fromkeys(glm4_config.MODEL_TYPES, glm4_config.config_from_glm4_hf),
    **dict.fromkeys(minimax_m2_config.MODEL_TYPES, minimax_m2_config.config_from_minimax_m2_hf),
    **dict.fromkeys(qwen3_5_config.MODEL_TYPES, qwen3_5_config.config_from_qwen3_5_hf),
}


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Builds a ModelConfig from a HF `config.json` dict (transformers 4.x and 5.x layouts)."""
    model_type = hf.get("model_type")
    parser = _PARSERS.get(model_type or "")
    if parser is None:
        raise UnsupportedModelError(f"unsupported model_type {model_type!r}; supported: {sorted(_PARSERS)}")
    try:
        return parser(hf)
    except KeyError as e:  # a field the parser needs, and no default stands in for it
        raise UnsupportedModelError(f"the {model_type} config has no field {e.args[0]!r}, which it needs") from e
    except (TypeError, ValueError, AttributeError) as e:  # a field of the wrong type (int("x"), a list for a dict)
        raise UnsupportedModelError(f"the {model_type} config has a field of the wrong type or value: {e}") from e
