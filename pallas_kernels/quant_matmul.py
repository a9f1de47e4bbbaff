"""Pallas (Triton) matmuls over weight-only quantized stacks, dequantized tile by tile on chip.

A quantized stack (`QuantStack`) holds S matrices [K, N] (a dense weight's layers, or a MoE
weight's layers x experts) as parts along the input axis K:
    values   [S, K / p, N]  p inputs an item: "int4" int32 words (input 8j + i in bits 4i of word j:
                            GPTQ / AWQ kept, compressed-tensors pack-quantized), "q4_1" GGUF bytes
                            (in a block of 32 inputs, byte i holds input i in its low nibble and
                            input i + 16 in its high one), "mxfp4" bytes (gpt-oss: byte j holds
                            e2m1 codes of inputs 2j, low nibble, and 2j + 1), or one int8,
                            float8_e4m3fn or float value
    scale    [S, K / g, N]  one per g consecutive inputs (g = K: one per output channel)
    zero     [S, K / g, N]  optional uint8, subtracted before scaling (else `zero_point`)
    minimum  [S, K / g, N]  optional, added after scaling (GGUF Q4_1's m)
MXFP4's scale is uint8 e8m0, one per 32 inputs: its weight is the code's FP4 value times 2^(s - 127).
A weight is `(q - zero) * scale + minimum` in float32, the formats' definitions (bit for bit the
dequantizers in infire_jax/quant), cast to x's dtype and fed to the dot with float32 accumulation.
A K step loads each packed item once and splits into pieces of whole items (an int4 word's
nibble i for every word, against inputs i, i + 8, ... of x; a Q4_1 block's low or high half), and
a scale row shared by a piece is loaded once and broadcast, not gathered per input. Tiles of one
or two rows multiply in registers (`gemv`) rather than in a dot padded to 16 rows. Block sizes
come per shape from quant_blocks.py (docs/KERNELS.md has the analysis behind them).

`quant_matmul(x, stack, index)` is x @ W[index] for a decode-sized step: rows in tiles of up to
64, and K split over programs so that a few rows still fill the GPU (the partial sums are added
outside, one small XLA reduction, or by the next kernel: `quant_matmul_parts` keeps them apart, and
a down projection reads its gate/up projection's parts, forming silu(gate) * up as it loads them).
`grouped_matmul(x, group_sizes, stack, first)` multiplies rows sorted by group by
W[first + group] (a MoE layer's experts): tiles of rows never straddle two groups, so each tile
reads its expert's weights once. `head_matmul(x, stack, first)` is its static case: every head's
rows times the head's matrix (MLA's per-head W_uk and W_uv). Either way the stack index is data
the kernel reads, so a layer scan hands over the whole stack, and no weight is ever copied out or
dequantized in HBM.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int, Shaped

from pallas_kernels.quant_blocks import (BLOCK_PACKINGS, GEMV_MAX_ROWS, INPUTS_PER_ITEM, MAX_TILE_ROWS, MIN_DOT,
                                         Blocks, choose, min_block_k, splits_for)

# The register form keeps a row's products [items, tile_n] unsummed across K steps (one sum at the
# end) when they fit in this many floats, 32 registers a thread at 4 warps; else it sums each piece.
GEMV_ACC_ELEMENTS = 4096
from pallas_kernels.triton_backend import compiler_params, dot_precision, is_power_of_2, lowered_once, next_power_of_2


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
        if self.packing in BLOCK_PACKINGS and (self.group != 32):
            raise ValueError(f"{self.packing} blocks hold 32 inputs a scale, got groups of {self.group}")
        if self.packing == "mxfp4" and (self.values.dtype != jnp.uint8 or self.scale.dtype != jnp.uint8
                                        or self.zero is not None or self.minimum is not None):
            raise ValueError(f"MXFP4 is uint8 bytes and uint8 e8m0 scales alone, got values {self.values.dtype}, "
                             f"scale {self.scale.dtype}, zero {self.zero is not None}, minimum {self.minimum is not None}")
        if self.packing == "int4" and self.group % 8:
            raise ValueError(f"an int4 word's 8 inputs share a scale; got groups of {self.group}")
        if not Blocks(min_block_k(self.packing), MIN_DOT).fits(k, n, self.packing):
            raise ValueError(f"the quantized matmul cannot tile [{k}, {n}] matrices (K needs a power-of-two factor "
                             f"of at least {min_block_k(self.packing)} and N of {MIN_DOT})")


def supported(stack: QuantStack) -> bool:
    try:
        stack.check()
    except ValueError:
        return False
    return True


def _fitted(blocks: Blocks, stack: QuantStack) -> Blocks:
    """`blocks` shrunk (K step, column tile) until it divides the stack's matrices: a chosen tiling
    always runs; the smallest one fits every stack `check` accepts."""
    k, n, packing = stack.num_inputs, stack.num_outputs, stack.packing
    while not blocks.fits(k, n, packing) and blocks.block_k > min_block_k(packing):
        blocks = dataclasses.replace(blocks, block_k=blocks.block_k // 2)
    while not blocks.fits(k, n, packing) and blocks.tile_n > MIN_DOT:
        blocks = dataclasses.replace(blocks, tile_n=blocks.tile_n // 2)
    if not blocks.fits(k, n, packing):
        raise ValueError(f"no tiling of [{k}, {n}] from {blocks.label()}")
    return blocks


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One dot's share of a K step: `items` packed rows from row `item0` of the step's items, their
    nibble at `shift` (None: whole items; -1: one row per input, each reading its input's word and
    nibble, for int4 steps too short to give each nibble a dot of 16 inputs), against inputs `col0`,
    `col0 + stride`, ... of the step."""

    item0: int
    items: int
    shift: int | None
    col0: int
    stride: int


