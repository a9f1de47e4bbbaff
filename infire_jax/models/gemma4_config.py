"""Gemma 4's HF config (`gemma4_text`, Gemma4TextConfig; or `gemma4`, Gemma4Config, whose `text_config`
is its language model) -> ModelConfig (models/hf_config.py picks this parser by model_type).

Fields are read as transformers' Gemma4TextConfig reads them, with its defaults. The full layers' head_dim
and kv heads come from `per_layer_config` (what transformers 5 writes: overrides by layer index) or, in
the published files, `global_head_dim` and `num_global_key_value_heads` (the latter only with
`attention_k_eq_v`, as transformers applies it). What models/gemma4.py does not implement is refused by
name: per-layer embeddings (`hidden_size_per_layer_input`), shared KV layers, the double-wide MLP and
bidirectional attention (the E2B / E4B and embedding variants), and a layer order other than blocks of
windowed layers each closed by one full layer. A `gemma4` checkpoint serves its language model only.
"""

from __future__ import annotations

from typing import Any, Mapping

from infire_jax.models.config import Gemma4Config, ModelConfig, eos_ids
from infire_jax.models.config_fields import Fields
from infire_jax.models.llama4_config import INERT_FIELDS

MODEL_TYPES = ("gemma4_text", "gemma4")

_FIELDS = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_activation", "max_position_embeddings", "rms_norm_eps",
    "bos_token_id", "eos_token_id", "tie_word_embeddings", "rope_parameters", "attention_bias", "sliding_window",
    "layer_types", "final_logit_softcapping", "use_bidirectional_attention", "vocab_size_per_layer_input",
    "hidden_size_per_layer_input", "attention_k_eq_v", "num_kv_shared_layers", "enable_moe_block",
    "use_double_wide_mlp", "num_experts", "top_k_experts", "moe_intermediate_size", "global_head_dim",
    "num_global_key_value_heads", "per_layer_config",
    "quantization_config"}  # a published quantized checkpoint's: dequantized as read (loaders/hf_quantized.py)
_WRAPPER_FIELDS = {"quantization_config", "model_type", "text_config", "vision_config", "audio_config", "audio_token_id", "boa_token_id",
                   "boi_token_id", "eoa_token_index", "eoa_token_id", "eoi_token_id", "image_token_id",
                   "video_token_id", "vision_soft_tokens_per_image", "eos_token_id", "bos_token_id",
                   "tie_word_embeddings"}
# (field, transformers' default, the values models/gemma4.py takes, why others are refused).
_LIMITS = (("hidden_size_per_layer_input", 256, (0, None), "per-layer embeddings (E2B / E4B) are not supported"),
           ("num_kv_shared_layers", 0, (0, None), "layers sharing another layer's KV are not supported"),
           ("use_double_wide_mlp", False, (False, None), "the double-wide MLP is not supported"),
           ("use_bidirectional_attention", None, (None, "vision"), "text attends causally (\"all\": not supported)"),
           ("attention_bias", False, (False, None), "attention biases are not supported"))
_LAYER_TYPES = ("sliding_attention", "full_attention")
F = "Gemma 4"


