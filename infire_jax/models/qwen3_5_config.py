"""Qwen3.5's HF config (`qwen3_5_text`, Qwen3_5TextConfig; or `qwen3_5`, Qwen3_5Config, whose
`text_config` is its language model), Qwen3.5-MoE's (`qwen3_5_moe_text`, `qwen3_5_moe`; Qwen3.6's too) and
Qwen3-Next's (`qwen3_next`: the same layers, its projections laid out otherwise, loaders/qwen3_5_hf.py)
-> ModelConfig (models/hf_config.py picks this parser by model_type).

Every field is read as transformers' Qwen3_5TextConfig reads it, with its defaults: `layer_types`, or
every `full_attention_interval`-th layer an attention layer; RoPE from `rope_parameters` (5.x) or
`rope_theta` / `partial_rotary_factor` (flat). The layers must come in whole groups of linear layers and
one attention layer (every published Qwen3.5 does; models/qwen3_5.py scans such groups). Multimodal RoPE
(`mrope_section`) rotates text tokens as plain RoPE (all three position ids are the token's), so a text
prompt needs nothing more; the vision tower of a `qwen3_5` checkpoint is not loaded, and the model takes
text. The multi-token-prediction layer (`mtp_*`) runs only for speculation (speculative/mtp_loader.py).
Any other field, or a value models/qwen3_5.py does not implement, is refused naming it.
"""

from __future__ import annotations

from typing import Any, Mapping

from infire_jax.models.config import GatedDeltaNetConfig, ModelConfig, eos_ids
from infire_jax.models.config_fields import Fields
from infire_jax.models.llama4_config import INERT_FIELDS

MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
# A multimodal config's model_type -> its text_config's.
_TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}

_FIELDS = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor", "attention_bias", "head_dim",
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "layer_types", "full_attention_interval", "bos_token_id", "eos_token_id",
    "attn_output_gate", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "mamba_ssm_dtype", "mlp_only_layers",
    "quantization_config"}  # a published fp8 / int4 checkpoint's: dequantized as read (loaders/hf_quantized.py)
# Qwen3.5-MoE's besides (every layer's MLP is sparse; `intermediate_size`, where given, is not used), and
# Qwen3-Next's (which may make layers dense: refused, no published model does).
_MOE_FIELDS = {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
               "norm_topk_prob"}
_NEXT_FIELDS = {"decoder_sparse_step"}
_MOE_TYPES = ("qwen3_5_moe_text", "qwen3_next")
# A multimodal `qwen3_5` config's own fields beside its text_config (the vision tower's are not read).
_WRAPPER_FIELDS = {"model_type", "text_config", "vision_config", "image_token_id", "video_token_id",
                   "vision_start_token_id", "vision_end_token_id", "tie_word_embeddings", "eos_token_id",
                   "bos_token_id", "hidden_size", "quantization_config"}
_ROPE_FIELDS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}
_LAYER_TYPES = ("linear_attention", "full_attention")
F = "Qwen3.5"  # the family refusals name


def text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config: a `qwen3_5_text` (`qwen3_5_moe_text`) config as it is, a `qwen3_5`
    (`qwen3_5_moe`) one's `text_config` with the wrapper's eos / bos ids and tying where it has them."""
    if hf.get("model_type") not in _TEXT_TYPES:
        return dict(hf)
    return Fields(F, hf).language_model(_WRAPPER_FIELDS | INERT_FIELDS, _TEXT_TYPES[hf["model_type"]])


def _rope(f: Fields, head_dim: int) -> tuple[float, int]:
    """(theta, rotary dims): RoPE of the default kind over the first partial_rotary_factor of each head."""
    c = f.c
    params = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    unknown = sorted(set(params) - _ROPE_FIELDS)
    if unknown:
        raise f.bad(f"rope_parameters.{unknown[0]}", params[unknown[0]], "not a field Qwen3.5's RoPE reads")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise f.bad("rope_parameters.rope_type", kind, "only the default RoPE is supported")
    theta = f.of({"rope_theta": params.get("rope_theta", c.get("rope_theta", 10_000.0))}).number("rope_theta", 0)
    factor = f.of({"partial_rotary_factor": params.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))}
                  ).number("partial_rotary_factor", 0)
    rotary = int(head_dim * factor)
    if factor > 1 or rotary % 2 or rotary == 0:
        raise f.bad("partial_rotary_factor", factor, f"must rotate an even number of the head's {head_dim} dims")
    return theta, rotary


def _interval(f: Fields, layers: int) -> int:
    """Every interval-th layer attends: `layer_types` (which must follow that pattern), else
    `full_attention_interval` (transformers' rule)."""
    interval = f.int("full_attention_interval", 4)
    types = f.c.get("layer_types")
    if types is None:
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in _LAYER_TYPES for t in types):
        raise f.bad("layer_types", types, f"must give one of {_LAYER_TYPES} for each of the {layers} layers")
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    interval = full[0] + 1 if full else 0
    if not full or layers % interval or full != list(range(interval - 1, layers, interval)):
        raise f.bad("layer_types", types, "only whole groups of linear layers each ending in an attention layer "
                    "are supported")
    return interval


