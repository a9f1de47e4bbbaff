"""MiniMax-M2's HF config (`minimax_m2`, MiniMaxM2Config) -> ModelConfig (models/hf_config.py picks this
parser by model_type); models/glm4_moe.py runs it.

MiniMax-M2 is GQA attention whose q and k are RMS-normed over all their heads at once (`qk_norm_type`
"per_layer") and rotated on their first `rotary_dim` dimensions, and a MoE on every layer: a sigmoid
router whose score-correction bias chooses the top-k (no groups, no shared expert), the chosen scores
renormalised. Every field is read as transformers' MiniMaxM2Config reads it (its defaults: the published
model's), or is one the published config carries that inference never reads (the multi-token-prediction
modules, which are not loaded, and linear-attention settings of earlier MiniMax models, which must
select full attention); any other field or value is refused naming it.
"""

from __future__ import annotations

from typing import Any, Mapping

from infire_jax.models.config import DeepseekMoEConfig, Glm4Config, ModelConfig, eos_ids
from infire_jax.models.config_fields import Fields
from infire_jax.models.llama4_config import INERT_FIELDS
from infire_jax.models.llama_config import rope_scaling_from_hf

MODEL_TYPES = ("minimax_m2",)

_FIELDS = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "rotary_dim", "num_experts_per_tok",
    "num_local_experts", "bos_token_id", "eos_token_id", "use_qk_norm", "qk_norm_type", "scoring_func",
    "use_routing_bias", "routed_scaling_factor", "shared_intermediate_size", "attn_type_list",
    "layernorm_full_attention_beta", "layernorm_linear_attention_beta", "layernorm_mlp_beta",
    "quantization_config"}  # the published fp8 checkpoint's: dequantized as read, or kept (loaders/kept_8bit.py)
# The published config's fields that inference does not read: its multi-token-prediction modules, a
# width of earlier MiniMax models, vLLM's and remote code's settings.
_UNREAD = {"use_mtp", "num_mtp_modules", "mtp_transformer_layers", "mlp_intermediate_size", "max_model_len",
           "auto_map", "router_aux_loss_coef", "router_jitter_noise", "output_router_logits"}
# Fields with the one value the model implements.
_FIXED = {"use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True,
          "shared_intermediate_size": 0, "hidden_act": "silu", "layernorm_full_attention_beta": 1.0,
          "layernorm_linear_attention_beta": 1.0, "layernorm_mlp_beta": 1.0,
          "routed_scaling_factor": 1.0}  # transformers' router does not scale the weights


def config_from_minimax_m2_hf(c: Mapping[str, Any]) -> ModelConfig:
    f = Fields("MiniMax-M2", c)
    f.only_known(_FIELDS | _UNREAD | INERT_FIELDS, "a MiniMax-M2 config")
    for field, want in _FIXED.items():
        if field in c and c[field] != want:
            raise f.bad(field, c[field], f"only {want!r} is supported")
    if any(kind != 1 for kind in c.get("attn_type_list") or ()):
        raise f.bad("attn_type_list", c["attn_type_list"], "only full attention (1) on every layer is supported")
    heads, hidden = f.int("num_attention_heads", 48), f.int("hidden_size", 3072)
    head_dim = f.of({"head_dim": c.get("head_dim") or hidden // heads}).int("head_dim", 128)
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    factor = rope.get("partial_rotary_factor", c.get("partial_rotary_factor"))
    rotary = f.int("rotary_dim", round(head_dim * factor) if factor else head_dim)
    if rotary > head_dim or rotary % 2:
        raise f.bad("rotary_dim", rotary, f"must be an even number of at most the {head_dim} head dimensions")
    experts = f.int("num_local_experts", 256)
    return ModelConfig(
        architecture="minimax_m2",
        vocab_size=f.int("vocab_size", 200064),
        hidden_size=hidden,
        intermediate_size=f.int("intermediate_size", 1536),
        num_layers=f.int("num_hidden_layers", 62),
        num_heads=heads,
        num_kv_heads=f.int("num_key_value_heads", 8),
        head_dim=head_dim,
        rms_norm_eps=f.number("rms_norm_eps", 1e-6),
        rope_theta=f.of({**c, **rope}).number("rope_theta", 5_000_000.0),
        rope_scaling=rope_scaling_from_hf(rope),
        max_position_embeddings=f.int("max_position_embeddings", 196608),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        qk_norm=True,
        bos_token_id=c.get("bos_token_id", 200034),
        eos_token_ids=eos_ids(c.get("eos_token_id", 200020)),
        num_experts=experts,
        num_experts_per_tok=f.int("num_experts_per_tok", 8),
        moe_intermediate_size=f.int("intermediate_size", 1536),
        norm_topk_prob=True,
        deepseek_moe=DeepseekMoEConfig(n_group=1, topk_group=1, routed_scaling_factor=1.0, num_shared_experts=0,
                                       first_k_dense_replace=0),
        glm4=Glm4Config(rotary_dim=rotary, qk_norm_whole=True),
    )
