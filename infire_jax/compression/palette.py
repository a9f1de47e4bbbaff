"""The fixed-rate palette format: 12 bits per weight plus escape rows, laid out for device memory.

Per palette group (one layer of a stacked weight, or the whole tensor) the 16 most common exponents
form a palette and every exponent is stored as its 4-bit index, two per byte along the last axis;
the sign+mantissa byte is stored as it is. A row of 64 consecutive weights that holds an exponent
outside the palette is an escape row: its 64 exponent bytes are stored verbatim and written over
the palette's output. Every weight decodes from fixed offsets, so decoding is one gather and one
scatter with no data-dependent control flow.

Escape lists are kept per block of a `grid` that splits each axis into equal parts. Sharding
uses the same grid (one block per device along each sharded axis), so each device's shard holds
whole rows and its own escape list with local row numbers, and decodes with no communication.
Lists are padded to a common capacity with the sentinel row `rows_per_block`, which decoding drops.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int32, Shaped, UInt8

from infire_jax.compression.bf16 import merge_bf16, split_bf16

ROW = 64  # weights per escape row
PALETTE_SIZE = 16  # exponents per palette: 4-bit codes


@dataclasses.dataclass(frozen=True)
class PaletteTensor:
    """One palette-coded bfloat16 tensor (`stacked`: one palette per index of the leading axis)."""

    palette: UInt8[np.ndarray, "G 16"]
    codes: UInt8[np.ndarray, "..."]  # the weight's shape with the last axis halved
    sign_mantissa: UInt8[np.ndarray, "..."]  # the weight's shape
    esc_rows: Int32[np.ndarray, "... K"]  # [*grid, K]: escape rows of each block, sentinel-padded
    esc_exp: UInt8[np.ndarray, "... K 64"]  # [*grid, K, 64]: their exponents
    stacked: bool

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.sign_mantissa.shape)

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(self.esc_rows.shape[:-1])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.palette, self.codes, self.sign_mantissa, self.esc_rows, self.esc_exp))

    def arrays(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "stacked"}


def default_grid(shape: tuple[int, ...], stacked: bool) -> tuple[int, ...]:
    """One block per palette group: per layer for a stacked weight, else the whole tensor."""
    return (shape[0],) + (1,) * (len(shape) - 1) if stacked else (1,) * len(shape)


def check_layout(shape: tuple[int, ...], grid: tuple[int, ...], stacked: bool, name: str = "tensor") -> None:
    """Raises ValueError unless a tensor of `shape` can be palette-coded with `grid`."""
    if len(grid) != len(shape) or not shape:
        raise ValueError(f"{name}: grid {grid} does not match shape {shape}")
    if stacked and (len(shape) < 2 or grid[0] != shape[0]):
        raise ValueError(f"{name}: a stacked tensor needs 2+ axes and one block per layer, got {shape}, grid {grid}")
    if any(g < 1 or n % g for n, g in zip(shape, grid)):
        raise ValueError(f"{name}: grid {grid} does not split shape {shape} evenly")
    block = [n // g for n, g in zip(shape, grid)]
    if math.prod(block[1:] if stacked else block) % ROW:
        raise ValueError(f"{name}: blocks of {block} hold no whole number of {ROW}-weight rows")
    if block[-1] % 2:
        raise ValueError(f"{name}: the last axis of each block ({block[-1]}) must be even to pack two codes a byte")


def _blocks(a: np.ndarray, grid: tuple[int, ...]) -> np.ndarray:
    """[*shape] -> [num_blocks, rows_per_block, ROW], each block flattened in C order."""
    split = [d for n, g in zip(a.shape, grid) for d in (g, n // g)]
    order = list(range(0, 2 * a.ndim, 2)) + list(range(1, 2 * a.ndim, 2))
    return a.reshape(split).transpose(order).reshape(math.prod(grid), -1, ROW)


def _unblocks(b: np.ndarray, shape: tuple[int, ...], grid: tuple[int, ...]) -> np.ndarray:
    """The inverse of `_blocks`."""
    n = len(shape)
    b = b.reshape(list(grid) + [s // g for s, g in zip(shape, grid)])
    order = [i // 2 + (n if i % 2 else 0) for i in range(2 * n)]
    return b.transpose(order).reshape(shape)


def choose_palette(exponent: np.ndarray) -> UInt8[np.ndarray, "16"]:
    """The 16 most common exponents, most common first (ties: smaller value first), so encoding is
    deterministic; absent values fill a short palette in ascending order."""
    counts = np.bincount(exponent.ravel(), minlength=256)
    return np.lexsort((np.arange(256), -counts))[:PALETTE_SIZE].astype(np.uint8)


def encode_palette(x: Shaped[np.ndarray, "..."], *, stacked: bool, grid: tuple[int, ...] | None = None,
                   name: str = "tensor") -> PaletteTensor:
    """Palette-codes a bfloat16 array. Deterministic: the same array and grid give the same bytes."""
    grid = tuple(grid) if grid is not None else default_grid(x.shape, stacked)
    check_layout(tuple(x.shape), grid, stacked, name)
    exponent, sign_mantissa = split_bf16(x)
    groups = exponent.reshape(x.shape[0] if stacked else 1, *(x.shape[1:] if stacked else x.shape))
    group_grid = grid[1:] if stacked else grid
    palettes, codes, bad_rows = [], [], []
    for e in groups:
        palette = choose_palette(e)
        lut = np.zeros(256, np.uint8)
        lut[palette] = np.arange(PALETTE_SIZE, dtype=np.uint8)
        member = np.zeros(256, bool)
        member[palette] = True
        palettes.append(palette)
        codes.append(lut[e])
        rows_ok = _blocks(member[e], group_grid).all(axis=-1)  # [blocks, rows]
        bad_rows.append([np.flatnonzero(~ok) for ok in rows_ok])
    rows_per_block = math.prod(x.shape) // (len(groups) * math.prod(group_grid) * ROW)
    capacity = max(1, max(len(r) for blocks in bad_rows for r in blocks))  # never 0: no empty arrays
    esc_rows = np.full((len(groups), math.prod(group_grid), capacity), rows_per_block, np.int32)
    esc_exp = np.zeros((len(groups), math.prod(group_grid), capacity, ROW), np.uint8)
    for g, (e, blocks) in enumerate(zip(groups, bad_rows)):
        exp_blocks = _blocks(e, group_grid)
        for b, rows in enumerate(blocks):
            esc_rows[g, b, :len(rows)] = rows
            esc_exp[g, b, :len(rows)] = exp_blocks[b, rows]
    code = np.stack(codes).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    return PaletteTensor(palette=np.stack(palettes), codes=(code[..., 0] | (code[..., 1] << 4)).astype(np.uint8),
                         sign_mantissa=sign_mantissa, esc_rows=esc_rows.reshape(*grid, capacity),
                         esc_exp=esc_exp.reshape(*grid, capacity, ROW), stacked=stacked)


def _check_tensor(t: PaletteTensor) -> None:
    """Raises ValueError if the parts of `t` do not fit together (a damaged or foreign tensor)."""
    shape, grid = t.shape, t.grid
    check_layout(shape, grid, t.stacked)
    groups = shape[0] if t.stacked else 1
    if t.palette.shape != (groups, PALETTE_SIZE) or t.codes.shape != (*shape[:-1], shape[-1] // 2):
        raise ValueError(f"palette {t.palette.shape} or codes {t.codes.shape} do not fit shape {shape}")
    if t.esc_exp.shape != (*t.esc_rows.shape, ROW):
        raise ValueError(f"escape exponents {t.esc_exp.shape} do not fit escape rows {t.esc_rows.shape}")
    rows_per_block = math.prod(shape) // (math.prod(grid) * ROW)
    if t.esc_rows.size and (t.esc_rows.min() < 0 or t.esc_rows.max() > rows_per_block):
        raise ValueError(f"escape rows outside 0..{rows_per_block}")


def decode_palette(t: PaletteTensor) -> np.ndarray:
    """The bfloat16 array `t` encodes, bit for bit (host decoder)."""
    _check_tensor(t)
    shape, grid = t.shape, t.grid
    codes = np.stack([t.codes & 0xF, t.codes >> 4], axis=-1).reshape(shape)
    groups = shape[0] if t.stacked else 1
    group_shape, group_grid = (shape[1:], grid[1:]) if t.stacked else (shape, grid)
    esc_rows = t.esc_rows.reshape(groups, math.prod(group_grid), -1)
    esc_exp = t.esc_exp.reshape(groups, math.prod(group_grid), -1, ROW)
    exponent = np.empty(shape, np.uint8).reshape(groups, *group_shape)
    for g, c in enumerate(codes.reshape(groups, *group_shape)):
        rows = _blocks(t.palette[g][c], group_grid)
        for b in range(rows.shape[0]):
            real = esc_rows[g, b] < rows.shape[1]
            rows[b, esc_rows[g, b, real]] = esc_exp[g, b, real]
        exponent[g] = _unblocks(rows, group_shape, group_grid)
    return merge_bf16(exponent.reshape(shape), t.sign_mantissa)


def decode_palette_block(codes: UInt8[Array, "..."], sign_mantissa: UInt8[Array, "..."],
                         palette: UInt8[Array, "16"], esc_rows: Int32[Array, "... K"],
                         esc_exp: UInt8[Array, "... K 64"]) -> Shaped[Array, "..."]:
    """Device decoder of one block (one layer's shard): branch-free, fixed shapes.

    A gather through the 16-entry palette, then a scatter of the escape rows, whose sentinel-padded
    entries fall outside the rows and are dropped.
    """
    shape = sign_mantissa.shape
    code = jnp.stack([codes & 0xF, codes >> 4], axis=-1).reshape(shape)
    exponent = jnp.take(palette, code.astype(jnp.int32), mode="clip")
    rows = exponent.reshape(-1, ROW).at[esc_rows.reshape(-1)].set(esc_exp.reshape(-1, ROW), mode="drop")
    return merge_device(rows.reshape(shape), sign_mantissa)


def merge_device(exponent: UInt8[Array, "..."], sign_mantissa: UInt8[Array, "..."]) -> Shaped[Array, "..."]:
    """The bfloat16 array of these exponent and sign+mantissa bytes, on the device."""
    sm = sign_mantissa.astype(jnp.uint16)
    bits = ((sm & 0x80) << 8) | (exponent.astype(jnp.uint16) << 7) | (sm & 0x7F)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)

