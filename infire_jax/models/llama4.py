"""Llama 4 decoder (Scout, Maverick): GQA attention with chunked RoPE layers and global NoPE layers,
dense and MoE layers interleaved.

Per layer (transformers' Llama4TextDecoderLayer):
- RoPE layers rotate q and k (Llama 4 rotates adjacent pairs; the loader moves each head's pairs
  into the "rotate half" layout `apply_rope` takes, on q and k alike, so q.k is unchanged), L2-norm
  them without a weight (`use_qk_norm`), and attend within their chunk (`LocalMask`);
- NoPE layers leave q and k unrotated, scale q by log1p(floor((p + 1) / floor_scale)) * attn_scale + 1
  (`attn_temperature_tuning`) and attend to every earlier position;
- the MLP is dense (`intermediate_size_mlp` wide), or the MoE: a router picks each token's top-k experts
  by logit, the sigmoid of the chosen logit scales the expert's *input*, the outputs are summed, and a
  shared expert runs on every token.

Layer i is a MoE layer when (i + 1) % P == 0 (P: `interleave_moe_layer_step`; Scout 1, Maverick 2).
The weights are two stacks, `dense_layers` and `moe_layers` (each a full layer: attention and MLP),
and the forward scans over super-layers of P layers: P - 1 dense then one MoE, each a slice of its
stack, then over the L % P dense layers left. The pool's layer index runs over all layers in order
(layer s * P + j), and so does each layer's (chunk, window, RoPE) row of `layer_table`, scanned with
the weights, so one compiled body serves RoPE and NoPE, chunked and global layers. The chunk and window
come from models/layers.py's `local_attention_table` and set `meta.local` through `with_local_mask`, as
in models/llama.py; with the hybrid KV cache (hybrid_kv_cache.py) `paged_attention` resolves the layer's
group tables from the pool index (`for_layer`), so chunked layers read only their chunk's pages and
global (NoPE) layers every page.

EAGLE-3's features (`aux_layers`, HF `hidden_states` indices) ride the same scans, as models/llama.py's
`decoder_stack_aux`: the carry adds one [T, E] slot per requested state and a scratch slot, and each
layer writes its output into the slot of its place among all layers (one device, or a mesh without pipeline
stages: `run_aux_stack`).

On a mesh (models/parallel.py) heads and MLP widths split over tp, experts over ep; the shared
expert and dense MLPs are replicated over ep. A pipeline stage holds whole super-layers
(sharding/plan.py `stage_split`), each stack spread over its own zero-padded stage slots; a stage's
scan reads its stage's rows of `layer_table` and indexes its share of the pool by the layer's place in
the stage. Layer weights may be kept int8 / int4 (quant/resident.py), dequantized a layer
at a time; on a GPU the quantized matmul kernels read them in place (models/quant_kernels.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from infire_jax.models.config import ModelConfig
from infire_jax.models.decoder import DecoderModel
from infire_jax.models.deepseek_moe import shared_mlp
from infire_jax.models.layers import (apply_rope, layer_loop, local_attention_table, param, rms_norm,
                                      rope_cos_sin, stage_rows, with_local_mask)
from infire_jax.models.llama import (KernelView, dense_mlp, kernel_weights, linear, project_qkv, run_aux_stack,
                                     slots_last)
from infire_jax.models.moe import Routing, routed_mlp
from infire_jax.models.parallel import Reductions, psum
from infire_jax.models.quant_kernels import layer_stacks
from infire_jax.quant.resident import QuantLayout, dequantize_layer, keep_quantized, quant_layouts
from infire_jax.quant.weight_parts import LayerStacks
from pallas_kernels.attention import paged_attention, plan_step
from pallas_kernels.metadata import AttentionMetadata
from sharding.plan import ShardPlan

KVPages = tuple[Array, Array]  # (k_pages, v_pages), each [L, num_pages, page_size, kv_heads, head_dim]
# The layer weights that are plain matmuls, with how many leading axes of one layer's weight are inputs.
DENSE_INPUTS = {"wqkv": 1, "wo": 2, "w_gate_up": 1, "w_down": 1, "w_shared_gate_up": 1, "w_shared_down": 1}
STACKS = ("dense", "moe")


def layer_table(cfg: ModelConfig, num_layers: int) -> Int[Array, "L 3"]:
    """int32 [num_layers, 3]: each layer's chunk and window (`local_attention_table`, zeros where every
    layer is global) and whether it rotates q and k. A scan over fewer layers than the (placed) model has
    is a pipeline stage's: it gets its stage's rows, as `local_attention_table` does."""
    local = local_attention_table(cfg, num_layers)
    if local is None:
        local = jnp.zeros((num_layers, 2), jnp.int32)
    rope = stage_rows(jnp.asarray(cfg.llama4.rope_layers, jnp.int32)[:, None], num_layers)
    return jnp.concatenate([local, rope], axis=1)


class Llama4Layers(LayerStacks):
    """`n` stacked layers of one kind: attention (fused q/k/v grouped by kv head, as models/llama.py's
    `DecoderLayers`) and a dense MLP or the MoE (router, routed experts, shared expert).

    `resident` names the weights kept quantized (`QuantLayout`s by weight name; a name this stack
    lacks, such as the shared expert's in the dense stack, is the other stack's)."""

    def __init__(self, cfg: ModelConfig, n: int, moe: bool, dtype, resident: dict[str, QuantLayout]):
        e, hkv, d = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
        g = cfg.num_heads // hkv
        self.attn_norm = param((n, e), ("layers", "norm"), dtype, init="ones")
        self.wqkv = param((n, e, hkv, g + 2, d), ("layers", "embed", "kv_heads", "qkv", "head_dim"), dtype)
        self.wo = param((n, cfg.num_heads, d, e), ("layers", "q_heads", "head_dim", "embed"), dtype)
        self.mlp_norm = param((n, e), ("layers", "norm"), dtype, init="ones")
        if moe:  # the router's expert axis stays replicated; the shared expert splits over tp like a dense MLP
            x, f = cfg.num_experts, cfg.moe_intermediate_size
            self.router = param((n, e, x), ("layers", "embed", "router"), dtype)
            self.w_gate_up = param((n, x, e, 2, f), ("layers", "experts", "embed", "gate_up", "mlp"), dtype)
            self.w_down = param((n, x, f, e), ("layers", "experts", "mlp", "embed"), dtype)
            self.w_shared_gate_up = param((n, e, 2, f), ("layers", "embed", "gate_up", "mlp"), dtype)
            self.w_shared_down = param((n, f, e), ("layers", "mlp", "embed"), dtype)
        else:
            f = cfg.intermediate_size
            self.w_gate_up = param((n, e, 2, f), ("layers", "embed", "gate_up", "mlp"), dtype)
            self.w_down = param((n, f, e), ("layers", "mlp", "embed"), dtype)
        keep_quantized(self, resident)



def l2_norm(x: Float[Array, "... D"], eps: float) -> Float[Array, "... D"]:
    """transformers' Llama4TextL2Norm: RMSNorm without a weight, in float32."""
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def temperature(cfg: ModelConfig, positions: Int[Array, "T"]) -> Float[Array, "T"] | None:
    """NoPE layers' query scale per token (attn_temperature_tuning), or None when it is off."""
    l4 = cfg.llama4
    if not l4.temperature_tuning:
        return None
    p = positions.astype(jnp.float32)
    return jnp.log1p(jnp.floor((p + 1.0) / l4.floor_scale)) * l4.attn_scale + 1.0


