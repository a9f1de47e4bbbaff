"""GLM-4.5 / GLM-4.6's HF config (`glm4_moe`, Glm4MoeConfig) -> ModelConfig (models/hf_config.py picks
this parser by model_type).

Every field is read as transformers' Glm4MoeConfig reads it (its defaults: GLM-4.5-Air's shapes), in
its 4.x layout (`rope_theta`, `partial_rotary_factor`) and its 5.x one (`rope_parameters`), or is one
inference never reads (llama4_config.INERT_FIELDS); any other field, and any value models/glm4_moe.py
does not implement, is refused naming it. The checkpoints' multi-token-prediction layers
(`num_nextn_predict_layers`) are not loaded.
"""

from __future__ import annotations

from typing import Any, Mapping

from infire_jax.models.config import DeepseekMoEConfig, Glm4Config, ModelConfig, eos_ids
from infire_jax.models.config_fields import Fields
from infire_jax.models.llama4_config import INERT_FIELDS
from infire_jax.models.llama_config import rope_scaling_from_hf

MODEL_TYPES = ("glm4_moe",)

_FIELDS = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "attention_bias", "moe_intermediate_size",
    "num_experts_per_tok", "n_shared_experts", "n_routed_experts", "routed_scaling_factor", "n_group", "topk_group",
    "first_k_dense_replace", "norm_topk_prob", "use_qk_norm", "bos_token_id", "eos_token_id",
    "num_nextn_predict_layers", "num_mtp_layers",
    "quantization_config"}  # a published fp8 checkpoint's: dequantized as read, or kept (loaders/kept_8bit.py)


def config_from_glm4_hf(c: Mapping[str, Any]) -> ModelConfig:
    f = Fields("GLM-4.5", c)
    f.only_known(_FIELDS | INERT_FIELDS, "a GLM-4.5 config")
    if c.get("hidden_act", "silu") != "silu":
        raise f.bad("hidden_act", c["hidden_act"], "only 'silu' is supported")
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    factor = f.of({**c, **rope}).number("partial_rotary_factor", 0.5)
    heads, hidden = f.int("num_attention_heads", 96), f.int("hidden_size", 4096)
    head_dim = f.of({"head_dim": c.get("head_dim") or hidden // heads}).int("head_dim", 128)
    rotary = int(head_dim * factor)
    if factor > 1 or rotary % 2:
        raise f.bad("partial_rotary_factor", factor, f"must rotate an even number of the {head_dim} head dimensions")
    layers, experts = f.int("num_hidden_layers", 46), f.int("n_routed_experts", 128)
    n_group = f.int("n_group", 1)
    if experts % n_group:
        raise f.bad("n_group", n_group, f"must divide the {experts} routed experts")
    return ModelConfig(
        architecture="glm4_moe",
        vocab_size=f.int("vocab_size", 151552),
        hidden_size=hidden,
        intermediate_size=f.int("intermediate_size", 10944),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=f.int("num_key_value_heads", 8),
        head_dim=head_dim,
        rms_norm_eps=f.number("rms_norm_eps", 1e-5),
        rope_theta=f.of({**c, **rope}).number("rope_theta", 10000.0),
        rope_scaling=rope_scaling_from_hf(rope),
        max_position_embeddings=f.int("max_position_embeddings", 131072),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=bool(c.get("attention_bias", False)),
        qk_norm=bool(c.get("use_qk_norm", False)),
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=eos_ids(c.get("eos_token_id")),
        num_experts=experts,
        num_experts_per_tok=f.int("num_experts_per_tok", 8),
        moe_intermediate_size=f.int("moe_intermediate_size", 1408),
        norm_topk_prob=bool(c.get("norm_topk_prob", True)),
        deepseek_moe=DeepseekMoEConfig(n_group=n_group, topk_group=f.int("topk_group", 1),
                                       routed_scaling_factor=f.number("routed_scaling_factor", 1.0),
                                       num_shared_experts=f.int("n_shared_experts", 1, lo=0),
                                       first_k_dense_replace=f.int("first_k_dense_replace", 1, lo=0)),
        glm4=Glm4Config(rotary_dim=rotary),
    )