def _pieces(packing: str | None, block_k: int) -> list[_Piece]:
    """How a K step of `block_k` inputs splits into dots whose weights are whole loads of packed items
    (each item loaded once, not once per input it holds)."""
    if packing == "int4" and block_k < 8 * MIN_DOT:
        return [_Piece(0, block_k, -1, 0, 1)]
    if packing == "int4":  # input 8j + i in bits 4i of word j: nibble i of every word, inputs i, i + 8, ...
        return [_Piece(0, block_k // 8, 4 * i, i, 8) for i in range(8)]
    if packing == "q4_1":  # block b: byte e holds input 32b + e (low nibble) and 32b + 16 + e (high)
        return [_Piece(16 * b, 16, 4 * h, 32 * b + 16 * h, 1) for b in range(block_k // 32) for h in range(2)]
    if packing == "mxfp4":  # block b: byte e holds inputs 32b + 2e (low nibble) and 32b + 2e + 1 (high)
        return [_Piece(16 * b, 16, 4 * h, 32 * b + h, 2) for b in range(block_k // 32) for h in range(2)]
    return [_Piece(0, block_k, None, 0, 1)]


def _piece_weights(stack: QuantStack, refs: dict, cache: dict, index, k0, n0, piece: _Piece, *, blocks: Blocks,
                   dtype):
    """The piece's weights [items, tile_n] dequantized, in `dtype`; `cache` keeps this K step's loads
    (an int4 word, and its scale row, serve all eight of its inputs)."""
    p, tile_n = INPUTS_PER_ITEM[stack.packing], blocks.tile_n
    cols = pl.ds(n0, tile_n)
    item0 = k0 // p + piece.item0
    key = (piece.item0, piece.items)
    if piece.shift == -1:  # input k0 + j: nibble j % 8 of word (k0 + j) / 8
        inputs = k0 + lax.broadcasted_iota(jnp.int32, (piece.items,), 0)
        v = refs["values"][index, lax.shift_right_logical(inputs, 3), cols]
        v = lax.shift_right_logical(v, ((inputs & 7) * 4)[:, None]) & 0xF
        item0, p = k0, 1  # rows are inputs
    else:
        if ("values",) + key not in cache:
            cache[("values",) + key] = refs["values"][index, pl.ds(item0, piece.items), cols]
        v = cache[("values",) + key]
    if piece.shift not in (None, -1):
        v = lax.shift_right_logical(v.astype(jnp.int32), jnp.int32(piece.shift)) & 0xF
    if refs.get("scale") is None:  # plain weights
        return v.astype(dtype)
    group = stack.group

    def part(name):
        if (name,) + key not in cache:
            if group % (32 if stack.packing in BLOCK_PACKINGS else blocks.block_k) == 0:  # one group: a row
                row = lax.div(item0 * p, jnp.int32(group))
                cache[(name,) + key] = refs[name][index, row, cols][None, :]
            else:  # a row per item (int4 words in groups shorter than the K step)
                rows = lax.div((item0 + lax.broadcasted_iota(jnp.int32, (piece.items,), 0)) * p, jnp.int32(group))
                cache[(name,) + key] = refs[name][index, rows, cols]
        return cache[(name,) + key]

    if stack.packing == "mxfp4":
        return (_fp4_value(v) * _e8m0_value(part("scale"))).astype(dtype)
    if refs.get("zero") is not None:
        v = v.astype(jnp.int32) - part("zero").astype(jnp.int32)
    elif stack.zero_point:
        v = v.astype(jnp.int32) - stack.zero_point
    w = v.astype(jnp.float32) * part("scale").astype(jnp.float32)
    if refs.get("minimum") is not None:
        w = w + part("minimum").astype(jnp.float32)
    return w.astype(dtype)


def _fp4_value(code: Array) -> Array:
    """float32 value of e2m1 `code`s (0..15): sign bit 3, exponent e bits 1-2, mantissa m bit 0;
    (m + 2 [e > 0]) * 2^(max(e, 1) - 2), by arithmetic rather than a table lookup per weight."""
    code = code.astype(jnp.int32)
    e, m = lax.shift_right_logical(code, 1) & 3, code & 1
    mag = (m + 2 * (e > 0)).astype(jnp.float32) * lax.shift_left(1, jnp.maximum(e, 1)).astype(jnp.float32) * 0.25
    return jnp.where(code >= 8, -mag, mag)


def _e8m0_value(s: Array) -> Array:
    """2^(s - 127) in float32 for uint8 e8m0 scales, the byte as the exponent field (s = 0, 2^-127, a
    subnormal that no checkpoint's scale comes near, gives 0 here)."""
    return lax.bitcast_convert_type(lax.shift_left(s.astype(jnp.int32), 23), jnp.float32)


_PARTS = ("values", "scale", "zero", "minimum")


def _cols(start, size: int, stride: int) -> pl.Slice:
    return pl.ds(start, size, stride) if stride != 1 else pl.ds(start, size)


def _swiglu_rows(x_ref, row, count: int | None, start, size: int, stride: int, num_inputs: int, parts: int,
                 dtype) -> Array:
    """silu(gate) * up for row `row` (or `count` rows from it) and the input columns `_cols(start, size,
    stride)`, from the gate/up projection's unsummed float32 partials, `parts` blocks of rows stacked
    in x_ref [parts * R, 2K] (gate columns [0, K), up [K, 2K)): each half summed and rounded to `dtype`
    as the projection's output would be, the product computed in float32 and rounded to `dtype`, as
    models/llama.py's `dense_mlp` does."""
    block = x_ref.shape[0] // parts

    def load(s, cols):
        rows = row + s * block if count is None else pl.ds(row + s * block, count)
        return x_ref[rows, cols]

    gate, up = _cols(start, size, stride), _cols(start + num_inputs, size, stride)
    g = sum(load(s, gate) for s in range(parts)).astype(dtype).astype(jnp.float32)
    u = sum(load(s, up) for s in range(parts)).astype(dtype).astype(jnp.float32)
    return (g * lax.logistic(g) * u).astype(dtype)


def _kernel(index_ref, start_ref, blocks_ref, x_ref, *refs, stack: QuantStack, blocks: Blocks, splits: int,
            precision, swiglu: int, dtype):
    out_ref = refs[-1]
    present = [p for p in _PARTS if getattr(stack, p) is not None]
    parts = dict(zip(present, refs[:-1]))
    t, n, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    index, start, k_blocks = index_ref[t], start_ref[t], blocks_ref[t]
    per_split = pl.cdiv(k_blocks, splits)
    first = s * per_split
    last = jnp.minimum(first + per_split, k_blocks)
    rows, tile_n, block_k = out_ref.shape[0], blocks.tile_n, blocks.block_k
    gemv = blocks.gemv and rows <= GEMV_MAX_ROWS
    pieces = _pieces(stack.packing, block_k)

    def x_rows(r, count, piece: _Piece, k0, size: int):  # the piece's inputs of row r (or count rows), or
        if swiglu:  # of silu(gate) * up from `swiglu` blocks of partials
            return _swiglu_rows(x_ref, r, count, k0 + piece.col0, size, piece.stride, stack.num_inputs, swiglu,
                                dtype)
        return x_ref[r if count is None else pl.ds(r, count), _cols(k0 + piece.col0, size, piece.stride)]

    def body(kb, acc):
        k0 = kb * block_k
        cache = {}
        for piece in pieces:
            w = _piece_weights(stack, parts, cache, index, k0, n * tile_n, piece, blocks=blocks, dtype=dtype)
            cols = functools.partial(x_rows, piece=piece, k0=k0, size=w.shape[0])
            if gemv:  # each row's products in registers, summed over the piece's inputs now or at the end
                wf = w.astype(jnp.float32)
                acc = tuple(a + _fold(wf * cols(start + r, None).astype(jnp.float32)[:, None], a.ndim)
                            for r, a in enumerate(acc))
            else:
                acc = acc + lax.dot_general(cols(start, rows), w, (((1,), (0,)), ((), ())),
                                            precision=precision, preferred_element_type=jnp.float32)
        return acc

    if gemv:
        items = pieces[0].items  # every piece of a step has as many
        shape = (items, tile_n) if items * tile_n <= GEMV_ACC_ELEMENTS else (tile_n,)
        acc = lax.fori_loop(first, last, body, tuple(jnp.zeros(shape, jnp.float32) for _ in range(rows)))
        for r, a in enumerate(acc):
            out_ref[r, :] = jnp.sum(a, axis=0) if a.ndim == 2 else a
    else:
        out_ref[...] = lax.fori_loop(first, last, body, jnp.zeros((rows, tile_n), jnp.float32))


def _fold(products: Array, ndim: int) -> Array:
    """`products` [items, tile_n] summed over items when the accumulator is a row (`ndim` 1)."""
    return jnp.sum(products, axis=0) if ndim == 1 else products


@lowered_once("rows", "blocks", "interpret", "dtype", "name")
def _tiles_call(x: Array, stack: QuantStack, index: Array, start: Array, k_blocks: Array, rows: int,
                blocks: Blocks, interpret: bool, dtype=None, name: str = "quant_matmul") -> Float[Array, "P T R N"]:
    """Each tile t's `rows` rows of x from `start[t]` times W[index[t]], over its first `k_blocks[t]`
    K steps of `blocks.block_k` (0: none); [splits, tiles, rows, N] partial sums in float32. Given a
    `dtype`, x is a gate/up projection's float32 partials [S, R, 2K] and the rows multiplied are
    silu(gate) * up in `dtype` (`_swiglu_rows`)."""
    k, n = stack.num_inputs, stack.num_outputs
    swiglu = x.shape[0] if dtype is not None else 0  # blocks of partials, stacked as rows
    x = x.reshape(-1, x.shape[-1])
    if x.shape[-1] != (2 * k if swiglu else k):
        twice = " (gate and up: twice)" if swiglu else ""
        raise ValueError(f"x has {x.shape[-1]} inputs, the quantized stack {k}{twice}")
    present = [getattr(stack, p) for p in _PARTS if getattr(stack, p) is not None]
    tiles, tile_n = index.shape[0], blocks.tile_n
    splits = splits_for(blocks, tiles * (n // tile_n), k // blocks.block_k)
    whole = pl.BlockSpec()
    return pl.pallas_call(
        functools.partial(_kernel, stack=stack, blocks=blocks, splits=splits, swiglu=swiglu,
                          dtype=dtype or x.dtype, precision=dot_precision(dtype or x.dtype)),
        grid=(tiles, n // tile_n, splits),
        in_specs=[whole] * (4 + len(present)),
        out_specs=pl.BlockSpec((None, None, rows, tile_n), lambda t, j, s: (s, t, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, tiles, rows, n), jnp.float32),
        compiler_params=compiler_params(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=name,
    )(index.astype(jnp.int32), start.astype(jnp.int32), k_blocks.astype(jnp.int32), x, *present)


def _tile_rows(rows: int, blocks: Blocks) -> int:
    """Rows a tile holds: `rows` as a power of two, at least Triton's dot tile unless the register form takes it."""
    rows = min(MAX_TILE_ROWS, next_power_of_2(max(rows, 1)))
    return rows if blocks.gemv and rows <= GEMV_MAX_ROWS else max(MIN_DOT, rows)


def quant_matmul_parts(x: Float[Array, "M K"] | Float[Array, "S M K2"], stack: QuantStack,
                       index: Int[Array, ""] | int = 0, *, blocks: Blocks | None = None, interpret: bool = False,
                       swiglu_dtype=None) -> Float[Array, "P R N"]:
    """x @ W[index] as float32 partial sums over K's splits, [P, R, N] for R >= M rows (rows past M
    multiply zeros): the sum over P is the product. With `swiglu_dtype`, x is a gate/up projection's
    partials (this function's output for W = [E, 2K]) and the rows multiplied are silu(gate) * up,
    rounded to that dtype, computed as each tile loads them (no launch of their own)."""
    stack.check()
    m, k = x.shape[-2], stack.num_inputs
    x_bytes = 2 * 4 * x.shape[0] if swiglu_dtype is not None else x.dtype.itemsize
    blocks = _fitted(choose(min(m, MAX_TILE_ROWS), k, stack.num_outputs, stack.packing, blocks, stack.group, x_bytes),
                     stack)
    rows = _tile_rows(m, blocks)
    tiles = -(-m // rows)
    pad = [(0, 0)] * (x.ndim - 2) + [(0, tiles * rows - m), (0, 0)]
    xp = x if tiles * rows == m else jnp.pad(x, pad)
    out = _tiles_call(xp, stack, jnp.full((tiles,), index, jnp.int32), jnp.arange(tiles, dtype=jnp.int32) * rows,
                      jnp.full((tiles,), k // blocks.block_k, jnp.int32), rows, blocks, interpret, swiglu_dtype)
    return out.reshape(out.shape[0], tiles * rows, -1)


def sum_parts(parts: Float[Array, "P R N"], rows: int) -> Float[Array, "M N"]:
    """The product `quant_matmul_parts` split over K: its parts summed, its first `rows` rows."""
    return (parts[0] if parts.shape[0] == 1 else parts.sum(axis=0))[:rows]


def quant_matmul(x: Float[Array, "M K"], stack: QuantStack, index: Int[Array, ""] | int = 0, *,
                 blocks: Blocks | None = None, interpret: bool = False) -> Float[Array, "M N"]:
    """x @ W[index] in float32 (x's dtype into the dot), W dequantized tile by tile on chip; `blocks`
    replaces the chosen tiling (quant_blocks.py)."""
    return sum_parts(quant_matmul_parts(x, stack, index, blocks=blocks, interpret=interpret), x.shape[0])


def head_matmul(x: Float[Array, "T H K"], stack: QuantStack, first: Int[Array, ""] | int = 0, *,
                blocks: Blocks | None = None, interpret: bool = False) -> Float[Array, "T H N"]:
    """Head h's rows x[:, h] times W[first + h], in float32: a layer's per-head matrices (MLA's W_uk
    and W_uv, stacked [L * H, K, N]) read in place, where XLA's batched GEMM on the layer's slice
    copies it out of the stack first. Every head has the step's T rows, so the tiles are static."""
    stack.check()
    t, h, k = x.shape
    blocks = _fitted(choose(min(t, MAX_TILE_ROWS), k, stack.num_outputs, stack.packing, blocks, stack.group,
                            x.dtype.itemsize), stack)
    rows = _tile_rows(t, blocks)
    per_head = -(-t // rows)
    xs = jnp.pad(x.transpose(1, 0, 2), ((0, 0), (0, per_head * rows - t), (0, 0))).reshape(-1, k)
    tile = jnp.arange(h * per_head, dtype=jnp.int32)
    out = _tiles_call(xs, stack, first + tile // per_head, tile * rows, jnp.full(tile.shape, k // blocks.block_k),
                      rows, blocks, interpret, name="head_matmul")
    out = out[0] if out.shape[0] == 1 else out.sum(axis=0)
    return out.reshape(h, per_head * rows, -1)[:, :t].transpose(1, 0, 2)


def group_tile_rows(num_rows: int, num_groups: int, blocks: Blocks) -> int:
    """Rows per tile of the grouped matmul: about the mean group size, a power of two up to 64."""
    return _tile_rows(max(1, num_rows // num_groups), blocks)


def grouped_matmul(x: Float[Array, "M K"], group_sizes: Int[Array, "G"], stack: QuantStack,
                   first: Int[Array, ""] | int = 0, *, blocks: Blocks | None = None,
                   interpret: bool = False) -> Float[Array, "M N"]:
    """Row r of x (rows sorted by group; group i has `group_sizes[i]` rows) times W[first + its
    group], in float32. Rows past the groups' sum come back 0. K is split as for `quant_matmul`,
    so that a batch-1 step's few expert tiles still fill the GPU."""
    stack.check()
    m, k = x.shape
    num_groups = group_sizes.shape[0]
    mean = max(1, m // num_groups)
    blocks = _fitted(choose(min(mean, MAX_TILE_ROWS), k, stack.num_outputs, stack.packing, blocks, stack.group,
                            x.dtype.itemsize), stack)
    rows = group_tile_rows(m, num_groups, blocks)
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
    # compare_all: one fused comparison, where the default binary search is a loop of a few launches
    # a trip on a GPU (two such loops in every MoE layer of a step)
    group = jnp.minimum(jnp.searchsorted(tile_end, i, side="right", method="compare_all"),
                        num_groups - 1).astype(jnp.int32)
    used = i < tile_end[-1]
    start = jnp.where(used, group_first[group] + (i - tile_first[group]) * rows, 0)
    k_blocks = jnp.where(used, k // blocks.block_k, 0)
    xp = jnp.pad(x, ((0, rows), (0, 0)))  # a tile near the end reads past the last row
    out = _tiles_call(xp, stack, first + group, start, k_blocks, rows, blocks, interpret)
    out = out[0] if out.shape[0] == 1 else out.sum(axis=0)
    r = jnp.arange(m, dtype=jnp.int32)
    row_group = jnp.searchsorted(group_end, r, side="right", method="compare_all").astype(jnp.int32)
    valid = row_group < num_groups
    g = jnp.minimum(row_group, num_groups - 1)
    offset = r - group_first[g]
    y = out[jnp.minimum(tile_first[g] + offset // rows, trips - 1), offset % rows]
    return jnp.where(valid[:, None], y, 0.0)