def position_qk(cfg: ModelConfig, q: Array, k: Array, cos: Array, sin: Array, temp: Array | None,
                rope_on: Array) -> tuple[Array, Array]:
    """q and k as the layer attends with them: rotated (and L2-normed) on a RoPE layer, q scaled by
    the temperature on a NoPE layer; `rope_on` is the layer's traced flag."""
    qr, kr = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cfg.llama4.qk_l2_norm:
        qr, kr = l2_norm(qr, cfg.rms_norm_eps), l2_norm(kr, cfg.rms_norm_eps)
    qn = q if temp is None else (q.astype(jnp.float32) * temp[:, None, None]).astype(q.dtype)
    return jnp.where(rope_on, qr, qn), jnp.where(rope_on, kr, k)


def llama4_moe(lp: dict[str, Array], x: Float[Array, "T E"], *, k: int, expert_axis: str | None
               ) -> Float[Array, "T E"]:
    """The routed experts' summed output (a partial sum on a mesh, over the expert and tp axes).

    As transformers' Llama4Router and Llama4TextMoe: top-k over the router logits (in the
    activations' dtype), sigmoid of each chosen logit, which scales the token's row going into that
    expert; the k outputs are added unweighted. Each (token, choice) is dispatched as a row of its
    own with weight 1, so moe.py's grouped matmul and expert-parallel split serve it unchanged.
    """
    logits = linear(x, lp["router"], "te,ex->tx")
    top, experts = jax.lax.top_k(logits, k)
    scores = jax.nn.sigmoid(top.astype(jnp.float32)).astype(x.dtype)
    t, e = x.shape
    rows = (x[:, None, :] * scores[..., None]).reshape(t * k, e)
    routing = Routing(jnp.ones((t * k, 1), jnp.float32), experts.reshape(t * k, 1).astype(jnp.int32))
    out = routed_mlp(lp, rows, routing, expert_axis=expert_axis).reshape(t, k, e)
    return jnp.sum(out.astype(jnp.float32), axis=1).astype(x.dtype)


