"""The Llama-architecture families' configs (Llama, Mistral, Qwen2/3, Mixtral, Qwen3-MoE) -> ModelConfig:
from an HF `config.json` (models/hf_config.py picks this parser by model_type) or GGUF metadata.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from infire_jax.errors import UnsupportedModelError
from infire_jax.models.config import ModelConfig, RopeScaling, eos_ids

# HF `model_type` -> our architecture family.
MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "mistral3": "llama",  # Mistral Small 3.1 / 3.2's language model (`text_config`); its vision tower is not loaded
    "phi3": "llama",  # Phi-3 / Phi-4: q/k/v and gate/up fused in the checkpoint (split at load)
    "smollm3": "llama",  # SmolLM3: every `no_rope_layer_interval`-th layer does not rotate q and k (NoPE)
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mixtral": "mixtral",
    "qwen3_moe": "qwen3_moe",
}
# GGUF `general.architecture` -> our architecture family (dense models only).
_GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def rope_scaling_from_hf(raw: Mapping[str, Any] | None, max_position_embeddings: int | None = None
                         ) -> RopeScaling | None:
    """`max_position_embeddings`: the config's, YaRN's original context where the scaling names none;
    None: YaRN is refused (the families checked against transformers with it pass theirs)."""
    if not raw:
        return None
    kind = raw.get("rope_type", raw.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", factor=float(raw["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            factor=float(raw["factor"]),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
        )
    if kind == "yarn" and max_position_embeddings is not None:  # Qwen2.5's and Qwen3's long context
        if raw.get("attention_factor") is not None:
            raise UnsupportedModelError("rope_scaling.attention_factor is not supported; give mscale/mscale_all_dim")
        return RopeScaling("yarn", factor=float(raw["factor"]),
                           original_max_position_embeddings=int(raw.get("original_max_position_embeddings")
                                                                or max_position_embeddings),
                           beta_fast=float(raw.get("beta_fast") or 32), beta_slow=float(raw.get("beta_slow") or 1),
                           mscale=float(raw.get("mscale") or 0), mscale_all_dim=float(raw.get("mscale_all_dim") or 0),
                           truncate=bool(raw.get("truncate", True)))
    if kind == "longrope" and max_position_embeddings is not None:  # Phi-3.5's and Phi-4-mini's
        return _longrope(raw, max_position_embeddings)
    supported = "default, linear, llama3" + (", yarn, longrope" if max_position_embeddings is not None else "")
    raise UnsupportedModelError(f"unsupported rope_scaling type {kind!r} (supported: {supported})")


def _longrope(raw: Mapping[str, Any], max_position_embeddings: int) -> RopeScaling:
    """LongRoPE as transformers computes it (the context it extends: `original_max_position_embeddings`,
    the config's own field first; the factor, else the extension's ratio; the attention factor, else
    sqrt(1 + ln(factor) / ln(original context)) above a factor of 1), with one set of divisors for every
    position, as vLLM: the long factors where the checkpoint extends its original context, else the
    short ones (an engine serving no more than the original context takes the short ones:
    config.served_rope). transformers instead rotates a sequence by the short factors until it outgrows the
    original context and recomputes it then with the long ones, which a paged cache shared between
    requests cannot do: a short sequence here is rotated as transformers rotates a long one."""
    original = int(raw.get("original_max_position_embeddings") or max_position_embeddings)
    factor = float(raw.get("factor") or max_position_embeddings / original)
    attention = raw.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    short, long = (raw.get(k) for k in ("short_factor", "long_factor"))
    for name, f in (("short_factor", short), ("long_factor", long)):
        if not isinstance(f, list) or not f or not all(isinstance(v, (int, float)) and v > 0 for v in f):
            raise UnsupportedModelError(f"rope_scaling.{name} must be a list of positive numbers, got {f!r:.200}")
    if len(short) != len(long):
        raise UnsupportedModelError(f"rope_scaling's short_factor ({len(short)}) and long_factor ({len(long)}) "
                                    "must have one entry per rotated frequency each")
    extends = max_position_embeddings > original
    return RopeScaling("longrope", factor=factor, original_max_position_embeddings=original,
                       freq_factors=tuple(map(float, long if extends else short)), attention_factor=float(attention),
                       short_factors=tuple(map(float, short)) if extends else ())


# transformers' defaults for a config.json without `sliding_window` (MistralConfig's and the Qwen configs' 4096,
# MixtralConfig's none) and without `max_window_layers` (Qwen2Config's and Qwen3Config's 28).
_DEFAULT_WINDOW = {"mistral": 4096, "qwen2": 4096, "qwen3": 4096, "qwen3_moe": 4096}
_DEFAULT_MAX_WINDOW_LAYERS = 28


def smollm3_rope_layers(hf: Mapping[str, Any], num_layers: int) -> list[bool]:
    """Which layers rotate q and k, as transformers' SmolLM3Config reads them: `no_rope_layers` (1: RoPE,
    0: NoPE) or, absent, every `no_rope_layer_interval`-th layer NoPE."""
    given = hf.get("no_rope_layers")
    if given is None:
        interval = int(hf.get("no_rope_layer_interval", 4))
        return [(i + 1) % interval != 0 for i in range(num_layers)]
    if not isinstance(given, list) or len(given) != num_layers or any(v not in (0, 1) for v in given):
        raise UnsupportedModelError(f"no_rope_layers must give 0 (NoPE) or 1 (RoPE) for each of the {num_layers} "
                                    f"layers, got {given!r}")
    return [bool(v) for v in given]


def sliding_window_layers(hf: Mapping[str, Any], model_type: str, num_layers: int) -> tuple[tuple[int, int], ...]:
    """Each layer's (chunk, window) as ModelConfig.local_attention holds it, following transformers:

    - mistral, mixtral, phi3: a `sliding_window` applies to every layer (null: none);
    - qwen2, qwen3: only with `use_sliding_window`, on the layers its `layer_types` calls
      "sliding_attention", by default those from `max_window_layers` on; qwen3_moe: every layer;
    - smollm3: only with `use_sliding_window`, as `layer_types` says, by default on its NoPE layers.

    transformers' window W lets the query at p see the keys p - W < k <= p (masking_utils'
    `sliding_window_overlay`; flash attention's window (W - 1, 0)): W keys, the query's own
    included, which is LocalMask's [p - W + 1, p] with the same W, so W is taken as it is."""
    if model_type == "llama" and hf.get("use_sliding_window") and hf.get("sliding_window"):
        raise UnsupportedModelError("use_sliding_window is set, but transformers' llama has no sliding-window attention")
    slides_if_asked = model_type.startswith(("qwen", "smollm3"))
    on = hf.get("use_sliding_window", False) if slides_if_asked else model_type != "llama"
    window = hf.get("sliding_window", _DEFAULT_WINDOW.get(model_type)) if on else None
    if not window:
        return ()
    if not isinstance(window, int) or window < 1:
        raise UnsupportedModelError(f"sliding_window must be a positive integer, got {window!r}")
    if model_type not in ("qwen2", "qwen3", "smollm3"):
        return ((0, window),) * num_layers
    if model_type == "smollm3":
        default = ["full_attention" if r else "sliding_attention" for r in smollm3_rope_layers(hf, num_layers)]
    else:
        first = int(hf.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS))
        default = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    types = hf.get("layer_types") or default
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"layer_types must name full_attention or sliding_attention for each of the "
                                    f"{num_layers} layers, got {types!r}")
    return tuple((0, window) if t == "sliding_attention" else (0, 0) for t in types)


