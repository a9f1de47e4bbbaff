"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): route, dispatch, grouped SwiGLU experts, combine.

Pure functions over one layer's weight dict: `router [E, X]`, `w_gate_up [X, E, 2, F]` (gate and
up fused, one GEMM), `w_down [X, F, E]` (T tokens, E hidden, X experts, K experts per token, F expert width,
M = T*K assignments). The steps are separate functions so that expert parallelism slots in between
them: with the `experts` axis sharded over an `ep` mesh axis, `dispatch` is followed by an all-to-all
that sends each assignment row to the shard holding its expert, `expert_mlp` runs on the local experts
only, and the reverse all-to-all precedes `combine`. Routing stays replicated (the router's expert
axis has its own logical name, `router`, so sharding rules keep it whole).

Grouped matmul. The M assignments are sorted by expert so each expert's rows are contiguous, and each
expert multiplies only its own rows; a dense [T, X, ...] product (every expert on every token) would
cost X/K times the FLOPs and memory. Findings on `jax.lax.ragged_dot` (jax/jaxlib 0.10.2):

* CPU: not grouped. It lowers through `_ragged_dot_general_impl` to a masked dense expansion: the lhs is
  broadcast to [X, M, E], rows outside each group are zeroed with a select, and one dot contracts over
  (group, E), doing X times the grouped FLOPs. At 512 tokens x 128 experts x top-8 (E=2048, F=768,
  float32) XLA's memory analysis reports 5.1 GB of temporaries for one ragged_dot and 6.7 GB for the
  SwiGLU's three, against 81 MB for the tiled loop below (1.8 GB for an all-experts dense einsum). At
  E=512, F=256 on 2 shared cores the SwiGLU took 8.5 s via ragged_dot, 1.5 s as the dense einsum and
  0.16 s tiled, all three agreeing to 2e-7.
* GPU: jax lowers it to the `ragged-dot` HLO instruction, and XLA's RaggedDotRewriter (OpenXLA source)
  expands that the same dense way on CUDA unless the experimental cuDNN fusion is enabled
  (`--xla_gpu_experimental_use_ragged_dot_fusion`, bf16/f16 only); jax also has an opt-in Pallas-Triton
  lowering (`jax_ragged_dot_use_gpu_pallas_triton_lowering`). It has been reported to fall back to
  dense in jaxlib 0.9-0.10, and must be measured on the GPU (compiled memory analysis and time at
  serving sizes) before it is chosen there: at an 8192-token prefill of Qwen3-30B-A3B the dense
  expansion would need tens of GB per matmul.

Off a GPU the implementation is `tiled`, exact and grouped on every backend: the sorted rows are cut
into tiles of B rows that never straddle two experts, and a loop over the tiles in use multiplies each
tile by its own expert's weights. Temporaries are O(M*E); the FLOPs are the grouped product's plus at
most one partial tile per active expert. On a GPU that would be a sequential loop of small matmuls,
so there the layer body hands the layer's experts to the grouped Pallas kernel instead (`pallas`:
`LayerExperts`, models/quant_kernels.py, pallas_kernels/quant_matmul.py), which runs every tile of
rows at once, each reading its expert's weights in place, plain or kept quantized.
`INFIRE_JAX_MOE_GROUPED=tiled|ragged_dot|pallas` overrides the choice (ragged_dot: for measuring).

Expert weights kept quantized (quant/grouped.py, DeepSeek-V3 / Kimi checkpoints) arrive as dicts of
parts. The tiled loop dequantizes only the expert its tile needs (`expert_weight`), so the largest
full-precision temporary is one expert's weights, never the layer's. ragged_dot takes whole-layer
weights, so for kept experts it dequantizes the layer's whole stack first, as the scan once did: a
measuring option, not a serving path for kept weights.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from infire_jax.errors import ConfigError
from infire_jax.models.config import ModelConfig
from infire_jax.models.layers import swiglu
from infire_jax.models.quant_kernels import GROUPED_IMPLS, LayerExperts, default_grouped_impl
from infire_jax.quant.grouped import dequantize_kept, expert_weight

