"""Pallas (Triton) LoRA deltas, each token with its own adapter slot: Punica's SGMV on the GPU (BGMV
when a tile holds one token).

y[t, n] = sum_j u[t, member(n) * R + j] * b[layer, s, j, n],  u[t, c] = x[t] . a[layer, s, c],  s = slots[t],
for whole stacks a [L, S, C*R, K] and b [L, S, R, N] (infire_jax/lora/layout.py) read in place: the
layer and each tile's slot are data the kernels read, so no slot is copied out and adding or
removing an adapter changes no shape. Slot 0 is the base model: its tokens get no tile and an
exact zero.

Tokens are grouped by slot (a stable sort, as in quant_matmul.py's grouped matmul) and cut into
tiles of `rows` tokens of one slot, a static number of tiles (enough for any assignment); tiles past
those in use do nothing. Two calls:
- shrink, grid (tile, member): u [tiles, rows, C*R] = each row's x . A rows of its slot, K in steps
  of `block_k`; a step's A block [R, block_k] is loaded once for all the tile's rows;
- expand, grid (tile, column block): y [tiles, rows, N] = u's member rows . B block [R, tile_n], B
  loaded once per tile; a column block lies inside one member (`tile_n` chosen so).
Both multiply in float32 on the CUDA cores, a row's products summed in registers (no tensor-core
dot: ranks 8 and the tiles' few rows are below Triton's 16-wide dot). Each output element is
summed in the same order whatever else the step holds, so a row's delta does not depend on the
other rows. The tiles' rows go back to token order in one gather outside.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from pallas_kernels.triton_backend import compiler_params, is_power_of_2, lowered_once

MAX_ROWS = 8  # tokens of one slot per tile
TILE_WIDTHS = (64, 32, 16)  # output columns per expand program, the widest that fits
REGISTER_ELEMENTS = 4096  # a weight block [R, block_k] or [chunk, tile_n] held at once
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _block_k(k: int, rank: int) -> int:
    """K step of the shrink: the largest power of two dividing K with the A block in registers (0: none >= 16)."""
    step = max(16, min(128, REGISTER_ELEMENTS // rank))
    while step >= 16 and k % step:
        step //= 2
    return step if step >= 16 else 0


def _tile_n(members: np.ndarray) -> int:
    """Expand columns per program: the widest of TILE_WIDTHS dividing N whose blocks each read one member (0: none)."""
    for width in TILE_WIDTHS:
        if members.size % width == 0:
            blocks = members.reshape(-1, width)
            if np.all(blocks == blocks[:, :1]):
                return width
    return 0


def applies(a: Array, b: Array, members: np.ndarray) -> bool:
    """Whether stacks a [L, S, C*R, K] and b [L, S, R, N] take the kernels (decided at trace time): a
    power-of-two rank, float stacks of one dtype, K with a power-of-two step >= 16 and N a block of
    16 or more columns of one member."""
    rank = b.shape[2]
    return (a.ndim == 4 and b.ndim == 4 and a.dtype == b.dtype and any(a.dtype == d for d in DTYPES)
            and is_power_of_2(rank) and a.shape[2] % rank == 0 and members.size == b.shape[3]
            and _block_k(a.shape[3], rank) > 0 and _tile_n(members) > 0)


def tile_rows(num_tokens: int, num_slots: int) -> int:
    """Tokens a tile holds: about the mean tokens per adapter, a power of two up to MAX_ROWS (1: BGMV)."""
    mean = max(1, num_tokens // max(1, num_slots - 1))
    return min(MAX_ROWS, 1 << (mean.bit_length() - 1))


def _tiles(slots: Int[Array, "T"], num_slots: int, rows: int, k_steps: int):
    """The tiles of a step: each tile's slot, K steps (0: unused), rows' tokens [tiles, rows]; and
    each token's row of the tiles' output (flattened) with whether it has an adapter."""
    t = slots.shape[0]
    adapted = (slots > 0) & (slots < num_slots)
    s = jnp.where(adapted, slots, 0).astype(jnp.int32)
    order = jnp.argsort(s, stable=True).astype(jnp.int32)
    sizes = jnp.bincount(s, length=num_slots).astype(jnp.int32)
    tiles = (sizes.at[0].set(0) + rows - 1) // rows  # slot 0: no tiles
    tile_end, group_end = jnp.cumsum(tiles), jnp.cumsum(sizes)
    tile_first, group_first = tile_end - tiles, group_end - sizes
    trips = max(1, (t + min(num_slots - 1, t) * (rows - 1)) // rows)
    i = jnp.arange(trips, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_end, i, side="right"), num_slots - 1).astype(jnp.int32)
    used = i < tile_end[-1]
    first = group_first[group] + (i - tile_first[group]) * rows
    tokens = order[jnp.clip(first[:, None] + jnp.arange(rows, dtype=jnp.int32), 0, t - 1)]
    tile_slot = jnp.where(used, group, 0)
    steps = jnp.where(used, k_steps, 0).astype(jnp.int32)
    sorted_at = jnp.zeros(t, jnp.int32).at[order].set(jnp.arange(t, dtype=jnp.int32))
    offset = sorted_at - group_first[s]
    out_row = (tile_first[s] + offset // rows) * rows + offset % rows
    return tile_slot, steps, tokens, jnp.where(adapted, out_row, 0), adapted


def _shrink_kernel(layer_ref, slot_ref, steps_ref, token_ref, x_ref, a_ref, u_ref, *, rank: int, block_k: int):
    i, c = pl.program_id(0), pl.program_id(1)
    layer, slot = layer_ref[0], slot_ref[i]
    tokens = [token_ref[i, r] for r in range(u_ref.shape[0])]

    def body(kb, acc):
        k0 = pl.multiple_of(kb * block_k, block_k)
        w = a_ref[layer, slot, pl.ds(c * rank, rank), pl.ds(k0, block_k)].astype(jnp.float32)
        return tuple(u + jnp.sum(w * x_ref[tok, pl.ds(k0, block_k)].astype(jnp.float32)[None, :], axis=1)
                     for u, tok in zip(acc, tokens))

    zeros = tuple(jnp.zeros((rank,), jnp.float32) for _ in tokens)
    for r, u in enumerate(lax.fori_loop(0, steps_ref[i], body, zeros)):
        u_ref[r, :] = u


def _expand_kernel(layer_ref, slot_ref, chunks_ref, member_ref, u_ref, b_ref, y_ref, *, rank: int, chunk: int):
    i, j = pl.program_id(0), pl.program_id(1)
    layer, slot, member = layer_ref[0], slot_ref[i], member_ref[j]
    rows, tile_n = y_ref.shape

    def body(q, acc):
        j0 = pl.multiple_of(q * chunk, chunk)
        w = b_ref[layer, slot, pl.ds(j0, chunk), pl.ds(j * tile_n, tile_n)].astype(jnp.float32)
        return tuple(y + jnp.sum(u_ref[i, r, pl.ds(member * rank + j0, chunk)][:, None] * w, axis=0)
                     for r, y in enumerate(acc))

    zeros = tuple(jnp.zeros((tile_n,), jnp.float32) for _ in range(rows))
    for r, y in enumerate(lax.fori_loop(0, chunks_ref[i], body, zeros)):
        y_ref[r, :] = y


def lora_sgmv(x: Float[Array, "T K"], a: Float[Array, "L S CR K"], b: Float[Array, "L S R N"], slots: Int[Array, "T"],
              members: np.ndarray, layer: Int[Array, ""] | int, *, interpret: bool = False) -> Float[Array, "T N"]:
    """Each token's delta in float32 (module docstring); tokens of slot 0 (or a slot outside the
    stacks) get zeros. `members`: each output column's member, static."""
    if not applies(a, b, members):
        raise ValueError(f"lora_sgmv cannot tile stacks a {a.shape} {a.dtype}, b {b.shape} {b.dtype} (a power-of-two "
                         "rank, K with a power-of-two factor >= 16, N in blocks of >= 16 columns of one member)")
    if a.shape[3] != x.shape[1]:
        raise ValueError(f"x has {x.shape[1]} inputs, the A stack {a.shape[3]}")
    return _shrink_and_expand(x, a, b, slots, jnp.asarray(layer, jnp.int32).reshape(1),
                              members=tuple(np.asarray(members).tolist()), interpret=interpret)