def mistral3_text_config(hf: Mapping[str, Any]) -> dict[str, Any]:
    """A `mistral3` config's language model: its `text_config` (a Mistral), with the wrapper's eos / bos
    ids (generation reads those) and tying (transformers 5 ties by it) where the wrapper has them."""
    text = hf.get("text_config")
    if not isinstance(text, Mapping) or text.get("model_type", "mistral") != "mistral":
        raise UnsupportedModelError(f"a mistral3 config's text_config must be a mistral model's, got {text!r:.200}")
    outer = {k: hf[k] for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings") if k in hf}
    return {**text, **outer, "model_type": "mistral"}


def config_from_llama_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Builds a ModelConfig from a HF `config.json` dict (transformers 4.x and 5.x layouts) of one of
    MODEL_TYPES."""
    if hf.get("model_type") == "mistral3":
        hf = mistral3_text_config(hf)
    model_type = hf.get("model_type")
    arch = MODEL_TYPES.get(model_type or "")
    if arch is None:
        raise UnsupportedModelError(f"model_type {model_type!r} is not one of {sorted(MODEL_TYPES)}")
    if hf.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=True is not supported")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' two names of one function; the MLP is SwiGLU
        raise UnsupportedModelError(f"hidden_act={act!r} is not supported (only silu: a SwiGLU MLP)")
    rope_params = hf.get("rope_parameters") or {}
    rope_raw = hf.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default") != "default" else None)
    if model_type == "phi3" and rope_raw and rope_raw.get("rope_type", rope_raw.get("type")) in ("su", "yarn"):
        rope_raw = {**rope_raw, "rope_type": "longrope"}  # Phi3Config's names of LongRoPE in early checkpoints
    if model_type == "phi3" and rope_raw and "original_max_position_embeddings" in hf:
        rope_raw = {**rope_raw, "original_max_position_embeddings": hf["original_max_position_embeddings"]}
    rope_theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim") or hidden // num_heads
    partial = float(hf.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise UnsupportedModelError(f"partial_rotary_factor={partial} must rotate an even number of the "
                                    f"{head_dim} head dimensions")
    moe = arch in ("mixtral", "qwen3_moe")
    if arch == "qwen3_moe" and hf.get("mlp_only_layers"):
        raise UnsupportedModelError("qwen3_moe with mlp_only_layers is not supported")
    if arch == "qwen3_moe" and int(hf.get("decoder_sparse_step", 1)) != 1:
        raise UnsupportedModelError("qwen3_moe with decoder_sparse_step != 1 is not supported")
    num_layers = int(hf["num_hidden_layers"])
    scaling = rope_scaling_from_hf(rope_raw, int(hf.get("max_position_embeddings", 4096)))
    if scaling is not None and scaling.kind == "longrope" and len(scaling.freq_factors) != rotary_dim // 2:
        raise UnsupportedModelError(f"rope_scaling's factors have {len(scaling.freq_factors)} entries; the "
                                    f"{rotary_dim} rotated dimensions have {rotary_dim // 2} frequencies")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf.get("intermediate_size", 0)),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=scaling,
        rotary_dim=rotary_dim if rotary_dim < head_dim else 0,
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf.get("eos_token_id")),
        num_experts=int(hf.get("num_local_experts", hf.get("num_experts", 0))) if moe else 0,
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 0)) if moe else 0,
        moe_intermediate_size=int(hf.get("moe_intermediate_size", hf.get("intermediate_size", 0))) if moe else 0,
        # HF Qwen3MoeConfig defaults to False; Mixtral always renormalises.
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)) if arch == "qwen3_moe" else True,
        local_attention=sliding_window_layers(hf, model_type, num_layers),
        nope_layers=tuple(not r for r in smollm3_rope_layers(hf, num_layers)) if model_type == "smollm3" else (),
    )


def config_from_gguf(meta: Mapping[str, Any], *, has_output_weight: bool, has_qkv_bias: bool,
                     has_qk_norm: bool, rope_freq_factors: tuple[float, ...] | None = None) -> ModelConfig:
    """Builds a ModelConfig from GGUF metadata (keys are prefixed by the architecture name)."""
    gguf_arch = meta.get("general.architecture")
    arch = _GGUF_ARCHITECTURES.get(gguf_arch or "")
    if arch is None:
        raise UnsupportedModelError(f"unsupported GGUF architecture {gguf_arch!r}")

    def key(name, default=None):
        return meta.get(f"{gguf_arch}.{name}", default)

    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", key("rope.dimension_count", hidden // num_heads)))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(key("vocab_size", len(tokens) if tokens is not None else 0))
    scaling = None
    stype = key("rope.scaling.type")
    if stype == "linear":
        scaling = RopeScaling("linear", factor=float(key("rope.scaling.factor")))
    elif stype not in (None, "none"):
        raise UnsupportedModelError(f"unsupported GGUF rope scaling {stype!r}")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rope_freq_factors=rope_freq_factors,
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings=not has_output_weight,
        attention_bias=has_qkv_bias,
        qk_norm=has_qk_norm,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids(eos),
    )
