"""Pallas (Triton) matmuls over weight-only quantized stacks, dequantized tile by tile on chip.

A quantized stack (`QuantStack`) holds S matrices [K, N] (a dense weight's layers, or a MoE
weight's layers x experts) as parts along the input axis K:
    values   [S, K / p, N]  p inputs an item: "int4" int32 words (input 8j + i in bits 4i of word j:
                            GPTQ / AWQ kept, compressed-tensors pack-quantized), "q4_1" GGUF bytes
                            (in a block of 32 inputs, byte i holds input i in its low nibble and
                            input i + 16 in its high one), or one int8, float8_e4m3fn or float value
    scale    [S, K / g, N]  one per g consecutive inputs (g = K: one per output channel)
    zero     [S, K / g, N]  optional uint8, subtracted before scaling (else `zero_point`)
    minimum  [S, K / g, N]  optional, added after scaling (GGUF Q4_1's m)
A weight is `(q - zero) * scale + minimum` in float32, the formats' definitions (bit for bit the
dequantizers in infire_jax/quant), cast to x's dtype and fed to the dot with float32 accumulation.
A tile loads each packed item once per input it holds (a word for its eight inputs, from cache),
so the weights reach the dot in input order and x is used as it is.

`quant_matmul(x, stack, index)` is x @ W[index] for a decode-sized step: rows in tiles of up to
64, and K split over programs so that a few rows still fill the GPU (the partial sums are added
outside). `grouped_matmul(x, group_sizes, stack, first)` multiplies rows sorted by group by
W[first + group] (a MoE layer's experts): tiles of rows never straddle two groups, so each tile
reads its expert's weights once. Either way the stack index is data the kernel reads, so a layer
scan hands over the whole stack, and no weight is ever copied out or dequantized in HBM.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int, Shaped

from pallas_kernels.triton_backend import compiler_params, dot_precision, is_power_of_2, next_power_of_2

INPUTS_PER_ITEM = {"int4": 8, "q4_1": 2, None: 1}
TILE_N = 64  # output columns per program
MIN_ROWS = 16  # Triton's smallest dot tile
MAX_TILE_ROWS = 64  # rows a program holds accumulators for
MAX_BLOCK_K = 128  # inputs per inner step
TARGET_PROGRAMS = 264  # about two per SM of an H100 / H200 (132 SMs)
MAX_SPLITS = 16


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantStack:
    """S quantized [K, N] matrices as parts along K (module docstring); `packing` and `zero_point`
    are static."""

    values: Shaped[Array, "S Kp N"]
    scale: Shaped[Array, "S Kg N"] | None = None
    zero: Shaped[Array, "S Kg N"] | None = None
    minimum: Shaped[Array, "S Kg N"] | None = None
    packing: str | None = dataclasses.field(default=None, metadata=dict(static=True))
    zero_point: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def num_inputs(self) -> int:
        return self.values.shape[1] * INPUTS_PER_ITEM[self.packing]

    @property
    def num_outputs(self) -> int:
        return self.values.shape[2]

    @property
    def group(self) -> int:
        """Inputs per scale row (0 without scales)."""
        return 0 if self.scale is None else self.num_inputs // self.scale.shape[1]

    def check(self) -> None:
        """ValueError naming the part whose shape does not fit the others, or a shape the kernel cannot tile."""
        if self.packing not in INPUTS_PER_ITEM:
            raise ValueError(f"unknown packing {self.packing!r}; one of {sorted(map(str, INPUTS_PER_ITEM))}")
        s, k, n = self.values.shape[0], self.num_inputs, self.num_outputs
        for name in ("scale", "zero", "minimum"):
            part = getattr(self, name)
            if part is None:
                continue
            if self.scale is None or part.ndim != 3 or part.shape[0] != s or part.shape[2] != n or \
                    part.shape[1] != self.scale.shape[1] or k % part.shape[1]:
                raise ValueError(f"quantized stack part {name} {tuple(part.shape)} does not fit values "
                                 f"{tuple(self.values.shape)} ({k} inputs) and scale "
                                 f"{None if self.scale is None else tuple(self.scale.shape)}")
        if self.packing == "q4_1" and (self.group != 32):
            raise ValueError(f"Q4_1 blocks hold 32 inputs a scale, got groups of {self.group}")
        if block_k_for(k) is None or tile_n_for(n) is None:
            raise ValueError(f"the quantized matmul cannot tile [{k}, {n}] matrices (K and N need a power-of-two "
                             f"factor of at least {MIN_ROWS})")


def block_k_for(k: int) -> int | None:
    """Inputs per inner step: the largest power of two up to MAX_BLOCK_K dividing K (at least 16)."""
    b = MAX_BLOCK_K
    while b >= MIN_ROWS and k % b:
        b //= 2
    return b if b >= MIN_ROWS else None


def tile_n_for(n: int) -> int | None:
    b = TILE_N
    while b >= MIN_ROWS and n % b:
        b //= 2
    return b if b >= MIN_ROWS else None


def supported(stack: QuantStack) -> bool:
    try:
        stack.check()
    except ValueError:
        return False
    return True


def _weight_tile(stack: QuantStack, refs: dict, index, k0, n0, *, block_k: int, tile_n: int, dtype):
    """W[index][k0 : k0 + block_k, n0 : n0 + tile_n] dequantized, in `dtype`."""
    k = k0 + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    cols = pl.ds(n0, tile_n)
    if stack.packing == "int4":
        rows, shift = lax.shift_right_logical(k, 3), (k & 7) * 4
    elif stack.packing == "q4_1":
        rows, shift = lax.shift_right_logical(k, 5) * 16 + (k & 15), ((k & 31) >> 4) * 4
    else:
        rows, shift = pl.ds(k0, block_k), None
    v = refs["values"][index, rows, cols]
    if shift is not None:
        v = lax.shift_right_logical(v.astype(jnp.int32), shift[:, None]) & 0xF
    if refs.get("scale") is None:  # plain weights
        return v.astype(dtype)
    g = lax.div(k, jnp.int32(stack.group))
    if refs.get("zero") is not None:
        v = v.astype(jnp.int32) - refs["zero"][index, g, cols].astype(jnp.int32)
    elif stack.zero_point:
        v = v.astype(jnp.int32) - stack.zero_point
    w = v.astype(jnp.float32) * refs["scale"][index, g, cols].astype(jnp.float32)
    if refs.get("minimum") is not None:
        w = w + refs["minimum"][index, g, cols].astype(jnp.float32)
    return w.astype(dtype)


_PARTS = ("values", "scale", "zero", "minimum")


def _kernel(index_ref, start_ref, blocks_ref, x_ref, *refs, stack: QuantStack, block_k: int, tile_n: int,
            splits: int, precision):
    out_ref = refs[-1]
    present = [p for p in _PARTS if getattr(stack, p) is not None]
    parts = dict(zip(present, refs[:-1]))
    t, n, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    index, start, blocks = index_ref[t], start_ref[t], blocks_ref[t]
    per_split = pl.cdiv(blocks, splits)
    first = s * per_split
    last = jnp.minimum(first + per_split, blocks)
    rows = out_ref.shape[0]

    def body(kb, acc):
        k0 = kb * block_k
        w = _weight_tile(stack, parts, index, k0, n * tile_n, block_k=block_k, tile_n=tile_n, dtype=x_ref.dtype)
        x = x_ref[pl.ds(start, rows), pl.ds(k0, block_k)]
        return acc + lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)

    out_ref[...] = lax.fori_loop(first, last, body, jnp.zeros((rows, tile_n), jnp.float32))


def _tiles_call(x: Array, stack: QuantStack, index: Array, start: Array, blocks: Array, rows: int, splits: int,
                interpret: bool) -> Float[Array, "P T R N"]:
    """Each tile t's `rows` rows of x from `start[t]` times W[index[t]], over its first `blocks[t]`
    blocks of K (0: none); [splits, tiles, rows, N] partial sums in float32."""
    stack.check()
    k, n = stack.num_inputs, stack.num_outputs
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} inputs, the quantized stack {k}")
    block_k, tile_n = block_k_for(k), tile_n_for(n)
    present = [getattr(stack, p) for p in _PARTS if getattr(stack, p) is not None]
    tiles = index.shape[0]
    whole = pl.BlockSpec()
    return pl.pallas_call(
        functools.partial(_kernel, stack=stack, block_k=block_k, tile_n=tile_n, splits=splits,
                          precision=dot_precision(x.dtype)),
        grid=(tiles, n // tile_n, splits),
        in_specs=[whole] * (4 + len(present)),
        out_specs=pl.BlockSpec((None, None, rows, tile_n), lambda t, j, s: (s, t, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, tiles, rows, n), jnp.float32),
        compiler_params=compiler_params(num_warps=4, num_stages=2),
        interpret=interpret,
        name="quant_matmul",
    )(index.astype(jnp.int32), start.astype(jnp.int32), blocks.astype(jnp.int32), x, *present)


def choose_splits(programs: int, blocks: int) -> int:
    """Fewest K splits that give TARGET_PROGRAMS programs, at most one per block of K."""
    return max(1, min(-(-TARGET_PROGRAMS // programs), MAX_SPLITS, blocks))


def quant_matmul(x: Float[Array, "M K"], stack: QuantStack, index: Int[Array, ""] | int = 0, *,
                 interpret: bool = False) -> Float[Array, "M N"]:
    """x @ W[index] in float32 (x's dtype into the dot), W dequantized tile by tile on chip."""
    m, k = x.shape
    rows = min(MAX_TILE_ROWS, max(MIN_ROWS, next_power_of_2(m)))
    tiles = -(-m // rows)
    xp = jnp.pad(x, ((0, tiles * rows - m), (0, 0)))
    blocks = k // (block_k_for(k) or 1)
    splits = choose_splits(tiles * stack.num_outputs // (tile_n_for(stack.num_outputs) or 1), blocks)
    out = _tiles_call(xp, stack, jnp.full((tiles,), index, jnp.int32), jnp.arange(tiles, dtype=jnp.int32) * rows,
                      jnp.full((tiles,), blocks, jnp.int32), rows, splits, interpret)
    return out.sum(axis=0).reshape(tiles * rows, -1)[:m]


def group_tile_rows(num_rows: int, num_groups: int) -> int:
    """Rows per tile of the grouped matmul: about the mean group size, a power of two in [16, 64]."""
    mean = max(1, num_rows // num_groups)
    return min(MAX_TILE_ROWS, max(MIN_ROWS, next_power_of_2(mean)))


def grouped_matmul(x: Float[Array, "M K"], group_sizes: Int[Array, "G"], stack: QuantStack,
                   first: Int[Array, ""] | int = 0, *, interpret: bool = False) -> Float[Array, "M N"]:
    """Row r of x (rows sorted by group; group i has `group_sizes[i]` rows) times W[first + its
    group], in float32. Rows past the groups' sum come back 0."""
    m, k = x.shape
    num_groups = group_sizes.shape[0]
    rows = group_tile_rows(m, num_groups)
    if not is_power_of_2(rows):
        raise ValueError(f"tile rows {rows} is not a power of two")
    # A static bound on tiles in use: each of at most min(G, M) non-empty groups wastes under one tile.
    trips = (m + min(num_groups, m) * (rows - 1)) // rows
    tiles = (group_sizes + rows - 1) // rows
    tile_end = jnp.cumsum(tiles)
    tile_first = tile_end - tiles
    group_end = jnp.cumsum(group_sizes)
    group_first = group_end - group_sizes
    i = jnp.arange(trips, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_end, i, side="right"), num_groups - 1).astype(jnp.int32)
    used = i < tile_end[-1]
    start = jnp.where(used, group_first[group] + (i - tile_first[group]) * rows, 0)
    blocks = jnp.where(used, k // (block_k_for(k) or 1), 0)
    xp = jnp.pad(x, ((0, rows), (0, 0)))  # a tile near the end reads past the last row
    out = _tiles_call(xp, stack, first + group, start, blocks, rows, 1, interpret)[0]
    r = jnp.arange(m, dtype=jnp.int32)
    row_group = jnp.searchsorted(group_end, r, side="right").astype(jnp.int32)
    valid = row_group < num_groups
    g = jnp.minimum(row_group, num_groups - 1)
    offset = r - group_first[g]
    y = out[jnp.minimum(tile_first[g] + offset // rows, trips - 1), offset % rows]
    return jnp.where(valid[:, None], y, 0.0)