def layer_step(cfg: ModelConfig, moe: bool, cos: Array, sin: Array, temp: Array | None, meta: AttentionMetadata,
               attn_impl: str, red: Reductions, in_place: dict[str, tuple[KernelView, tuple]], carry, lp: dict,
               stack_index: Array, layer: Array, row: Int[Array, "3"], aux_slot: Int[Array, "L"] | None = None):
    """One layer: (h, k_pages, v_pages) -> the same. `layer` is the pool's (all layers) index, `stack_index`
    this layer's in its stack (for the weights read in place), `row` its `layer_table` row. With
    `aux_slot` (EAGLE-3's states), the carry also holds `aux_slots`' slots, and the layer's output goes
    into slot `aux_slot[layer]`."""
    h, k_pages, v_pages, *aux = carry
    tokens = h.shape[0]
    lp = dequantize_layer(lp, h.dtype)
    lp = kernel_weights(lp, in_place, stack_index, tokens, cpu=red == Reductions())
    q, k, v = project_qkv(lp, rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps), False)
    q, k = position_qk(cfg, q, k, cos, sin, temp, row[2] > 0)
    meta = with_local_mask(meta, row[:2] if cfg.has_local_attention else None)
    o, k_pages, v_pages = paged_attention(q, k, v, k_pages, v_pages, layer, meta, scale=cfg.head_dim ** -0.5,
                                          impl=attn_impl, cpu_kernel=red == Reductions())
    h = h + psum(linear(o, lp["wo"], "thd,hde->te"), red.attn)
    x = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
    if moe:  # the shared expert splits like a dense MLP, over the `mlp` axis only (even where experts share it)
        routed = llama4_moe(lp, x, k=cfg.num_experts_per_tok, expert_axis=red.expert_axis)
        h = h + psum(routed, red.mlp) + psum(shared_mlp(lp, x), red.dense)
    else:
        h = h + psum(dense_mlp(lp, x), red.dense)
    if aux_slot is not None:
        return h, k_pages, v_pages, jax.lax.dynamic_update_index_in_dim(aux[0], h, aux_slot[layer], 0)
    return h, k_pages, v_pages


