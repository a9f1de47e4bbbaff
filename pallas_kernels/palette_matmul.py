"""Pallas (Triton) matmul that reads palette-coded bfloat16 weights and decodes them on chip.

`y = x @ W` for W [K, N] stored as 4-bit exponent codes, a sign+mantissa byte per weight, a 16-entry
exponent palette and escape rows (infire_jax/compression/palette.py; `tiles.py` there lays it out
for this kernel). Grid: one program per 64 output columns. A program walks K in blocks of
`block_k` rows; for each block it loads the codes (12 bits a weight in all), decodes the exponent
through the palette with a 16-way select (no gather, no branch), overwrites its escape rows (a
fixed number of slots per tile, unused ones point past the tile), reassembles the bfloat16 bits,
and feeds them to the dot with float32 accumulation. The weights never exist decoded in HBM.

Layout the kernel reads (the column halves avoid any interleave on chip), for one matrix or a
stack of layers (a leading L axis on every part, the layer chosen by an index the kernel reads, so
a layer scan hands over the whole stack and no layer is ever copied out):
    codes    [K, N/2]  byte j of a 64-column group holds column j (low nibble) and j + 32 (high)
    sm       [K, N]    sign+mantissa bytes
    palette  [16]
    esc_rows [K/block_k, N/64, C]      row within the tile (0..block_k-1), block_k = unused
    esc_exp  [K/block_k, N/64, C, 64]  that row's 64 exponents
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int32, UInt8

from pallas_kernels.triton_backend import compiler_params, lowered_once, next_power_of_2

TILE_N = 64  # output columns per program: one escape row's width
HALF = TILE_N // 2
MIN_ROWS = 16  # Triton's smallest dot tile
MAX_ROWS = 64  # the most rows whose accumulators a program holds (larger steps: decode, then XLA's dot)


def _decode_half(codes, sm, palette_ref, esc_rows_ref, esc_exp_ref, layer, kb, n, half: int, *, block_k: int,
                 capacity: int):
    """bfloat16 weights [block_k, 32] of one column half of a tile, from its codes and bytes."""
    code = (codes >> (4 * half)) & 0xF
    exponent = jnp.zeros(code.shape, jnp.int32)
    for j in range(16):  # the palette lookup as selects: Triton has no gather from a small table
        exponent = jnp.where(code == j, palette_ref[layer, j].astype(jnp.int32), exponent)
    rows = lax.broadcasted_iota(jnp.int32, (block_k, HALF), 0)

    def escape(c, e):
        verbatim = esc_exp_ref[layer, kb, n, c, pl.ds(half * HALF, HALF)].astype(jnp.int32)
        return jnp.where(rows == esc_rows_ref[layer, kb, n, c], verbatim[None, :], e)

    exponent = lax.fori_loop(0, capacity, escape, exponent)
    bits = ((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)
    return lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def _tile_parts(codes_ref, sm_ref, layer, kb, n, block_k: int):
    rows = pl.ds(kb * block_k, block_k)
    codes = codes_ref[layer, rows, pl.ds(n * HALF, HALF)].astype(jnp.int32)
    sms = [sm_ref[layer, rows, pl.ds(n * TILE_N + h * HALF, HALF)].astype(jnp.int32) for h in (0, 1)]
    return codes, sms


def _matmul_kernel(layer_ref, x_ref, codes_ref, sm_ref, palette_ref, esc_rows_ref, esc_exp_ref, out_ref, *,
                   block_k: int, capacity: int):
    n, layer = pl.program_id(0), layer_ref[0]
    decode = functools.partial(_decode_half, block_k=block_k, capacity=capacity)

    def body(kb, accs):
        codes, sms = _tile_parts(codes_ref, sm_ref, layer, kb, n, block_k)
        x = x_ref[:, pl.ds(kb * block_k, block_k)]
        return tuple(acc + lax.dot_general(x, decode(codes, sms[h], palette_ref, esc_rows_ref, esc_exp_ref, layer, kb,
                                                     n, h),
                                           (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
                     for h, acc in enumerate(accs))

    rows = x_ref.shape[0]
    zeros = jnp.zeros((rows, HALF), jnp.float32)
    lo, hi = lax.fori_loop(0, codes_ref.shape[1] // block_k, body, (zeros, zeros))
    out_ref[:, pl.ds(0, HALF)] = lo
    out_ref[:, pl.ds(HALF, HALF)] = hi


def _decode_kernel(codes_ref, sm_ref, palette_ref, esc_rows_ref, esc_exp_ref, out_ref, *, block_k: int, capacity: int):
    """The same tile decode, written out: what the matmul kernel reconstructs, for tests."""
    kb, n = pl.program_id(0), pl.program_id(1)
    codes, sms = _tile_parts(codes_ref, sm_ref, 0, kb, n, block_k)
    for h in (0, 1):
        out_ref[:, pl.ds(h * HALF, HALF)] = _decode_half(codes, sms[h], palette_ref, esc_rows_ref, esc_exp_ref,
                                                         0, kb, n, h, block_k=block_k, capacity=capacity)


def _stacked(codes, sm, palette, esc_rows, esc_exp, block_k: int) -> tuple[Array, ...]:
    """The parts with a leading layer axis (one matrix: a stack of one), their shapes checked."""
    parts = (codes, sm, palette, esc_rows, esc_exp)
    if sm.ndim == 2:
        parts = tuple(a[None] for a in parts)
    codes, sm, palette, esc_rows, esc_exp = parts
    layers, k, n = sm.shape
    if n % TILE_N or k % block_k or codes.shape != (layers, k, n // 2) or palette.shape != (layers, 16):
        raise ValueError(f"palette matmul needs K % {block_k} == 0, N % {TILE_N} == 0, codes [K, N/2] and a "
                         f"palette of 16 (per layer); got sm {sm.shape}, codes {codes.shape}, palette {palette.shape}")
    if esc_rows.shape[:3] != (layers, k // block_k, n // TILE_N) or esc_exp.shape != (*esc_rows.shape, TILE_N):
        raise ValueError(f"escape lists {esc_rows.shape} / {esc_exp.shape} are not per ({block_k} x {TILE_N}) tile")
    return parts


@lowered_once("block_k", "interpret")
def palette_matmul(x: Float[Array, "T K"], codes: UInt8[Array, "*L K N2"], sm: UInt8[Array, "*L K N"],
                   palette: UInt8[Array, "*L 16"], esc_rows: Int32[Array, "*L Kb Nb C"],
                   esc_exp: UInt8[Array, "*L Kb Nb C 64"], layer: Int32[Array, ""] | int = 0, *, block_k: int = 64,
                   interpret: bool = False) -> Float[Array, "T N"]:
    """x @ W in float32, W (layer `layer` of a stack) decoded tile by tile on chip (x is cast to bfloat16)."""
    parts = _stacked(codes, sm, palette, esc_rows, esc_exp, block_k)
    t, n = x.shape[0], parts[1].shape[2]
    if t > MAX_ROWS:
        raise ValueError(f"palette_matmul takes at most {MAX_ROWS} rows, got {t}")
    rows = max(MIN_ROWS, next_power_of_2(t))
    xp = jnp.pad(x.astype(jnp.bfloat16), ((0, rows - t), (0, 0)))
    whole = pl.BlockSpec()
    out = pl.pallas_call(
        functools.partial(_matmul_kernel, block_k=block_k, capacity=parts[3].shape[-1]),
        grid=(n // TILE_N,),
        in_specs=[whole] * 7,
        out_specs=pl.BlockSpec((rows, TILE_N), lambda n: (0, n)),
        out_shape=jax.ShapeDtypeStruct((rows, n), jnp.float32),
        compiler_params=compiler_params(num_warps=4, num_stages=2),
        interpret=interpret,
        name="palette_matmul",
    )(jnp.asarray(layer, jnp.int32).reshape(1), xp, *parts)
    return out[:t]


def palette_decode(codes: UInt8[Array, "K N2"], sm: UInt8[Array, "K N"], palette: UInt8[Array, "16"],
                   esc_rows: Int32[Array, "Kb Nb C"], esc_exp: UInt8[Array, "Kb Nb C 64"], *, block_k: int = 64,
                   interpret: bool = False) -> Array:
    """W itself, decoded by the matmul kernel's tile decoder (to check what it reconstructs)."""
    if sm.ndim != 2:
        raise ValueError(f"palette_decode decodes one matrix [K, N], got sm {sm.shape}")
    parts = _stacked(codes, sm, palette, esc_rows, esc_exp, block_k)
    whole = pl.BlockSpec()
    return pl.pallas_call(
        functools.partial(_decode_kernel, block_k=block_k, capacity=esc_rows.shape[-1]),
        grid=(sm.shape[0] // block_k, sm.shape[1] // TILE_N),
        in_specs=[whole] * 5,
        out_specs=pl.BlockSpec((block_k, TILE_N), lambda k, n: (k, n)),
        out_shape=jax.ShapeDtypeStruct(sm.shape, jnp.bfloat16),
        compiler_params=compiler_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="palette_decode",
    )(*parts)