_MAX_TILE_ROWS = 128
# A stacked expert weight: a float array, or a kept quantized weight's parts (each with the expert axis first).
ExpertStack = Float[Array, "X ..."] | Mapping[str, Array]


class Routing(NamedTuple):
    """Each token's top-k experts and the weights that combine their outputs."""

    weights: Float[Array, "T K"]
    experts: Int[Array, "T K"]


class Dispatch(NamedTuple):
    """The token rows of all assignments, sorted (stably) by expert."""

    x: Float[Array, "M E"]
    group_sizes: Int[Array, "X"]  # rows per expert; rows past their sum (other devices' experts) stay 0
    order: Int[Array, "M"]  # sorted row -> flat assignment index (token * K + slot)


def router_logits(lp: dict[str, Array], x: Float[Array, "T E"]) -> Float[Array, "T X"]:
    """In the activations' dtype, as HF's `F.linear(hidden, gate.weight)`."""
    return jnp.einsum("te,ex->tx", x, lp["router"])


def route(logits: Float[Array, "T X"], k: int, *, renormalize: bool, weight_dtype) -> Routing:
    """Softmax over all experts in float32, top-k, then optionally renormalise over the k.

    Top-k is taken on the probabilities, not the logits, so float32 ties break as HF's `torch.topk`.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, experts = jax.lax.top_k(probs, k)
    if renormalize:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return Routing(top.astype(weight_dtype), experts.astype(jnp.int32))


def route_for(cfg: ModelConfig, logits: Float[Array, "T X"]) -> Routing:
    """The family's routing: Mixtral always renormalises and keeps float32 weights; Qwen3-MoE (and
    Qwen3.5-MoE) renormalise only with `norm_topk_prob` and cast the weights back to the logits' dtype."""
    qwen = cfg.architecture in ("qwen3_moe", "qwen3_5")
    return route(logits, cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob or not qwen,
                 weight_dtype=logits.dtype if qwen else jnp.float32)


