"""Each token's LoRA delta, its adapter's slot gathered per token (Punica's BGMV and SGMV), and the
hook that adds it to the decoder's projections (models/llama.py `linear`).

A step's forward takes the stacks (layout.py) and each token's slot ([T] int32, 0: no adapter).
The stacks are not scanned with the layer weights: the layer body reads its layer of them in
place (`LoRAWeight` holds the whole stack and the layer index), so a step reads only the slots
its tokens use, never a copy of every slot's layer. Four ways to the same sums:

- `bgmv` (the reference): every token gathers its slot's A and B; for decode-sized steps;
- `sgmv`: tokens sorted by slot, cut into tiles of one slot each, a loop of tile products (as
  models/moe.py's grouped matmul): for prompt chunks, where per-token copies of A would not fit;
  tokens of slot 0 are skipped;
- on the CPU (one device), pallas_kernels/cpu_lora.py's FFI call, which groups the tokens by slot
  and reads each slot's A and B in place once per group;
- on a GPU (one device), pallas_kernels/lora_sgmv.py's Pallas shrink and expand, the same grouping
  (tiles of one slot, the stacks read in place). On a mesh the jnp forms take every backend.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from infire_jax.lora.layout import column_members, is_stack, stack_key
from pallas_kernels import cpu_lora, lora_sgmv, placement

BGMV_MAX_TOKENS = 64  # larger steps take `sgmv`: per-token copies of A grow with the tokens
SGMV_TILE = 32  # tokens per tile of `sgmv`


class LoRAStep(NamedTuple):
    """What a step's forward takes for its adapters: every stack (layout.py) and each token's slot."""

    stacks: dict[str, Array]
    slots: Int[Array, "T"]


def _expand(u: Float[Array, "T C R"], b: Float[Array, "T R N"] | Float[Array, "R N"], members: np.ndarray
            ) -> Float[Array, "T N"]:
    """y[t, n] = sum_j u[t, member(n), j] b[j, n] (b per token or shared): each member's product, kept
    on its own columns."""
    spec = "tcr,trn->tcn" if b.ndim == 3 else "tcr,rn->tcn"
    z = jnp.einsum(spec, u, b, preferred_element_type=jnp.float32)
    onehot = jnp.asarray(members[None, :] == np.arange(u.shape[1])[:, None], jnp.float32)  # [C, N]
    return jnp.sum(z * onehot, axis=1)


def bgmv(x: Float[Array, "T K"], a: Float[Array, "L S CR K"], b: Float[Array, "L S R N"], layer: Int[Array, ""],
         slots: Int[Array, "T"], members: np.ndarray) -> Float[Array, "T N"]:
    """Each token with its own slot's A and B, gathered: the reference, float32 sums."""
    r = b.shape[2]
    at = a[layer, slots]  # [T, CR, K]
    u = jnp.einsum("tk,tck->tc", x, at, preferred_element_type=jnp.float32)
    return _expand(u.reshape(x.shape[0], -1, r), b[layer, slots].astype(jnp.float32), members)


def sgmv(x: Float[Array, "T K"], a: Float[Array, "L S CR K"], b: Float[Array, "L S R N"], layer: Int[Array, ""],
         slots: Int[Array, "T"], members: np.ndarray, tile: int = SGMV_TILE) -> Float[Array, "T N"]:
    """`bgmv`'s sums with the tokens sorted by slot and cut into tiles of one slot: each tile reads its
    slot's A and B once. A static number of trips (enough for any assignment of tokens to slots);
    trips past the tiles in use, and slot 0's tokens, write nothing."""
    t, s, r = x.shape[0], a.shape[1], b.shape[2]
    tile = min(tile, t)
    order = jnp.argsort(slots, stable=True)
    sizes = jnp.bincount(slots, length=s).astype(jnp.int32)
    tiles = (sizes.at[0].set(0) + tile - 1) // tile  # slot 0: no tiles
    tile_end, group_end = jnp.cumsum(tiles), jnp.cumsum(sizes)
    trips = (t + min(s - 1, t) * (tile - 1)) // tile
    i = jnp.arange(trips, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_end, i, side="right"), s - 1).astype(jnp.int32)
    start = (group_end - sizes)[group] + (i - (tile_end - tiles)[group]) * tile
    end = jnp.where(i < tile_end[-1], group_end[group], 0)
    xs = jnp.pad(x[order], ((0, tile), (0, 0)))

    def one(j, ys):
        g, r0 = group[j], start[j]
        xt = jax.lax.dynamic_slice_in_dim(xs, r0, tile)
        u = jnp.einsum("tk,ck->tc", xt, a[layer, g], preferred_element_type=jnp.float32)
        yt = _expand(u.reshape(tile, -1, r), b[layer, g].astype(jnp.float32), members)
        keep = (r0 + jnp.arange(tile)) < end[j]
        old = jax.lax.dynamic_slice_in_dim(ys, r0, tile)
        return jax.lax.dynamic_update_slice_in_dim(ys, jnp.where(keep[:, None], yt, old), r0, axis=0)

    ys = jax.lax.fori_loop(0, trips, one, jnp.zeros((t + tile, b.shape[3]), jnp.float32))
    return jnp.zeros((t, b.shape[3]), jnp.float32).at[order].set(ys[:t])