def decoder_stack(cfg: ModelConfig, attn_impl: str, red: Reductions, weights: dict[str, dict[str, Array]],
                  h: Float[Array, "T E"], k_pages: Array, v_pages: Array, meta: AttentionMetadata, cos: Array,
                  sin: Array, aux: tuple[Float[Array, "N1 T E"], Int[Array, "L"]] | None = None
                  ) -> tuple[Float[Array, "T E"], Array, Array] | tuple[Float[Array, "T E"], Array, Array, Array]:
    """Scans the super-layers (P - 1 dense layers and a MoE layer each), then the dense layers left
    over; the KV pool is a loop carry, indexed by the layer's place among all layers (of its pipeline
    stage: the stacks and the pool hold that stage's share, and a stage has no dense layers left over).
    With `aux` (models/llama.py's `aux_slots`: the slots and each layer's slot; no pipeline stages) the slots
    are carried too, each layer writing its output into its slot, and come back as a fourth element."""
    p = cfg.llama4.moe_step
    supers = weights["moe"]["attn_norm"].shape[0] if "moe" in weights else 0
    tail = cfg.num_layers % p
    table = layer_table(cfg, supers * p + tail)
    tokens = h.shape[0]
    in_place = {kind: layer_stacks(w, tokens, DENSE_INPUTS, kind == "moe", one_device=red == Reductions())
                for kind, w in weights.items()}
    scanned = {kind: {n: a for n, a in w.items() if n not in in_place[kind]} for kind, w in weights.items()}
    meta = plan_step(meta, attn_impl, tokens, cfg.num_heads // cfg.num_kv_heads)
    step = functools.partial(layer_step, cfg, cos=cos, sin=sin, temp=temperature(cfg, meta.positions), meta=meta,
                             attn_impl=attn_impl, red=red, aux_slot=None if aux is None else jnp.asarray(aux[1]))
    dense = scanned.get("dense", {})
    carry = (h, k_pages, v_pages) if aux is None else (h, k_pages, v_pages, aux[0])
    if supers:
        def super_layer(carry, xs):
            dense_lp, moe_lp, s, rows = xs
            for j in range(p - 1):
                carry = step(False, in_place=in_place["dense"], carry=carry,
                             lp=jax.tree.map(lambda a: a[j], dense_lp), stack_index=s * (p - 1) + j,
                             layer=s * p + j, row=rows[j])
            carry = step(True, in_place=in_place["moe"], carry=carry, lp=moe_lp, stack_index=s,
                         layer=s * p + p - 1, row=rows[p - 1])
            return carry, None

        dense_xs = jax.tree.map(lambda a: a[:supers * (p - 1)].reshape(supers, p - 1, *a.shape[1:]), dense)
        xs = (dense_xs, scanned["moe"], np.arange(supers, dtype=np.int32),
              table[:supers * p].reshape(supers, p, 3))
        carry = layer_loop(super_layer, carry, xs, supers, tokens)
    if tail:
        def dense_layer(carry, xs):
            lp, i, row = xs
            return step(False, in_place=in_place["dense"], carry=carry, lp=lp, stack_index=supers * (p - 1) + i,
                        layer=supers * p + i, row=row), None

        xs = (jax.tree.map(lambda a: a[supers * (p - 1):], dense), np.arange(tail, dtype=np.int32),
              table[supers * p:])
        carry = layer_loop(dense_layer, carry, xs, tail, tokens)
    return carry


class Llama4(DecoderModel):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, resident: dict[str, QuantLayout] | None = None):
        """`resident`: layer weights kept quantized, by weight name (`wqkv`, `w_gate_up`, ...: in every stack)."""
        resident = quant_layouts("the Llama 4 family", resident)
        self.cfg = cfg
        self.embed = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        sizes = cfg.llama4.stack_sizes
        if sizes["dense"]:
            self.dense_layers = Llama4Layers(cfg, sizes["dense"], False, dtype, resident)
        if sizes["moe"]:
            self.moe_layers = Llama4Layers(cfg, sizes["moe"], True, dtype, resident)
        self.final_norm = param((cfg.hidden_size,), ("norm",), dtype, init="ones")
        if not cfg.tie_word_embeddings:
            self.lm_head = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)

    def _stacks(self) -> dict[str, Llama4Layers]:
        return {kind: getattr(self, f"{kind}_layers") for kind in STACKS if hasattr(self, f"{kind}_layers")}

    def run_layers(self, h: Float[Array, "T E"], kv: KVPages, meta: AttentionMetadata, *, attn_impl: str,
                   plan: ShardPlan | None = None, aux_layers: tuple[int, ...] | None = None
                   ) -> tuple[Float[Array, "T E"], KVPages] | tuple[Float[Array, "T E"], KVPages, Float[Array, "T N"]]:
        """Applies every decoder layer, on one device or (with a plan) across the mesh. With `aux_layers`
        (static HF `hidden_states` indices, as models/llama.py's `run_layers`; no pipeline stages) the
        residual stream at those indices comes back too, [T, len(aux_layers) * E]: EAGLE-3's features."""
        cos, sin = rope_cos_sin(self.cfg, meta.positions)
        weights = {kind: stack.arrays() for kind, stack in self._stacks().items()}
        stack = functools.partial(decoder_stack, self.cfg, attn_impl)
        axes = {kind: st.axes() for kind, st in self._stacks().items()}
        if aux_layers is not None:
            return run_aux_stack(slots_last(stack), aux_layers, self.cfg.num_layers, plan, weights, axes, h, kv,
                                 meta, cos, sin)
        return self.run_stack(stack, weights, axes, h, kv, meta, cos, sin, plan)
