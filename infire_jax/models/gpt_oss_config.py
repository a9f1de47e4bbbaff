"""gpt-oss's HF config (`gpt_oss`, GptOssConfig) -> ModelConfig (models/hf_config.py picks this parser by
model_type).

Every field is read as transformers' GptOssConfig reads it (its defaults: the published 120b's), or is
one inference never reads (llama4_config.INERT_FIELDS); any other field, and any value the model does
not implement, is refused naming the field, so an unusual checkpoint fails at load instead of giving
wrong tokens.
"""

from __future__ import annotations

from typing import Any, Mapping

from infire_jax.errors import UnsupportedModelError
from infire_jax.models.config import GptOssConfig, ModelConfig, RopeScaling, eos_ids
from infire_jax.models.config_fields import Fields
from infire_jax.models.llama4_config import INERT_FIELDS

MODEL_TYPES = ("gpt_oss",)

_FIELDS = {
    "model_type", "num_hidden_layers", "num_local_experts", "num_experts", "vocab_size", "hidden_size",
    "intermediate_size", "head_dim", "num_attention_heads", "num_key_value_heads", "sliding_window",
    "tie_word_embeddings", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
    "rope_scaling", "rope_theta", "num_experts_per_tok", "swiglu_alpha", "swiglu_limit", "layer_types",
    "bos_token_id", "eos_token_id", "attention_bias", "quantization_config", "experts_per_token",
    "initial_context_length"}  # the published configs' copy of rope_scaling's original_max_position_embeddings
_LAYER_TYPES = ("sliding_attention", "full_attention")
# GptOssConfig's default rope_parameters (the published checkpoints' rope_scaling).
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
_ROPE_FIELDS = {"rope_type", "type", "factor", "beta_fast", "beta_slow", "truncate",
                "original_max_position_embeddings", "rope_theta"}


def _bad(field: str, value: Any, why: str) -> UnsupportedModelError:
    return Fields("gpt-oss", {}).bad(field, value, why)


def _int(c: Mapping[str, Any], field: str, default: int, lo: int = 1) -> int:
    return Fields("gpt-oss", c).int(field, default, lo)


def _number(c: Mapping[str, Any], field: str, default: float) -> float:
    return Fields("gpt-oss", c).number(field, default)


def _rope(c: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling): YaRN as HF's `_compute_yarn_parameters` reads it, or plain RoPE ("default")."""
    raw = dict(c.get("rope_parameters") or c.get("rope_scaling") or _DEFAULT_ROPE)
    unknown = sorted(set(raw) - _ROPE_FIELDS)
    if unknown:
        raise _bad(f"rope_parameters.{unknown[0]}", raw[unknown[0]], "not read by gpt-oss's YaRN")
    theta = _number({**c, **raw}, "rope_theta", 150000.0)
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise _bad("rope_parameters.rope_type", kind, "only yarn and default are supported")
    truncate = raw.get("truncate", True)
    if not isinstance(truncate, bool):
        raise _bad("rope_parameters.truncate", truncate, "must be a boolean")
    return theta, RopeScaling("yarn", factor=_number(raw, "factor", 32.0),
                              original_max_position_embeddings=_int(raw, "original_max_position_embeddings", 4096),
                              beta_fast=_number(raw, "beta_fast", 32.0), beta_slow=_number(raw, "beta_slow", 1.0),
                              truncate=truncate)


def _local_attention(c: Mapping[str, Any], layers: int) -> tuple[tuple[int, int], ...]:
    """Each layer's (0, window) or (0, 0) as `layer_types` says (default: even layers slide, odd ones are
    global). transformers' window W is the W keys p - W < k <= p, LocalMask's W (llama_config's note)."""
    window = c.get("sliding_window", 128)
    types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in _LAYER_TYPES for t in types):
        raise _bad("layer_types", types, f"must give one of {_LAYER_TYPES} for each of the {layers} layers")
    if "sliding_attention" not in types:
        return ()
    if window is None:
        raise _bad("sliding_window", None, "layer_types names sliding_attention layers")
    window = _int(c, "sliding_window", 128)
    return tuple((0, window) if t == "sliding_attention" else (0, 0) for t in types)


def config_from_gpt_oss_hf(c: Mapping[str, Any]) -> ModelConfig:
    unknown = sorted(set(c) - _FIELDS - INERT_FIELDS)
    if unknown:
        raise _bad(unknown[0], c[unknown[0]], "not a field of a gpt-oss config")
    quant = c.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, Mapping) else quant
    if quant and method != "mxfp4":
        raise _bad("quantization_config.quant_method", method,
                   "only mxfp4 experts are read (dequantized at load, or kept: weights_quantization=checkpoint)")
    for field, want in (("hidden_act", "silu"), ("attention_bias", True)):
        if c.get(field, want) != want:
            raise _bad(field, c[field], f"only {want!r} is supported")
    layers, heads, hidden = _int(c, "num_hidden_layers", 36), _int(c, "num_attention_heads", 64), _int(
        c, "hidden_size", 2880)
    experts = _int(c, "num_local_experts", c.get("num_experts", 128))
    theta, scaling = _rope(c)
    return ModelConfig(
        architecture="gpt_oss",
        vocab_size=_int(c, "vocab_size", 201088),
        hidden_size=hidden,
        intermediate_size=_int(c, "intermediate_size", 2880),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_int(c, "num_key_value_heads", 8),
        head_dim=_int({"head_dim": c.get("head_dim") or hidden // heads}, "head_dim", 64),
        rms_norm_eps=_number(c, "rms_norm_eps", 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_int(c, "max_position_embeddings", 131072),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=True,
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=eos_ids(c.get("eos_token_id")),
        num_experts=experts,
        num_experts_per_tok=_int(c, "num_experts_per_tok", c.get("experts_per_token", 4)),
        moe_intermediate_size=_int(c, "intermediate_size", 2880),
        local_attention=_local_attention(c, layers),
        gpt_oss=GptOssConfig(swiglu_alpha=_number(c, "swiglu_alpha", 1.702),
                             swiglu_limit=_number(c, "swiglu_limit", 7.0)),
    )
