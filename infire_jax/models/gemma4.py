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

On a mesh the stacks run in models/parallel.py's shard_map: tp splits the pool's slot, so each device's
share is a valid view for either kind (sharding/plan.py `gemma4_problem` refuses a tp that does not split
both views into whole heads), and a kind with fewer kv heads than tp has them repeated in its weights
(`gemma4_kv_repeats`); q/k/v, wo and the MLP's width are split over tp, the experts over the plan's expert
axis (models/moe.py), and pipeline stages hold whole blocks.
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
from infire_jax.models.parallel import Reductions, psum
from infire_jax.models.quant_kernels import default_grouped_impl, kernel_stacks
from infire_jax.quant.resident import QuantLayout, dequantize_layer, keep_quantized, quant_layouts
from infire_jax.quant.weight_parts import LayerStacks
from pallas_kernels.attention import paged_attention, plan_step
from pallas_kernels.metadata import AttentionMetadata
from sharding.plan import ShardPlan

KVPages = tuple[Array, Array]  # (k_pages, v_pages), each [L, num_pages, page_size, kv_heads, head_dim]
KINDS = ("sliding", "full")
EXPERT_INPUTS = {"w_experts_gate_up": 1, "w_experts_down": 1}  # input axes of one expert's weights


class Gemma4Layers(LayerStacks):
    """One kind's stacked layers (`gemma4_stacks`): projections drawn normal, norms and scales ones."""

    def __init__(self, cfg: ModelConfig, kind: str, dtype, resident: Mapping[str, QuantLayout]):
        for t in gemma4_stacks(cfg)[kind]:
            setattr(self, t.name, param(t.shape, t.axes, dtype, init="normal" if t.matrix or t.name == "router"
                                        else "ones"))
        keep_quantized(self, resident)


