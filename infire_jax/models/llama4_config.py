"""Llama 4's HF config (Scout, Maverick: `llama4` with a `text_config`, or `llama4_text`) -> ModelConfig
(models/hf_config.py picks this parser by model_type).

Every field of the text config is read as transformers' Llama4TextConfig reads it, or is one that
inference never reads (dropout, initialisation, training losses, generation defaults); any other
field, and any value the model does not implement, is refused here naming the field, so an unusual
checkpoint fails at load instead of producing wrong tokens.
"""

from __future__ import annotations

from typing import Any, Mapping

from infire_jax.errors import UnsupportedModelError
from infire_jax.models.config import Llama4Config, ModelConfig, eos_ids
from infire_jax.models.llama_config import rope_scaling_from_hf

MODEL_TYPES = ("llama4", "llama4_text")

# The text config's fields that set the model (read below).
_TEXT_FIELDS = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "intermediate_size_mlp", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
    "rms_norm_eps", "bos_token_id", "eos_token_id", "tie_word_embeddings", "num_experts_per_tok",
    "num_local_experts", "moe_layers", "interleave_moe_layer_step", "use_qk_norm", "rope_theta", "rope_scaling",
    "rope_parameters", "no_rope_layers", "no_rope_layer_interval", "attention_chunk_size", "layer_types",
    "attn_temperature_tuning", "floor_scale", "attn_scale", "attention_bias",
    "quantization_config"}  # a published 8-bit checkpoint's: dequantized as read, or kept (loaders/kept_8bit.py)