def lora_delta(x: Float[Array, "T ..."], a: Array, b: Array, layer: Int[Array, ""], slots: Int[Array, "T"], name: str,
               kernel: bool) -> Array:
    """The LoRA delta of the adapted weight `name` for x (tokens first, then W's input axes), in W's
    output shape [T, *out] and x's dtype. `a` [L, S, C*R, *in] and `b` [L, S, R, *out] are whole
    stacks (on a mesh, this device's shards); `kernel` (one device): the CPU FFI call or the GPU's
    Pallas kernels may take it."""
    t, out = x.shape[0], b.shape[3:]
    k, n = math.prod(a.shape[3:]), math.prod(out)
    x2 = x.reshape(t, k)
    a4 = a.reshape(*a.shape[:3], k)
    b4 = b.reshape(*b.shape[:3], n)
    members = column_members(name, out)
    if kernel and cpu_lora.applies(a4, b4, members):
        y = cpu_lora.lora_sgmv(x2, a4, b4, slots, members, layer)
    elif kernel and placement.platform() == "gpu" and lora_sgmv.applies(a4, b4, members):
        y = lora_sgmv.lora_sgmv(x2, a4, b4, slots, members, layer)
    elif t <= BGMV_MAX_TOKENS:
        y = bgmv(x2, a4, b4, layer, slots, members)
    else:
        y = sgmv(x2, a4, b4, layer, slots, members)
    return y.reshape(t, *out).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class LoRAWeight:
    """A layer's base weight (an array or models/llama.py's `InPlace`) and its adapters' stacks, read
    at `layer` for each token's slot: `linear` adds `delta(x)` to the base product."""

    base: Any
    name: str
    a: Array
    b: Array
    layer: Int[Array, ""]
    slots: Int[Array, "T"]
    kernel: bool

    def delta(self, x: Array) -> Array:
        return lora_delta(x, self.a, self.b, self.layer, self.slots, self.name, self.kernel)


@dataclasses.dataclass(frozen=True)
class LayerLoRA:
    """The adapters' stacks of a decoder stack (this device's shards inside shard_map) and each token's
    slot; `attach` wraps one layer's adapted weights."""

    stacks: dict[str, Array]
    slots: Int[Array, "T"]
    kernel: bool  # one device: the CPU FFI call may take the products

    def attach(self, lp: dict[str, Any], layer: Int[Array, ""]) -> dict[str, Any]:
        out = dict(lp)
        for name in {k[len("lora_"):-2] for k in self.stacks}:
            out[name] = LoRAWeight(lp[name], name, self.stacks[stack_key(name, "a")], self.stacks[stack_key(name, "b")],
                                   layer, self.slots, self.kernel)
        return out


def split_stacks(weights: dict[str, Any], slots: Array | None, kernel: bool) -> tuple[dict[str, Any], LayerLoRA | None]:
    """A decoder stack's weights without the adapters' stacks (those are read per layer, not scanned),
    and the stacks with the token slots (None without adapters)."""
    if slots is None:
        return weights, None
    stacks = {k: v for k, v in weights.items() if is_stack(k)}
    return {k: v for k, v in weights.items() if not is_stack(k)}, LayerLoRA(stacks, slots, kernel)