def dispatch(x: Float[Array, "T E"], experts: Int[Array, "T K"], num_experts: int) -> Dispatch:
    """Sorts the (token, expert) assignments by expert and gathers their token rows."""
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return Dispatch(x[order // k], group_sizes, order)


def tile_rows(num_rows: int, num_experts: int) -> int:
    """Tile height of the tiled grouped matmul: about the mean group size, a power of two.

    Smaller tiles waste less on each expert's last partial tile; larger ones mean fewer loop trips.
    """
    mean = max(1, num_rows // num_experts)
    return min(_MAX_TILE_ROWS, 1 << (mean.bit_length() - 1))


def max_tiles(num_rows: int, num_experts: int, b: int) -> int:
    """A static bound on the tiles in use: sum over non-empty groups of ceil(size / b).

    Each of at most min(X, M) non-empty groups wastes under one tile, so the sum is at most
    (M + min(X, M) * (b - 1)) // b; with b = 1 (decode) it is exactly M.
    """
    return (num_rows + min(num_experts, num_rows) * (b - 1)) // b


# gate, up -> the activation an expert's down projection takes (SwiGLU; Gemma 4's GELU-tanh GLU).
Glu = Callable[[Array, Array], Array]


def _swiglu(x: Array, w_gate_up: Float[Array, "E 2 F"], w_down: Float[Array, "F E"], glu: Glu = swiglu) -> Array:
    gate_up = jnp.einsum("me,ecf->mcf", x, w_gate_up)
    return glu(gate_up[:, 0], gate_up[:, 1]) @ w_down


def tiled_experts(xs: Float[Array, "M E"], group_sizes: Int[Array, "X"],
                  expert: Callable[[Float[Array, "B E"], Int[Array, ""]], Float[Array, "B E"]]) -> Float[Array, "M E"]:
    """A grouped expert function as a loop over row tiles, each inside one expert's group:
    `expert(rows, g)` is expert g's MLP of a tile of rows (`_swiglu`'s SwiGLU, or gpt-oss's clamped one
    with biases, models/gpt_oss.py).

    Tile i of expert g covers sorted rows [start, start + B); rows past the group's end belong to the
    next expert (or to padding) and are left untouched when the tile's result is written back. The
    loop runs a static number of trips (`max_tiles`): a trip count read from the routing would make
    XLA on a GPU copy it to the host every layer. Trips past the tiles in use write nothing.
    """
    m, e = xs.shape
    nx = group_sizes.shape[0]
    b = tile_rows(m, nx)
    trips = max_tiles(m, nx, b)
    tiles = (group_sizes + b - 1) // b
    tile_end = jnp.cumsum(tiles)
    group_end = jnp.cumsum(group_sizes)
    i = jnp.arange(trips, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_end, i, side="right"), nx - 1).astype(jnp.int32)
    start = (group_end - group_sizes)[group] + (i - (tile_end - tiles)[group]) * b
    end = jnp.where(i < tile_end[-1], group_end[group], 0)  # an unused trip keeps no row
    xs_pad = jnp.pad(xs, ((0, b), (0, 0)))  # a tile starting near the end must not be clamped back

    def tile(j, ys):
        g, r0 = group[j], start[j]
        yt = expert(jax.lax.dynamic_slice_in_dim(xs_pad, r0, b), g)
        keep = (r0 + jnp.arange(b)) < end[j]
        old = jax.lax.dynamic_slice_in_dim(ys, r0, b)
        return jax.lax.dynamic_update_slice_in_dim(ys, jnp.where(keep[:, None], yt, old), r0, axis=0)

    ys = jax.lax.fori_loop(0, trips, tile, jnp.zeros((m + b, e), xs.dtype))
    return ys[:m]


def _tiled_swiglu(xs: Float[Array, "M E"], group_sizes: Int[Array, "X"], w_gate_up: ExpertStack,
                  w_down: ExpertStack, glu: Glu) -> Float[Array, "M E"]:
    """The grouped SwiGLU by `tiled_experts`; each trip takes its expert's weights [X E 2 F] / [X F E]
    by `expert_weight` (kept parts: just that expert dequantized, in the activations' dtype)."""
    return tiled_experts(xs, group_sizes, lambda xt, g: _swiglu(
        xt, expert_weight(w_gate_up, g, "w_gate_up", xs.dtype), expert_weight(w_down, g, "w_down", xs.dtype), glu))


def _kernel_swiglu(d: Dispatch, w_gate_up: LayerExperts, w_down: LayerExperts, glu: Glu) -> Float[Array, "M E"]:
    """The grouped SwiGLU as two grouped-kernel calls over the layer's experts, read in place."""
    gate_up = w_gate_up.grouped(d.x, d.group_sizes).astype(d.x.dtype)
    f = gate_up.shape[1] // 2
    return w_down.grouped(glu(gate_up[:, :f], gate_up[:, f:]), d.group_sizes).astype(d.x.dtype)


def expert_mlp(d: Dispatch, lp: dict[str, Array], impl: str, glu: Glu = swiglu) -> Float[Array, "M E"]:
    """Each sorted row through its own expert's SwiGLU (silu(x Wg) * (x Wu)) Wd, or another `glu` of
    gate and up: the grouped kernel when the layer body hands over its experts in place
    (`LayerExperts`), else `impl`'s way."""
    if isinstance(lp["w_gate_up"], LayerExperts):
        return _kernel_swiglu(d, lp["w_gate_up"], lp["w_down"], glu)
    if impl == "ragged_dot":  # whole-layer weights: kept experts are dequantized here, all of them
        lp = dequantize_kept({k: lp[k] for k in ("w_gate_up", "w_down")}, d.x.dtype)
        x, e, _, f = lp["w_gate_up"].shape
        gate_up = jax.lax.ragged_dot(d.x, lp["w_gate_up"].reshape(x, e, 2 * f), d.group_sizes)
        return jax.lax.ragged_dot(glu(gate_up[:, :f], gate_up[:, f:]), lp["w_down"], d.group_sizes)
    if impl not in GROUPED_IMPLS:
        raise ConfigError(f"unknown grouped matmul {impl!r}; choose one of {GROUPED_IMPLS}")
    return _tiled_swiglu(d.x, d.group_sizes, lp["w_gate_up"], lp["w_down"], glu)


def combine(ys: Float[Array, "M E"], d: Dispatch, routing: Routing, dtype) -> Float[Array, "T E"]:
    """Unsorts the expert outputs and sums each token's k of them, weighted.

    Each weighted output is rounded to `dtype` as HF does before its `index_add_`; the k-sum itself is
    in float32 (HF adds in `dtype`), and it is a gather and a fixed-order sum, so it is deterministic.
    """
    t, k = routing.experts.shape
    m = d.order.shape[0]
    inverse = jnp.zeros_like(d.order).at[d.order].set(jnp.arange(m, dtype=d.order.dtype))
    y = ys[inverse].reshape(t, k, -1)
    weighted = (y * routing.weights[..., None]).astype(dtype)
    return jnp.sum(weighted.astype(jnp.float32), axis=1).astype(dtype)


def moe_mlp(lp: dict[str, Array], x: Float[Array, "T E"], *, cfg: ModelConfig, impl: str | None = None,
            expert_axis: str | None = None, logits: Float[Array, "T X"] | None = None) -> Float[Array, "T E"]:
    """The sparse MLP of one decoder layer; `logits` are the router's where the caller computed them (a
    router stack a kernel reads in place: models/llama.py), else `router_logits`.

    With `expert_axis` (inside shard_map), the weights hold only this device's experts: rows routed
    elsewhere go to a trailing group that is never computed, and the result is this device's
    partial sum, which the caller reduces over the axis.
    """
    logits = router_logits(lp, x) if logits is None else logits
    return routed_mlp(lp, x, route_for(cfg, logits), impl=impl, expert_axis=expert_axis)


def routed_mlp(lp: dict[str, Array], x: Float[Array, "T E"], routing: Routing, *, impl: str | None = None,
               expert_axis: str | None = None) -> Float[Array, "T E"]:
    """Each token through its routed experts, combined with the routing weights (see `moe_mlp`)."""
    d, routing = dispatch_local(x, routing, lp["w_gate_up"], expert_axis)
    return combine(expert_mlp(d, lp, impl or default_grouped_impl()), d, routing, x.dtype)


def dispatch_local(x: Float[Array, "T E"], routing: Routing, w_gate_up: ExpertStack | LayerExperts,
                   expert_axis: str | None) -> tuple[Dispatch, Routing]:
    """`dispatch` onto the experts this device holds (`w_gate_up`'s, all of them off a mesh). With
    `expert_axis` (inside shard_map), rows routed to other devices' experts go to a trailing group that
    is never computed and their weights become 0, so `combine` gives this device's partial sum."""
    w = w_gate_up
    num_local = w.num_experts if isinstance(w, LayerExperts) else jax.tree.leaves(w)[0].shape[0]
    experts = routing.experts
    if expert_axis is not None:
        local = experts - jax.lax.axis_index(expert_axis) * num_local
        mine = (local >= 0) & (local < num_local)
        experts = jnp.where(mine, local, num_local)
        routing = routing._replace(weights=jnp.where(mine, routing.weights, jnp.zeros_like(routing.weights)))
    d = dispatch(x, experts, num_local + (expert_axis is not None))
    return d._replace(group_sizes=d.group_sizes[:num_local]), routing