# Fields that inference does not read: training (dropout, router losses and jitter), initialisation,
# caching hints, and what every transformers config carries (generation defaults, labels, bookkeeping).
INERT_FIELDS = {
    "attention_dropout", "initializer_range", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
    "use_cache", "pad_token_id", "cache_implementation", "for_llm_compressor", "torch_dtype", "dtype",
    "transformers_version", "architectures", "_name_or_path", "_attn_implementation_autoset", "_commit_hash",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "use_bfloat16", "tf_legacy_loss",
    "pruned_heads", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "cross_attention_hidden_size",
    "add_cross_attention", "tie_encoder_decoder", "max_length", "min_length", "do_sample", "early_stopping",
    "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "finetuning_task", "id2label", "label2id", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "problem_type"}
# The multimodal wrapper's own fields; its vision tower is read apart (loaders/vision.py, vision/config.py).
_WRAPPER_FIELDS = {"model_type", "text_config", "vision_config", "boi_token_index", "eoi_token_index",
                   "image_token_index", "tie_word_embeddings", "quantization_config"}
_LAYER_TYPES = ("chunked_attention", "full_attention")


def _bad(field: str, value: Any, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"Llama 4 config field {field}={value!r}: {why}")


def text_config(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's config: `text_config` of a `llama4` (multimodal) config, or a `llama4_text` one
    itself. Fields of neither kind are refused, naming them."""
    if hf.get("model_type") == "llama4_text":
        return hf
    unknown = sorted(set(hf) - _WRAPPER_FIELDS - INERT_FIELDS)
    if unknown:
        raise _bad(unknown[0], hf[unknown[0]], "not a field of a Llama 4 config")
    text = hf.get("text_config")
    if not isinstance(text, Mapping):
        raise _bad("text_config", text, "a llama4 config needs its text model's config")
    return text


def _int(c: Mapping[str, Any], field: str, default: Any = None, lo: int = 1) -> int:
    value = c.get(field, default)
    if value is None and default is None:
        raise _bad(field, None, "is required")
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise _bad(field, value, f"must be an integer >= {lo}")
    return value


def _rope_layers(c: Mapping[str, Any], layers: int) -> tuple[bool, ...]:
    """Which layers rotate q and k: `no_rope_layers` (1: RoPE, 0: NoPE; transformers reads its first
    `num_hidden_layers` entries and, empty or absent, derives it from `no_rope_layer_interval`)."""
    given = c.get("no_rope_layers")
    if not given:
        interval = _int(c, "no_rope_layer_interval", 4)
        return tuple((i + 1) % interval != 0 for i in range(layers))
    if not isinstance(given, list) or len(given) < layers or any(v not in (0, 1) for v in given):
        raise _bad("no_rope_layers", given, f"must list 0 (NoPE) or 1 (RoPE) for each of the {layers} layers")
    return tuple(bool(v) for v in given[:layers])


def _moe_step(c: Mapping[str, Any], layers: int) -> int:
    """The MoE period P: layers P-1, 2P-1, ... are MoE layers. `moe_layers`, when given, must name
    exactly those (its entries past the last layer are ignored, as transformers does)."""
    step = _int(c, "interleave_moe_layer_step", 1)
    given = c.get("moe_layers")
    if given is not None:
        if not isinstance(given, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in given):
            raise _bad("moe_layers", given, "must be a list of layer indices")
        if sorted({i for i in given if 0 <= i < layers}) != list(range(step - 1, layers, step)):
            raise _bad("moe_layers", given, f"does not match interleave_moe_layer_step={step} (layers "
                       f"{list(range(step - 1, layers, step))[:8]}... of {layers}); only that interleaving is supported")
    return step


def _local_attention(c: Mapping[str, Any], rope: tuple[bool, ...]) -> tuple[tuple[int, int], ...]:
    """Each layer's (chunk, window): `layer_types` if given, else transformers' rule (RoPE layers attend
    within `attention_chunk_size` chunks, NoPE layers globally; no chunk size: every layer global)."""
    chunk = c.get("attention_chunk_size", 8192)
    if chunk is not None:
        chunk = _int(c, "attention_chunk_size")
    types = c.get("layer_types")
    if types is None:
        types = ["chunked_attention" if r and chunk is not None else "full_attention" for r in rope]
    if not isinstance(types, list) or len(types) != len(rope) or any(t not in _LAYER_TYPES for t in types):
        raise _bad("layer_types", types, f"must give one of {_LAYER_TYPES} for each of the {len(rope)} layers")
    if chunk is None and "chunked_attention" in types:
        raise _bad("layer_types", types, "names chunked_attention layers but attention_chunk_size is null")
    return tuple((chunk, 0) if t == "chunked_attention" else (0, 0) for t in types)


def config_from_llama4_hf(hf: Mapping[str, Any]) -> ModelConfig:
    c = text_config(hf)
    unknown = sorted(set(c) - _TEXT_FIELDS - INERT_FIELDS)
    if unknown:
        raise _bad(unknown[0], c[unknown[0]], "not a field of a Llama 4 text config")
    if c.get("model_type", "llama4_text") != "llama4_text":
        raise _bad("text_config.model_type", c["model_type"], "expected llama4_text")
    for field, want in (("hidden_act", "silu"), ("attention_bias", False)):
        if c.get(field, want) != want:
            raise _bad(field, c[field], f"only {want!r} is supported")
    tuning = c.get("attn_temperature_tuning", True)
    if not isinstance(tuning, (bool, int)) or tuning < 0:  # published Scout / Maverick configs say 4: on
        raise _bad("attn_temperature_tuning", tuning, "must be a boolean (or a non-negative integer, true if > 0)")
    use_qk_norm = c.get("use_qk_norm", True)
    if not isinstance(use_qk_norm, bool):
        raise _bad("use_qk_norm", use_qk_norm, "must be a boolean")
    floor_scale, attn_scale = c.get("floor_scale", 8192), c.get("attn_scale", 0.1)
    if isinstance(floor_scale, bool) or not isinstance(floor_scale, (int, float)) or floor_scale <= 0:
        raise _bad("floor_scale", floor_scale, "must be a positive number")
    if isinstance(attn_scale, bool) or not isinstance(attn_scale, (int, float)):
        raise _bad("attn_scale", attn_scale, "must be a number")
    layers, heads = _int(c, "num_hidden_layers"), _int(c, "num_attention_heads")
    hidden = _int(c, "hidden_size")
    rope = _rope_layers(c, layers)
    params = c.get("rope_parameters") or {}
    try:
        scaling = rope_scaling_from_hf(c.get("rope_scaling") or params)
    except KeyError as e:
        raise _bad("rope_scaling", c.get("rope_scaling") or params, f"is missing {e}") from None
    experts = _int(c, "num_local_experts", 16)
    return ModelConfig(
        architecture="llama4",
        vocab_size=_int(c, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(c, "intermediate_size_mlp", 16384),  # the dense layers' MLP
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=_int(c, "num_key_value_heads", heads),
        head_dim=_int(c, "head_dim", hidden // heads),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
        rope_theta=float(c.get("rope_theta", params.get("rope_theta", 500000.0))),
        rope_scaling=scaling,
        max_position_embeddings=_int(c, "max_position_embeddings", 131072),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", hf.get("tie_word_embeddings", False))),
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=eos_ids(c.get("eos_token_id")),
        num_experts=experts,
        num_experts_per_tok=_int(c, "num_experts_per_tok", 1),
        moe_intermediate_size=_int(c, "intermediate_size", 8192),  # each routed expert and the shared expert
        norm_topk_prob=False,
        local_attention=_local_attention(c, rope),
        llama4=Llama4Config(rope_layers=rope, moe_step=_moe_step(c, layers), qk_l2_norm=use_qk_norm,
                            temperature_tuning=bool(tuning), floor_scale=float(floor_scale),
                            attn_scale=float(attn_scale)),
    )
