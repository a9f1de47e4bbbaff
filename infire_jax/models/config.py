"""Static model configuration, parsed from an HF `config.json` or from GGUF metadata.

The config is a frozen dataclass so it can be a static (hashable) argument of jitted functions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from infire_jax.errors import UnsupportedModelError

# HF `model_type` / GGUF `general.architecture` -> our architecture family.
_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mixtral": "mixtral",
    "qwen3_moe": "qwen3_moe",
    "qwen3moe": "qwen3_moe",
    "deepseek_v3": "deepseek_v3",
}
# HF model types of the DeepSeek-V3 family (Kimi K2 is DeepSeek-V3; Kimi K2.5 wraps it in `text_config`).
_DEEPSEEK_TYPES = ("deepseek_v3", "kimi_k2", "kimi_k25")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "linear", "llama3" or "yarn" (DeepSeek-V3 family only)."""

    kind: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (models/yarn.py)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention sizes (DeepSeek-V3 family)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclasses.dataclass(frozen=True)
class DeepseekMoEConfig:
    """DeepSeek-V3 MoE: grouped sigmoid router with score-correction bias, shared experts, dense first layers."""

    n_group: int
    topk_group: int
    routed_scaling_factor: float
    num_shared_experts: int
    first_k_dense_replace: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # Per-frequency divisors stored by GGUF files of Llama 3.x (`rope_freqs.weight`).
    rope_freq_factors: tuple[float, ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (0 experts means a dense MLP).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # DeepSeek-V3 family (architecture "deepseek_v3"; models/deepseek_config.py parses and checks them).
    mla: MLAConfig | None = None
    deepseek_moe: DeepseekMoEConfig | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def __post_init__(self):
        if self.architecture not in set(_ARCHITECTURES.values()):
            raise UnsupportedModelError(f"unsupported architecture {self.architecture!r}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.is_moe and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise UnsupportedModelError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, {self.num_experts}]")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        if d.get("rope_freq_factors") is not None:
            d["rope_freq_factors"] = tuple(d["rope_freq_factors"])
        if d.get("mla") is not None:
            d["mla"] = MLAConfig(**d["mla"])
        if d.get("deepseek_moe") is not None:
            d["deepseek_moe"] = DeepseekMoEConfig(**d["deepseek_moe"])
        return cls(**d)

    def param_count(self) -> int:
        """Number of weights, counted from the shapes (embedding and head counted once if tied)."""
        if self.mla is not None:
            from infire_jax.models.deepseek_config import deepseek_param_count

            return deepseek_param_count(self)
        e, hd = self.hidden_size, self.head_dim
        attn = e * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
        if self.attention_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        if self.is_moe:
            mlp = self.num_experts * 3 * e * self.moe_intermediate_size + e * self.num_experts
        else:
            mlp = 3 * e * self.intermediate_size
        norms = 2 * e + (2 * hd if self.qk_norm else 0)
        head = 0 if self.tie_word_embeddings else self.vocab_size * e
        return self.num_layers * (attn + mlp + norms) + self.vocab_size * e + head + e


def _rope_scaling_from_hf(raw: Mapping[str, Any] | None) -> RopeScaling | None:
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
    raise UnsupportedModelError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


def _eos_ids(raw: Any) -> tuple[int, ...]:
    if raw is None:
        return ()
    if isinstance(raw, (list, tuple)):
        return tuple(int(x) for x in raw)
    return (int(raw),)


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """Builds a ModelConfig from a HF `config.json` dict (transformers 4.x and 5.x layouts)."""
    model_type = hf.get("model_type")
    if model_type in _DEEPSEEK_TYPES:
        from infire_jax.models.deepseek_config import config_from_deepseek_hf

        return config_from_deepseek_hf(hf)
    arch = _ARCHITECTURES.get(model_type or "")
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r}; supported: {sorted(_ARCHITECTURES)}")
    # Qwen2/3 gate the window with use_sliding_window; Mistral and Mixtral apply any window given.
    window_on = hf.get("use_sliding_window") if "use_sliding_window" in hf else model_type in ("mistral", "mixtral")
    if window_on and hf.get("sliding_window"):
        raise UnsupportedModelError("sliding-window attention is not supported")
    if hf.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=True is not supported")
    rope_params = hf.get("rope_parameters") or {}
    rope_raw = hf.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default") != "default" else None)
    rope_theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim") or hidden // num_heads
    moe = arch in ("mixtral", "qwen3_moe")
    if arch == "qwen3_moe" and hf.get("mlp_only_layers"):
        raise UnsupportedModelError("qwen3_moe with mlp_only_layers is not supported")
    if arch == "qwen3_moe" and int(hf.get("decoder_sparse_step", 1)) != 1:
        raise UnsupportedModelError("qwen3_moe with decoder_sparse_step != 1 is not supported")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf.get("intermediate_size", 0)),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=_rope_scaling_from_hf(rope_raw),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf.get("eos_token_id")),
        num_experts=int(hf.get("num_local_experts", hf.get("num_experts", 0))) if moe else 0,
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 0)) if moe else 0,
        moe_intermediate_size=int(hf.get("moe_intermediate_size", hf.get("intermediate_size", 0))) if moe else 0,
        # HF Qwen3MoeConfig defaults to False; Mixtral always renormalises.
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)) if arch == "qwen3_moe" else True,
    )


def config_from_gguf(meta: Mapping[str, Any], *, has_output_weight: bool, has_qkv_bias: bool,
                     has_qk_norm: bool, rope_freq_factors: tuple[float, ...] | None = None) -> ModelConfig:
    """Builds a ModelConfig from GGUF metadata (keys are prefixed by the architecture name)."""
    gguf_arch = meta.get("general.architecture")
    arch = _ARCHITECTURES.get(gguf_arch or "")
    if arch is None or arch in ("mixtral", "qwen3_moe"):
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
        eos_token_ids=_eos_ids(eos),
    )
