"""The DeepSeek-V3 family's HF config (DeepSeek-V3, Kimi K2, Kimi K2.5's text model) -> ModelConfig
(models/hf_config.py picks this parser by model_type).

Everything the model does not implement is refused here, naming the field, so an unusual checkpoint
fails at load instead of producing wrong tokens.
"""

from __future__ import annotations

from typing import Any, Mapping

from infire_jax.errors import UnsupportedModelError
from infire_jax.models.config import DeepseekMoEConfig, MLAConfig, ModelConfig, RopeScaling, eos_ids

# HF model types of the DeepSeek-V3 family (Kimi K2 is DeepSeek-V3; Kimi K2.5 wraps it in `text_config`).
MODEL_TYPES = ("deepseek_v3", "kimi_k2", "kimi_k25")


def _bad(field: str, value: Any, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"DeepSeek-V3 config field {field}={value!r}: {why}")


def text_config(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """Kimi K2.5 (`kimi_k25`) nests its language model's config in `text_config`; the others are flat."""
    if hf.get("model_type") != "kimi_k25":
        return hf
    text = hf.get("text_config")
    if not isinstance(text, Mapping):
        raise _bad("text_config", text, "kimi_k25 needs its language model's config")
    return text


def _yarn(hf: Mapping[str, Any]) -> RopeScaling | None:
    params = hf.get("rope_parameters") or {}
    raw = hf.get("rope_scaling") or params
    kind = raw.get("rope_type", raw.get("type", "default")) if raw else "default"
    if kind == "default":
        return None
    if kind != "yarn":
        raise _bad("rope_scaling.type", kind, "only yarn (or none) is supported for this family")
    if raw.get("attention_factor") is not None:
        raise _bad("rope_scaling.attention_factor", raw["attention_factor"],
                   "not supported; give mscale/mscale_all_dim")
    if raw.get("truncate", True) is not True:
        raise _bad("rope_scaling.truncate", raw["truncate"], "only the default (true) is supported")
    return RopeScaling("yarn", factor=float(raw["factor"]),
                       original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
                       beta_fast=float(raw.get("beta_fast") or 32), beta_slow=float(raw.get("beta_slow") or 1),
                       mscale=float(raw.get("mscale") or 0), mscale_all_dim=float(raw.get("mscale_all_dim") or 0))


def config_from_deepseek_hf(hf: Mapping[str, Any]) -> ModelConfig:
    c = text_config(hf)
    for field, want in (("hidden_act", "silu"), ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
                        ("moe_layer_freq", 1), ("attention_bias", False)):
        if c.get(field, want) != want:
            raise _bad(field, c[field], f"only {want!r} is supported")
    layers, dense = int(c["num_hidden_layers"]), int(c.get("first_k_dense_replace", 0))
    experts, k = int(c["n_routed_experts"]), int(c["num_experts_per_tok"])
    groups, topk_groups = int(c.get("n_group") or 1), int(c.get("topk_group") or 1)
    if not 0 <= dense <= layers:
        raise _bad("first_k_dense_replace", dense, f"must be in [0, num_hidden_layers={layers}]")
    if experts % groups:
        raise _bad("n_group", groups, f"must divide n_routed_experts={experts}")
    if not 0 < topk_groups <= groups:
        raise _bad("topk_group", topk_groups, f"must be in [1, n_group={groups}]")
    if experts // groups < 2:
        raise _bad("n_group", groups, "each group needs at least 2 experts (groups are scored by their top 2)")
    if not 0 < k <= topk_groups * (experts // groups):
        raise _bad("num_experts_per_tok", k, f"must be in [1, {topk_groups * (experts // groups)}] "
                   "(the experts of the topk_group chosen groups)")
    rope_params = c.get("rope_parameters") or {}
    heads = int(c["num_attention_heads"])
    if not c.get("q_lora_rank"):
        raise _bad("q_lora_rank", c.get("q_lora_rank"), "a low-rank q path is required (every DeepSeek-V3-family "
                   "checkpoint has one)")
    mla = MLAConfig(q_lora_rank=int(c["q_lora_rank"]), kv_lora_rank=int(c["kv_lora_rank"]),
                    qk_nope_head_dim=int(c["qk_nope_head_dim"]), qk_rope_head_dim=int(c["qk_rope_head_dim"]),
                    v_head_dim=int(c["v_head_dim"]))
    if mla.qk_rope_head_dim % 2:
        raise _bad("qk_rope_head_dim", mla.qk_rope_head_dim, "must be even")
    return ModelConfig(
        architecture="deepseek_v3",
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,  # every head reads the one shared latent; the pool holds no per-head keys
        head_dim=mla.qk_rope_head_dim,  # the rotary dimension, as HF's config.head_dim
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(c.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
        rope_scaling=_yarn(c),
        max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=eos_ids(c.get("eos_token_id")),
        num_experts=experts,
        num_experts_per_tok=k,
        moe_intermediate_size=int(c["moe_intermediate_size"]),
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        mla=mla,
        deepseek_moe=DeepseekMoEConfig(n_group=groups, topk_group=topk_groups,
                                       routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
                                       num_shared_experts=int(c.get("n_shared_experts") or 0),
                                       first_k_dense_replace=dense),
    )

