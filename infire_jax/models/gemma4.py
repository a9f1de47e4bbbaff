"""Gemma 4 decoder (gemma-4-31B dense, gemma-4-26B-A4B MoE; text): windowed and full layers of their own
shapes, sandwich norms, an optional MoE block beside the dense MLP.

Per layer (transformers' Gemma4TextDecoderLayer):
- q, k and v from the normed input; q and k RMS-normed over the head with a weight, v without one, and
  attention unscaled (scale 1). A full layer with `k_eq_v` has no v projection: v is its raw k. Windowed
  layers rotate q and k with their base; full layers ("proportional" RoPE) only the first
  `global_rotary_fraction` of each half, the frequencies spread over the whole head;
- h + post_attn_norm(o), then the MLP (GELU-tanh of gate times up) on mlp_norm(h); with experts, the
  router reads h itself (a weightless RMS norm, times its scale and hidden ** -0.5; softmax, top-k,
  renormalised, times each expert's scale), the experts mlp's input moe_norm(h), and the output is
  post_mlp_norm(post_mlp_norm_1(mlp) + post_moe_norm(experts)); h + that, all times `layer_scalar`.
Gemma 4's norms multiply by w itself (not Gemma 3's 1 + w). The embedding is scaled as Gemma 3's; the
logits are soft-capped (cap * tanh(logits / cap)).

The two kinds differ in kv heads, head_dim and weight shapes, so their weights are two stacks and the
forward scans blocks (`period` - 1 windowed layers, then a full one), as models/llama4.py's super-layers.
The KV pool stays one array: each token's slot holds ModelConfig.num_kv_heads x head_dim values
(gemma4_config.pool_heads: the wider kind's kv heads x head_dim). A layer views the pool with its own
head_dim ([..., slot / d, d], a reshape of the minor axes) and writes each of its kv heads slot / (hkv
* d) times over, so the attention kernels see plain GQA (query head j*G + i reads view head j*r +
i // (G / r), a copy of kv head j). On gemma-4-31B (windowed 16 x 256, full 4 x 512) the full layers'
keys and values each take twice their bytes; docs/ARCHITECTURE.md counts the cost.
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from infire_jax.errors import ConfigError
from infire_jax.models.config import ModelConfig, gemma4_stacks
from infire_jax.models.decoder import DecoderModel
from infire_jax.models.gemma3 import gelu_glu, scaled_embedding
from infire_jax.models.layers import (apply_rope, layer_loop, local_attention_table, param, rms_norm, rope_tables,
                                      with_local_mask)
from infire_jax.models.llama import kernel_weights, linear
from infire_jax.models.moe import combine, dispatch_local, expert_mlp, route
from infire_jax.models.panels import INPUT_AXES
from infire_jax.models.quant_kernels import default_grouped_impl, kernel_stacks
from infire_jax.quant.weight_parts import LayerStacks
from pallas_kernels.attention import paged_attention, plan_step
from pallas_kernels.metadata import AttentionMetadata
from sharding.plan import ShardPlan

KVPages = tuple[Array, Array]  # (k_pages, v_pages), each [L, num_pages, page_size, kv_heads, head_dim]
KINDS = ("sliding", "full")
EXPERT_INPUTS = {"w_experts_gate_up": 1, "w_experts_down": 1}  # input axes of one expert's weights


class Gemma4Layers(LayerStacks):
    """One kind's stacked layers (`gemma4_stacks`): projections drawn normal, norms and scales ones."""

    def __init__(self, cfg: ModelConfig, kind: str, dtype):
        for t in gemma4_stacks(cfg)[kind]:
            setattr(self, t.name, param(t.shape, t.axes, dtype, init="normal" if t.matrix or t.name == "router"
                                        else "ones"))


def unit_norm(x: Float[Array, "... D"], eps: float) -> Float[Array, "... D"]:
    """RMSNorm without a weight (Gemma4RMSNorm with_scale=False), in float32."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def kind_shape(cfg: ModelConfig, kind: str) -> tuple[int, int]:
    """(kv heads, head_dim) of a kind's layers."""
    g4 = cfg.gemma4
    return (g4.sliding_kv_heads, cfg.head_dim) if kind == "sliding" else (g4.global_kv_heads, g4.global_head_dim)