def config_from_qwen3_5_hf(hf: Mapping[str, Any]) -> ModelConfig:
    c = text_config(hf)
    f = Fields(F, c)
    moe, nxt = c.get("model_type") in _MOE_TYPES, c.get("model_type") == "qwen3_next"
    f.only_known(_FIELDS | INERT_FIELDS | (_MOE_FIELDS if moe else set()) | (_NEXT_FIELDS if nxt else set()),
                 "a Qwen3.5 text config")
    if moe and not nxt and c.get("norm_topk_prob", True) is not True:
        raise f.bad("norm_topk_prob", c["norm_topk_prob"], "Qwen3.5-MoE renormalizes its top-k weights")
    if nxt and c.get("decoder_sparse_step", 1) != 1:
        raise f.bad("decoder_sparse_step", c["decoder_sparse_step"], "only a MoE on every layer is supported")
    for field, want in (("attention_bias", False), ("attn_output_gate", True), ("hidden_act", "silu"),
                        ("mlp_only_layers", [])):
        if c.get(field, want) != want:
            raise f.bad(field, c[field], f"only {want!r} is supported")
    layers = f.int("num_hidden_layers", 48 if nxt else 40 if moe else 32)
    head_dim = f.int("head_dim", 256)
    theta, rotary = _rope(f, head_dim)
    k_heads, v_heads = f.int("linear_num_key_heads", 16), f.int("linear_num_value_heads", 32)
    if v_heads % k_heads:
        raise f.bad("linear_num_value_heads", v_heads, f"must be a multiple of linear_num_key_heads={k_heads}")
    return ModelConfig(
        architecture="qwen3_5",
        vocab_size=f.int("vocab_size", 151_936 if nxt else 248_320),
        hidden_size=f.int("hidden_size", 2048 if moe else 4096),
        intermediate_size=0 if moe else f.int("intermediate_size", 12_288),
        num_experts=f.int("num_experts", 512 if nxt else 256) if moe else 0,
        num_experts_per_tok=f.int("num_experts_per_tok", 10 if nxt else 8) if moe else 0,
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        moe_intermediate_size=f.int("moe_intermediate_size", 512) if moe else 0,
        num_layers=layers,
        num_heads=f.int("num_attention_heads", 16),
        num_kv_heads=f.int("num_key_value_heads", 2 if moe else 4),
        head_dim=head_dim,
        rms_norm_eps=f.number("rms_norm_eps", 1e-6),
        rope_theta=theta,
        max_position_embeddings=f.int("max_position_embeddings", 32_768),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        qk_norm=True,
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=eos_ids(c.get("eos_token_id")),
        gated_delta=GatedDeltaNetConfig(
            interval=_interval(f, layers), num_k_heads=k_heads, num_v_heads=v_heads,
            k_head_dim=f.int("linear_key_head_dim", 128),
            v_head_dim=f.int("linear_value_head_dim", 128), conv_kernel=f.int("linear_conv_kernel_dim", 4, lo=2),
            rotary_dim=rotary, shared_expert_size=f.int("shared_expert_intermediate_size", 512) if moe else 0),
    )
