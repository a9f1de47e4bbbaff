"""Gemma 3's HF config (`gemma3_text`, Gemma3TextConfig; or `gemma3`, Gemma3Config, whose `text_config`
is its language model) -> ModelConfig (models/hf_config.py picks this parser by model_type).

Every field is read as transformers' Gemma3TextConfig reads it, in its 4.x layout (`rope_theta`,
`rope_scaling` and `rope_local_base_freq`, `sliding_window_pattern`) and its 5.x one (`rope_parameters`
by layer type, `layer_types`), with its defaults: the published multimodal checkpoints leave most
fields out. A field inference never reads is ignored (llama4_config.INERT_FIELDS); any other field,
and any value models/gemma3.py does not implement (soft-capping: Gemma 2's; bidirectional attention:
EmbeddingGemma's), is refused naming it. Of a `gemma3` checkpoint this is the language model; its
vision tower is read apart (vision/gemma3_encoder.py) to serve images.
"""

from __future__ import annotations

from typing import Any, Mapping

from infire_jax.models.config import Gemma3Config, ModelConfig, eos_ids
from infire_jax.models.config_fields import Fields
from infire_jax.models.llama4_config import INERT_FIELDS
from infire_jax.models.llama_config import rope_scaling_from_hf

MODEL_TYPES = ("gemma3_text", "gemma3")

_FIELDS = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_activation", "hidden_act", "max_position_embeddings", "rms_norm_eps",
    "bos_token_id", "eos_token_id", "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_local_base_freq",
    "rope_parameters", "attention_bias", "query_pre_attn_scalar", "sliding_window", "sliding_window_pattern",
    "_sliding_window_pattern", "layer_types", "final_logit_softcapping", "attn_logit_softcapping",
    "use_bidirectional_attention",
    "quantization_config"}  # a published 8-bit checkpoint's: dequantized as read, or kept (loaders/kept_8bit.py)
# A multimodal `gemma3` config's own fields beside its text_config (its vision_config: vision/gemma3_encoder.py).
_WRAPPER_FIELDS = {"model_type", "text_config", "vision_config", "mm_tokens_per_image", "boi_token_index",
                   "eoi_token_index", "image_token_index", "image_token_id", "boi_token_id", "eoi_token_id",
                   "eos_token_id", "bos_token_id", "tie_word_embeddings", "quantization_config"}
_LAYER_TYPES = ("sliding_attention", "full_attention")
F = "Gemma 3"  # the family refusals name


def text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config: a `gemma3_text` config as it is, a `gemma3` one's `text_config` with
    the wrapper's eos / bos ids (generation reads those; the published files keep them there only) and
    tying (transformers 5 ties by it) where the wrapper has them."""
    if hf.get("model_type") == "gemma3_text":
        return dict(hf)
    return Fields(F, hf).language_model(_WRAPPER_FIELDS | INERT_FIELDS, "gemma3_text")


def _rope(f: Fields) -> tuple[float, Any, float]:
    """(global theta, global scaling, local theta). 5.x: `rope_parameters` by layer type; 4.x:
    `rope_scaling` (or a flat `rope_parameters`) for the global layers and `rope_local_base_freq`."""
    c = f.c
    params = c.get("rope_parameters")
    by_type = isinstance(params, Mapping) and bool(set(params) & set(_LAYER_TYPES))
    full = dict((params or {}).get("full_attention") or {}) if by_type else dict(params or c.get("rope_scaling") or {})
    local = dict(params.get("sliding_attention") or {}) if by_type else {}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise f.bad("rope_parameters.sliding_attention.rope_type", local.get("rope_type", local.get("type")),
                    "the windowed layers' RoPE must be the default one")
    kind = full.get("rope_type", full.get("type", "default"))
    if kind not in ("default", "linear"):
        raise f.bad("rope_parameters.full_attention.rope_type", kind, "only default and linear are supported")
    theta = f.of({"rope_theta": full.get("rope_theta", c.get("rope_theta", 1_000_000.0))}).number("rope_theta", 0)
    local_theta = f.of({"rope_local_base_freq": local.get("rope_theta", c.get("rope_local_base_freq", 10_000.0))}
                       ).number("rope_local_base_freq", 0)
    return theta, rope_scaling_from_hf(full), local_theta


def _local_attention(f: Fields, layers: int) -> tuple[tuple[int, int], ...]:
    """Each layer's (0, window) or (0, 0): `layer_types`, else every `sliding_window_pattern`-th layer
    global (transformers' rule). transformers' window W is the W keys p - W < k <= p, LocalMask's W."""
    pattern = f.int("sliding_window_pattern", f.c.get("_sliding_window_pattern", 6))  # 5.x writes the latter
    types = f.c.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                     for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in _LAYER_TYPES for t in types):
        raise f.bad("layer_types", types, f"must give one of {_LAYER_TYPES} for each of the {layers} layers")
    if "sliding_attention" not in types:
        return ()
    window = f.int("sliding_window", 4096)
    return tuple((0, window) if t == "sliding_attention" else (0, 0) for t in types)


def config_from_gemma3_hf(hf: Mapping[str, Any]) -> ModelConfig:
    c = text_config(hf)
    f = Fields(F, c)
    f.only_known(_FIELDS | INERT_FIELDS, "a Gemma 3 text config")
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        if c.get(field) is not None:
            raise f.bad(field, c[field], "soft-capping is not supported (Gemma 3 sets none)")
    for field, want in (("attention_bias", False), ("use_bidirectional_attention", False)):
        if c.get(field) not in (None, want):
            raise f.bad(field, c[field], f"only {want!r} is supported")
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise f.bad("hidden_activation", act, "only gelu_pytorch_tanh is supported")
    layers = f.int("num_hidden_layers", 26)
    theta, scaling, local_theta = _rope(f)
    return ModelConfig(
        architecture="gemma3",
        vocab_size=f.int("vocab_size", 262_208),
        hidden_size=f.int("hidden_size", 2304),
        intermediate_size=f.int("intermediate_size", 9216),
        num_layers=layers,
        num_heads=f.int("num_attention_heads", 8),
        num_kv_heads=f.int("num_key_value_heads", 4),
        head_dim=f.int("head_dim", 256),
        rms_norm_eps=f.number("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=f.int("max_position_embeddings", 131_072),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
        qk_norm=True,
        bos_token_id=c.get("bos_token_id", 2),
        eos_token_ids=eos_ids(c.get("eos_token_id", 1)),
        local_attention=_local_attention(f, layers),
        gemma3=Gemma3Config(query_pre_attn_scalar=f.number("query_pre_attn_scalar", 256),
                            local_rope_theta=local_theta),
    )