def gemma4_rope(cfg: ModelConfig, positions: Int[Array, "T"]) -> dict[str, tuple[Array, Array]]:
    """Each kind's (cos, sin) [T, d / 2]: windowed layers every frequency of their base; full layers
    (transformers' proportional RoPE) int(fraction * d // 2) frequencies of exponent 2i / d, the rest
    zero (cos 1, sin 0: those dimensions pass unrotated), all divided by the factor."""
    g4, ds, dg = cfg.gemma4, cfg.head_dim, cfg.gemma4.global_head_dim
    local = 1.0 / (g4.local_rope_theta ** (np.arange(0, ds, 2, dtype=np.float64) / ds))
    angles = int(g4.global_rotary_fraction * dg // 2)
    full = np.zeros(dg // 2)
    full[:angles] = 1.0 / (cfg.rope_theta ** (np.arange(0, 2 * angles, 2, dtype=np.float64) / dg))
    return {"sliding": rope_tables(local.astype(np.float32), positions),
            "full": rope_tables((full / g4.global_rope_factor).astype(np.float32), positions)}


def experts_block(cfg: ModelConfig, lp: dict[str, Array], h: Float[Array, "T E"]) -> Float[Array, "T E"]:
    """The MoE block's output before its post norm: routed on h, each expert's GELU MLP of moe_norm(h)."""
    x = unit_norm(h, cfg.rms_norm_eps) * lp["router_scale"] * cfg.hidden_size ** -0.5
    routing = route(linear(x, lp["router"], "te,ex->tx"), cfg.num_experts_per_tok, renormalize=True,
                    weight_dtype=jnp.float32)
    routing = routing._replace(weights=routing.weights * lp["expert_scale"][routing.experts].astype(jnp.float32))
    experts = {"w_gate_up": lp["w_experts_gate_up"], "w_down": lp["w_experts_down"]}  # LayerExperts on a GPU
    d, routing = dispatch_local(rms_norm(h, lp["moe_norm"], cfg.rms_norm_eps), routing, experts["w_gate_up"], None)
    return combine(expert_mlp(d, experts, default_grouped_impl(), gelu_glu), d, routing, h.dtype)


def layer_step(cfg: ModelConfig, kind: str, rope: dict, metas: dict, attn_impl: str, in_place: dict, carry,
               lp: dict, stack_index: Array, layer: Array, row: Int[Array, "2"]):
    """One layer of `kind`: (h, k_pages, v_pages) -> the same; `layer` is its index in the pool (all
    layers in order), `stack_index` in its stack (for the weights the kernels read in place, `in_place`),
    `row` its (chunk, window) row."""
    h, k_pages, v_pages = carry
    lp = kernel_weights(lp, in_place[kind], stack_index, h.shape[0], cpu=True)
    eps, (hkv, d) = cfg.rms_norm_eps, kind_shape(cfg, kind)
    qkv = linear(rms_norm(h, lp["attn_norm"], eps), lp["wqkv"], "te,ekgd->tkgd")
    g = cfg.num_heads // hkv
    cos, sin = rope[kind]
    q = apply_rope(rms_norm(qkv[:, :, :g].reshape(h.shape[0], cfg.num_heads, d), lp["q_norm"], eps), cos, sin)
    k = apply_rope(rms_norm(qkv[:, :, g], lp["k_norm"], eps), cos, sin)
    v = unit_norm(qkv[:, :, g + 1] if qkv.shape[2] == g + 2 else qkv[:, :, g], eps)
    pool_shape = k_pages.shape
    view = (*pool_shape[:3], pool_shape[3] * pool_shape[4] // d, d)
    r = view[3] // hkv
    k, v = (jnp.repeat(x, r, axis=1) if r > 1 else x for x in (k, v))
    o, k_view, v_view = paged_attention(q, k, v, k_pages.reshape(view), v_pages.reshape(view), layer,
                                        with_local_mask(metas[kind], row), scale=1.0, impl=attn_impl,
                                        cpu_kernel=True)
    h = h + rms_norm(linear(o, lp["wo"], "thd,hde->te"), lp["post_attn_norm"], eps)
    gate_up = linear(rms_norm(h, lp["mlp_norm"], eps), lp["w_gate_up"], "te,ecf->tcf")
    y = linear(gelu_glu(gate_up[:, 0], gate_up[:, 1]), lp["w_down"], "tf,fe->te")
    if cfg.is_moe:
        y = rms_norm(y, lp["post_mlp_norm_1"], eps) + rms_norm(experts_block(cfg, lp, h), lp["post_moe_norm"], eps)
    h = (h + rms_norm(y, lp["post_mlp_norm"], eps)) * lp["layer_scalar"]
    return h, k_view.reshape(pool_shape), v_view.reshape(pool_shape)


def decoder_stack(cfg: ModelConfig, attn_impl: str, weights: dict[str, dict[str, Array]], h: Float[Array, "T E"],
                  k_pages: Array, v_pages: Array, meta: AttentionMetadata, rope: dict
                  ) -> tuple[Float[Array, "T E"], Array, Array]:
    """Scans the blocks: `period` - 1 windowed layers (slices of their stack), then the full layer."""
    p, tokens = cfg.gemma4.period, h.shape[0]
    blocks = cfg.num_layers // p
    slot = k_pages.shape[3] * k_pages.shape[4]
    metas = {kind: plan_step(meta, attn_impl, tokens, cfg.num_heads * kind_shape(cfg, kind)[1] // slot,
                             kind_shape(cfg, kind)[1]) for kind in KINDS}
    # On a GPU the kernels read these stacks in place (models/quant_kernels.py), unscanned: the dense ones in
    # steps of up to 64 tokens, the experts (the grouped matmul) in every step.
    experts = EXPERT_INPUTS if cfg.is_moe and default_grouped_impl() == "pallas" else None
    in_place = {kind: {name: (kw, kw.shape) for name, kw in kernel_stacks(w, tokens, INPUT_AXES, experts).items()}
                for kind, w in weights.items()}
    scanned = {kind: {n: a for n, a in w.items() if n not in in_place[kind]} for kind, w in weights.items()}
    step = functools.partial(layer_step, cfg, rope=rope, metas=metas, attn_impl=attn_impl, in_place=in_place)

    def block(carry, xs):
        sliding, full, s, rows = xs
        for j in range(p - 1):
            carry = step("sliding", carry=carry, lp=jax.tree.map(lambda a: a[j], sliding),
                         stack_index=s * (p - 1) + j, layer=s * p + j, row=rows[j])
        return step("full", carry=carry, lp=full, stack_index=s, layer=s * p + p - 1, row=rows[p - 1]), None

    sliding = jax.tree.map(lambda a: a.reshape(blocks, p - 1, *a.shape[1:]), scanned["sliding"])
    xs = (sliding, scanned["full"], np.arange(blocks, dtype=np.int32),
          local_attention_table(cfg, cfg.num_layers).reshape(blocks, p, 2))
    return layer_loop(block, (h, k_pages, v_pages), xs, blocks, tokens)


class Gemma4(DecoderModel):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, resident: Mapping | None = None):
        if resident:
            raise ConfigError("Gemma 4 runs with plain weights; weights_quantization and weights_compression "
                              "are not supported for it yet")
        self.cfg = cfg
        self.embed = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        self.sliding_layers = Gemma4Layers(cfg, "sliding", dtype)
        self.full_layers = Gemma4Layers(cfg, "full", dtype)
        self.final_norm = param((cfg.hidden_size,), ("norm",), dtype, init="ones")
        if not cfg.tie_word_embeddings:
            self.lm_head = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)

    def embed_tokens(self, tokens: Int[Array, "T"]) -> Float[Array, "T E"]:
        return scaled_embedding(self.embed[...], tokens)

    def logits(self, h: Float[Array, "S E"], plan: ShardPlan | None = None) -> Float[Array, "S V"]:
        """The head's logits, soft-capped where the config caps them."""
        logits, cap = super().logits(h, plan), self.cfg.gemma4.final_logit_softcapping
        return logits if cap is None else jnp.tanh(logits / cap) * cap

    def run_layers(self, h: Float[Array, "T E"], kv: KVPages, meta: AttentionMetadata, *, attn_impl: str,
                   plan: ShardPlan | None = None, aux_layers: tuple[int, ...] | None = None
                   ) -> tuple[Float[Array, "T E"], KVPages]:
        """Applies every decoder layer, on one device (meshes are not implemented for Gemma 4 yet)."""
        if aux_layers is not None:
            raise ConfigError("Gemma 4 runs without EAGLE-3 aux states")
        if plan is not None:
            raise ConfigError("Gemma 4 runs on one device; a mesh (tp / pp / ep) is not supported for it yet")
        weights = {kind: getattr(self, f"{kind}_layers").arrays() for kind in KINDS}
        h, k_pages, v_pages = decoder_stack(self.cfg, attn_impl, weights, h, *kv, meta,
                                            gemma4_rope(self.cfg, meta.positions))
        return h, (k_pages, v_pages)