def _layer_kinds(f: Fields, layers: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """(period P, each layer's (0, window) or (0, 0)): `layer_types` must be blocks of P - 1 windowed
    layers and one full layer (transformers' default: every 6th full, the last forced full)."""
    types = f.c.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(t not in _LAYER_TYPES for t in types):
        raise f.bad("layer_types", types, f"must give one of {_LAYER_TYPES} for each of the {layers} layers")
    period = types.index("full_attention") + 1 if "full_attention" in types else 0
    if not period or types != (["sliding_attention"] * (period - 1) + ["full_attention"]) * (layers // period):
        raise f.bad("layer_types", types, "must be blocks of windowed layers, each closed by one full layer")
    window = f.int("sliding_window", 512)
    return period, tuple((0, window if t == "sliding_attention" else 0) for t in types)


def _full_layer_shape(f: Fields, period: int, k_eq_v: bool) -> tuple[int, int]:
    """(head_dim, kv heads) of the full layers; every windowed layer must keep the config's own."""
    c, d, hkv = f.c, f.int("head_dim", 256), f.int("num_key_value_heads", 4)
    per_layer = c.get("per_layer_config")
    if per_layer is None:
        heads = c.get("num_global_key_value_heads") if k_eq_v else None
        return f.int("global_head_dim", 512), hkv if heads is None else f.int("num_global_key_value_heads", 1)
    layers = f.int("num_hidden_layers", 30)
    shapes = {}
    for i in range(layers):
        o = per_layer.get(str(i), per_layer.get(i, {})) if isinstance(per_layer, Mapping) else None
        if not isinstance(o, Mapping) or set(o) - {"head_dim", "num_key_value_heads"}:
            raise f.bad("per_layer_config", per_layer, "must map layers to head_dim / num_key_value_heads overrides")
        shapes.setdefault((i + 1) % period == 0, set()).add((o.get("head_dim", d), o.get("num_key_value_heads", hkv)))
    if shapes[False] != {(d, hkv)} or len(shapes[True]) != 1:
        raise f.bad("per_layer_config", per_layer, "windowed layers must keep head_dim and num_key_value_heads, and "
                    "the full layers share one override")
    return next(iter(shapes[True]))


def _rope(f: Fields) -> tuple[float, float, float, float]:
    """(local theta, global theta, global rotated fraction, global factor), as `rope_parameters` gives them by
    layer type: the windowed layers' "default", the full layers' "proportional" (or "default": all rotated)."""
    params = f.c.get("rope_parameters") or {}
    local, full = (dict(params.get(t) or {}) for t in _LAYER_TYPES)
    if local.get("rope_type", "default") != "default":
        raise f.bad("rope_parameters.sliding_attention.rope_type", local["rope_type"], "only default is supported")
    kind = full.get("rope_type", "proportional" if not full else "default")
    if kind not in ("default", "proportional"):
        raise f.bad("rope_parameters.full_attention.rope_type", kind, "only proportional and default are supported")
    fraction = full.get("partial_rotary_factor", 0.25 if not full else 1.0) if kind == "proportional" else 1.0
    sub = f.of({"rope_theta": local.get("rope_theta", 10_000.0), "global": full.get("rope_theta", 1_000_000.0),
                "partial_rotary_factor": fraction, "factor": full.get("factor", 1.0)})
    return (sub.number("rope_theta", 0), sub.number("global", 0), sub.number("partial_rotary_factor", 0),
            sub.number("factor", 0))


def pool_heads(hs: int, ds: int, hg: int, dg: int) -> int | None:
    """Heads of `ds` in the pool's per-token slot, wide enough for either kind: max(hs * ds, hg * dg) / ds,
    where each kind's kv heads fill it a whole number of times (models/gemma4.py); None where they do not."""
    slot = max(hs * ds, hg * dg)
    if slot % ds or slot % dg or (slot // dg) % hg or (slot // ds) % hs:
        return None
    return slot // ds


def config_from_gemma4_hf(hf: Mapping[str, Any]) -> ModelConfig:
    c = dict(hf) if hf.get("model_type") == "gemma4_text" else Fields(F, hf).language_model(
        _WRAPPER_FIELDS | INERT_FIELDS, "gemma4_text")
    f = Fields(F, c)
    f.only_known(_FIELDS | INERT_FIELDS, "a Gemma 4 text config")
    for field, default, ok, why in _LIMITS:
        if c.get(field, default) not in ok:
            raise f.bad(field, c.get(field, default), why)
    act = c.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise f.bad("hidden_activation", act, "only gelu_pytorch_tanh is supported")
    layers, heads = f.int("num_hidden_layers", 30), f.int("num_attention_heads", 8)
    period, local = _layer_kinds(f, layers)
    k_eq_v = bool(c.get("attention_k_eq_v", False))
    ds, hs = f.int("head_dim", 256), f.int("num_key_value_heads", 4)
    dg, hg = _full_layer_shape(f, period, k_eq_v)
    pool = pool_heads(hs, ds, hg, dg)
    if pool is None or heads % pool or heads % hs or heads % hg or heads % (pool * ds // dg):
        raise f.bad("per_layer_config", {"head_dim": dg, "num_key_value_heads": hg},
                    f"the full layers' kv heads x head_dim and the windowed layers' ({hs} x {ds}) must fill one "
                    f"KV slot a whole number of times each, dividing the {heads} query heads")
    moe = bool(c.get("enable_moe_block", False))
    local_theta, theta, fraction, factor = _rope(f)
    softcap = c.get("final_logit_softcapping")
    softcap = None if softcap is None else f.number("final_logit_softcapping", 0)
    return ModelConfig(
        architecture="gemma4",
        vocab_size=f.int("vocab_size", 262_144),
        hidden_size=f.int("hidden_size", 2304),
        intermediate_size=f.int("intermediate_size", 9216),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=pool,
        head_dim=ds,
        rms_norm_eps=f.number("rms_norm_eps", 1e-6),
        rope_theta=theta,
        max_position_embeddings=f.int("max_position_embeddings", 131_072),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
        qk_norm=True,
        bos_token_id=c.get("bos_token_id", 2),
        eos_token_ids=eos_ids(c.get("eos_token_id", 1)),
        num_experts=f.int("num_experts", None) if moe else 0,
        num_experts_per_tok=f.int("top_k_experts", None) if moe else 0,
        moe_intermediate_size=f.int("moe_intermediate_size", None) if moe else 0,
        local_attention=local,
        gemma4=Gemma4Config(period=period, sliding_kv_heads=hs, global_kv_heads=hg, global_head_dim=dg, k_eq_v=k_eq_v,
                            local_rope_theta=local_theta, global_rotary_fraction=fraction, global_rope_factor=factor,
                            final_logit_softcapping=softcap),
    )