def unit_norm(x: Float[Array, "... D"], eps: float) -> Float[Array, "... D"]:
    """RMSNorm without a weight (Gemma4RMSNorm with_scale=False), in float32."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def gemma4_rope(cfg: ModelConfig, positions: Int[Array, "T"]) -> tuple[Float[Array, "T D"], Float[Array, "T D"]]:
    """cos and sin [T, (ds + dg) / 2]: the windowed layers' table, then the full layers' side by side (per-token
    arrays the mesh's pipeline slices). Windowed layers rotate by every frequency of their base; full layers
    (transformers' proportional RoPE) by int(fraction * dg // 2) frequencies of exponent 2i / dg, the rest
    zero (cos 1, sin 0: those dimensions pass unrotated), all divided by the factor."""
    g4, ds, dg = cfg.gemma4, cfg.head_dim, cfg.gemma4.global_head_dim
    local = 1.0 / (g4.local_rope_theta ** (np.arange(0, ds, 2, dtype=np.float64) / ds))
    angles = int(g4.global_rotary_fraction * dg // 2)
    full = np.zeros(dg // 2)
    full[:angles] = 1.0 / (cfg.rope_theta ** (np.arange(0, 2 * angles, 2, dtype=np.float64) / dg))
    tables = (rope_tables(local.astype(np.float32), positions),
              rope_tables((full / g4.global_rope_factor).astype(np.float32), positions))
    return tuple(jnp.concatenate([w, f], axis=-1) for w, f in zip(*tables))


def experts_block(cfg: ModelConfig, red: Reductions, lp: dict[str, Array], h: Float[Array, "T E"]
                  ) -> Float[Array, "T E"]:
    """The MoE block's output before its post norm: routed on h, each expert's GELU MLP of moe_norm(h); on a
    mesh this device's experts' (or MLP columns') share, summed over `red.mlp`."""
    x = unit_norm(h, cfg.rms_norm_eps) * lp["router_scale"] * cfg.hidden_size ** -0.5
    routing = route(linear(x, lp["router"], "te,ex->tx"), cfg.num_experts_per_tok, renormalize=True,
                    weight_dtype=jnp.float32)
    routing = routing._replace(weights=routing.weights * lp["expert_scale"][routing.experts].astype(jnp.float32))
    experts = {"w_gate_up": lp["w_experts_gate_up"], "w_down": lp["w_experts_down"]}  # LayerExperts on a GPU
    d, routing = dispatch_local(rms_norm(h, lp["moe_norm"], cfg.rms_norm_eps), routing, experts["w_gate_up"],
                                red.expert_axis)
    return psum(combine(expert_mlp(d, experts, default_grouped_impl(), gelu_glu), d, routing, h.dtype), red.mlp)


def layer_step(cfg: ModelConfig, kind: str, red: Reductions, rope: tuple[Array, Array], metas: dict, attn_impl: str,
               in_place: dict, carry, lp: dict, stack_index: Array, layer: Array, row: Int[Array, "2"]):
    """One layer of `kind`: (h, k_pages, v_pages) -> the same; `layer` is its index in the pool (all
    layers in order, a pipeline stage's), `stack_index` in its stack (for the weights the kernels read in
    place, `in_place`), `row` its (chunk, window) row. Head counts are the weights' (a tp device's share)."""
    h, k_pages, v_pages = carry
    one_device = red == Reductions()
    lp = kernel_weights(dequantize_layer(lp, h.dtype), in_place[kind], stack_index, h.shape[0], cpu=one_device)
    eps = cfg.rms_norm_eps
    qkv = linear(rms_norm(h, lp["attn_norm"], eps), lp["wqkv"], "te,ekgd->tkgd")
    hkv, d = qkv.shape[1], qkv.shape[3]
    g = qkv.shape[2] - (1 if kind == "full" and cfg.gemma4.k_eq_v else 2)
    half = cfg.head_dim // 2
    cos, sin = (t[:, half:] if kind == "full" else t[:, :half] for t in rope)
    q = apply_rope(rms_norm(qkv[:, :, :g].reshape(h.shape[0], hkv * g, d), lp["q_norm"], eps), cos, sin)
    k = apply_rope(rms_norm(qkv[:, :, g], lp["k_norm"], eps), cos, sin)
    v = unit_norm(qkv[:, :, -1], eps)
    pool_shape = k_pages.shape
    view = (*pool_shape[:3], pool_shape[3] * pool_shape[4] // d, d)
    r = view[3] // hkv
    k, v = (jnp.repeat(x, r, axis=1) if r > 1 else x for x in (k, v))
    o, k_view, v_view = paged_attention(q, k, v, k_pages.reshape(view), v_pages.reshape(view), layer,
                                        with_local_mask(metas[kind], row), scale=1.0, impl=attn_impl,
                                        cpu_kernel=one_device)
    h = h + rms_norm(psum(linear(o, lp["wo"], "thd,hde->te"), red.attn), lp["post_attn_norm"], eps)
    gate_up = linear(rms_norm(h, lp["mlp_norm"], eps), lp["w_gate_up"], "te,ecf->tcf")
    y = psum(linear(gelu_glu(gate_up[:, 0], gate_up[:, 1]), lp["w_down"], "tf,fe->te"), red.dense)
    if cfg.is_moe:
        y = (rms_norm(y, lp["post_mlp_norm_1"], eps)
             + rms_norm(experts_block(cfg, red, lp, h), lp["post_moe_norm"], eps))
    h = (h + rms_norm(y, lp["post_mlp_norm"], eps)) * lp["layer_scalar"]
    return h, k_view.reshape(pool_shape), v_view.reshape(pool_shape)


def decoder_stack(cfg: ModelConfig, attn_impl: str, red: Reductions, weights: dict[str, dict[str, Array]],
                  h: Float[Array, "T E"], k_pages: Array, v_pages: Array, meta: AttentionMetadata,
                  cos: Float[Array, "T D"], sin: Float[Array, "T D"]) -> tuple[Float[Array, "T E"], Array, Array]:
    """Scans the blocks (a pipeline stage's, inside the mesh's shard_map): `period` - 1 windowed layers
    (slices of their stack), then the full layer. `cos` and `sin` are `gemma4_rope`'s."""
    p, tokens, one_device = cfg.gemma4.period, h.shape[0], red == Reductions()
    blocks = weights["full"]["layer_scalar"].shape[0]
    slot = k_pages.shape[3] * k_pages.shape[4]
    dims = {"sliding": cfg.head_dim, "full": cfg.gemma4.global_head_dim}
    q_heads = {kind: jax.tree.leaves(weights[kind]["wo"])[0].shape[1] for kind in KINDS}  # wo's, or its parts
    metas = {kind: plan_step(meta, attn_impl, tokens, q_heads[kind] * dims[kind] // slot, dims[kind]) for kind in KINDS}
    # On a GPU the kernels read these stacks in place (models/quant_kernels.py), unscanned: the dense ones in
    # steps of up to 64 tokens, the experts (the grouped matmul) in every step.
    experts = EXPERT_INPUTS if cfg.is_moe and default_grouped_impl() == "pallas" else None
    in_place = {kind: {name: (kw, kw.shape) for name, kw
                       in kernel_stacks(w, tokens, INPUT_AXES, experts, one_device=one_device).items()}
                for kind, w in weights.items()}
    scanned = {kind: {n: a for n, a in w.items() if n not in in_place[kind]} for kind, w in weights.items()}
    step = functools.partial(layer_step, cfg, red=red, rope=(cos, sin), metas=metas, attn_impl=attn_impl,
                             in_place=in_place)

    def block(carry, xs):
        sliding, full, s, rows = xs
        for j in range(p - 1):
            carry = step("sliding", carry=carry, lp=jax.tree.map(lambda a: a[j], sliding),
                         stack_index=s * (p - 1) + j, layer=s * p + j, row=rows[j])
        return step("full", carry=carry, lp=full, stack_index=s, layer=s * p + p - 1, row=rows[p - 1]), None

    sliding = jax.tree.map(lambda a: a.reshape(blocks, p - 1, *a.shape[1:]), scanned["sliding"])
    xs = (sliding, scanned["full"], np.arange(blocks, dtype=np.int32),
          local_attention_table(cfg, blocks * p).reshape(blocks, p, 2))
    return layer_loop(block, (h, k_pages, v_pages), xs, blocks, tokens)


class Gemma4(DecoderModel):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, resident: Mapping | None = None):
        """`resident`: layer weights kept quantized, by weight name (`wqkv`, `w_experts_gate_up`, ...: in
        both stacks)."""
        resident = quant_layouts("Gemma 4", resident)
        self.cfg = cfg
        self.embed = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        self.sliding_layers = Gemma4Layers(cfg, "sliding", dtype, resident)
        self.full_layers = Gemma4Layers(cfg, "full", dtype, resident)
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
        """Applies every decoder layer, on one device or (with a plan) across the mesh."""
        if aux_layers is not None:
            raise ConfigError("Gemma 4 runs without EAGLE-3 aux states")
        stacks = {kind: getattr(self, f"{kind}_layers") for kind in KINDS}
        cos, sin = gemma4_rope(self.cfg, meta.positions)
        return self.run_stack(functools.partial(decoder_stack, self.cfg, attn_impl),
                              {kind: st.arrays() for kind, st in stacks.items()},
                              {kind: st.axes() for kind, st in stacks.items()}, h, kv, meta, cos, sin, plan)