@lowered_once("members", "interpret")
def _shrink_and_expand(x: Float[Array, "T K"], a: Float[Array, "L S CR K"], b: Float[Array, "L S R N"],
                       slots: Int[Array, "T"], layer: Int[Array, "1"], *, members: tuple[int, ...],
                       interpret: bool) -> Float[Array, "T N"]:
    """`lora_sgmv`'s two launches, `members` a tuple (a static argument must hash)."""
    members = np.asarray(members)
    t, k = x.shape
    num_slots, cr, rank, n = a.shape[1], a.shape[2], b.shape[2], b.shape[3]
    block_k, tile_n = _block_k(k, rank), _tile_n(members)
    chunk = min(rank, max(1, REGISTER_ELEMENTS // tile_n))
    rows = tile_rows(t, num_slots)
    tile_slot, steps, tokens, out_row, adapted = _tiles(slots, num_slots, rows, k // block_k)
    trips = tile_slot.shape[0]
    whole = pl.BlockSpec()
    u = pl.pallas_call(
        functools.partial(_shrink_kernel, rank=rank, block_k=block_k),
        grid=(trips, cr // rank),
        in_specs=[whole] * 6,
        out_specs=pl.BlockSpec((None, rows, rank), lambda i, c: (i, 0, c)),
        out_shape=jax.ShapeDtypeStruct((trips, rows, cr), jnp.float32),
        compiler_params=compiler_params(num_warps=4, num_stages=2),
        interpret=interpret,
        name="lora_shrink",
    )(layer, tile_slot, steps, tokens, x, a)
    tile_member = jnp.asarray(members.reshape(-1, tile_n)[:, 0], jnp.int32)
    y = pl.pallas_call(
        functools.partial(_expand_kernel, rank=rank, chunk=chunk),
        grid=(trips, n // tile_n),
        in_specs=[whole] * 6,
        out_specs=pl.BlockSpec((None, rows, tile_n), lambda i, j: (i, 0, j)),
        out_shape=jax.ShapeDtypeStruct((trips, rows, n), jnp.float32),
        compiler_params=compiler_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="lora_expand",
    )(layer, tile_slot, jnp.where(steps > 0, rank // chunk, 0).astype(jnp.int32), tile_member, u, b)
    return jnp.where(adapted[:, None], y.reshape(trips * rows, n)[out_row], 0.0)
