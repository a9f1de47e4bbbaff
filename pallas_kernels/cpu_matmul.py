"""The CPU matmuls of the layer weights and the LM head: C++ XLA FFI calls that read the weights in place.

XLA CPU's dot reaches 8-14 GB/s on a decode step's [T <= 16, K] x [K, N] products, a third of
what the machine streams, and those products are most of a small model's step; on bfloat16 it
converts the weights to float32 first. `csrc/skinny_matmul.cc` reads the layer's slice of the
stacked weight in place (the call takes the whole stack and the layer index, so the scan makes no
copy of the slice) on XLA's own thread pool:

- float32 activations: decode steps (at most MAX_ROWS tokens), float32 or bfloat16 weights;
- bfloat16 activations and weights on a CPU with AVX512-BF16 (`cpu_kernels.bf16_dot()`): steps of any size,
  prefill included, with `vdpbf16ps` (exact bfloat16 products summed in pairs into float32);
- weights repacked once into panels (`pack_panels`, done by the model runner, `models/panels.py`),
  float32 or (with AVX512-BF16) bfloat16, at any step size: each 32-column panel is one contiguous
  run, which streams near the machine's bandwidth where the row-major slice's strided reads do not,
  and register tiles of up to 12 rows beat XLA's float32 dot on prompts too;
- bfloat16 panels kept palette-compressed (lossless, 12 bits a weight; `palette_matmul`,
  `csrc/palette_matmul.cc`), decoded in registers on the way into `vdpbf16ps`;
- GGUF Q4_1 weights kept quantized (5 bits a weight; `q4_1_matmul`, `csrc/q4_1_matmul.cc`), decode
  steps, dequantized in registers on the way into float32 FMAs;
- on a CPU with AMX, bfloat16 panels of steps of 2 or more tokens through oneDNN's tile kernels
  (`cpu_onednn`), which read the panels in place as its blocked weight format.

`cpu_kernels` builds the library; without it the models keep XLA's dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, UInt8

from pallas_kernels import cpu_kernels, cpu_onednn

TARGET = "infire_skinny_matmul"
HEAD_TARGET = "infire_skinny_matmul_nt"
PANEL_TARGET = "infire_skinny_matmul_panels"
PANEL = 32  # columns per panel
MAX_ROWS = 16  # decode-sized steps: measured up to 16 rows (docs/PERFORMANCE.md); larger float32 steps keep XLA's dot


def _bf16_dot_applies(x_dtype, weight: Array) -> bool:
    return (x_dtype == jnp.bfloat16 and weight.dtype == jnp.bfloat16 and weight.shape[-2] % 2 == 0
            and weight.shape[-1] % 32 == 0 and cpu_kernels.bf16_dot())


def applies(rows: int, weight: Array) -> bool:
    """Whether a [rows, K] x weight product, with activations in the weight's dtype, takes the FFI
    call (decided at trace time): bfloat16 on an AVX512-BF16 CPU at any size; otherwise steps of at
    most MAX_ROWS tokens."""
    if weight.dtype not in (jnp.float32, jnp.bfloat16) or not cpu_kernels.chosen():
        return False
    if _bf16_dot_applies(weight.dtype, weight):
        return True
    return rows <= MAX_ROWS and weight.shape[-2] % 4 == 0 and weight.shape[-1] % 16 == 0


def skinny_matmul(x: Float[Array, "M K"], stacked: Float[Array, "L K N"],
                  layer: Int[Array, ""]) -> Float[Array, "M N"]:
    """x @ stacked[layer] in float32, reading the layer's float32 or bfloat16 weights in place:
    bfloat16 x and weights through `vdpbf16ps` where `applies` says so, else x as float32
    (M <= MAX_ROWS for speed; any M is computed correctly)."""
    m, k = x.shape
    if stacked.shape[1] != k:
        raise ValueError(f"x has {k} features but the weight's layers are {stacked.shape[1:]}")
    cpu_kernels.require()
    out = jax.ShapeDtypeStruct((m, stacked.shape[2]), jnp.float32)
    x = x if _bf16_dot_applies(x.dtype, stacked) else x.astype(jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x, stacked, layer.astype(jnp.int32))


def panel_kernel(dtype) -> bool:
    """Whether `panel_matmul` runs here on `dtype` panels: the CPU backend with the library, and
    for bfloat16 its `vdpbf16ps` dot."""
    return cpu_kernels.wide_chosen() and (dtype == jnp.float32 or (dtype == jnp.bfloat16 and cpu_kernels.bf16_dot()))


def panels_apply(weight: Array | jax.ShapeDtypeStruct) -> bool:
    """Whether a stacked [L, K, N] weight can be kept as panels: float32, or bfloat16 with K even,
    N a multiple of PANEL, where `panel_kernel`."""
    return (weight.ndim == 3 and weight.dtype in (jnp.float32, jnp.bfloat16) and weight.shape[1] % 2 == 0
            and weight.shape[2] % PANEL == 0 and panel_kernel(weight.dtype))


def pack_panels(w: Float[Array, "L K N"]) -> Float[Array, "L P K2 64"] | Float[Array, "L P K 32"]:
    """[L, K, N] -> panels, panel p holding columns [32p, 32p + 32) as one contiguous run:
    - bfloat16: [L, N / 32, K / 2, 64], K / 2 runs of (columns 0-15, columns 16-31), each entry the
      pair (w[k, n], w[k + 1, n]) that `vdpbf16ps` takes;
    - float32: [L, N / 32, K, 32], row k of the panel's columns."""
    n_layers, k, n = w.shape
    if w.dtype == jnp.float32:
        return w.reshape(n_layers, k, n // PANEL, PANEL).transpose(0, 2, 1, 3)
    six = w.reshape(n_layers, k // 2, 2, n // PANEL, 2, 16)  # (l, j, i, p, v, lane): k = 2j + i, n = 32p + 16v + lane
    return six.transpose(0, 3, 1, 4, 5, 2).reshape(n_layers, n // PANEL, k // 2, 2 * PANEL)


def unpack_panels(panels: Array) -> Float[Array, "... K N"]:
    """The inverse of `pack_panels`, for one layer or a stack."""
    *lead, p, rows, width = panels.shape
    r = len(lead)
    if panels.dtype == jnp.float32:
        return jnp.swapaxes(panels, r, r + 1).reshape(*lead, rows, PANEL * p)
    six = panels.reshape(*lead, p, rows, 2, 16, 2)  # (..., p, j, v, lane, i)
    perm = (*range(r), r + 1, r + 4, r, r + 2, r + 3)  # -> (..., j, i, p, v, lane)
    return six.transpose(perm).reshape(*lead, 2 * rows, PANEL * p)


def panel_matmul(x: Float[Array, "M K"], panels: Array, layer: Int[Array, ""]) -> Float[Array, "M N"]:
    """x @ w[layer] in float32 for x and a stack of panels (`pack_panels`) of the same dtype, read in place:
    bfloat16 steps through oneDNN's AMX kernels where `cpu_onednn.takes` them, else the library's kernel."""
    if x.dtype != panels.dtype or x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"panel_matmul takes x and panels both bfloat16 or both float32, got {x.dtype} and "
                         f"{panels.dtype}")
    k = panels.shape[2] * (2 if panels.dtype == jnp.bfloat16 else 1)
    if k != x.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features but the panels hold {k}")
    if cpu_onednn.takes(x.shape[0], panels):
        return cpu_onednn.panel_matmul(x, panels, layer)
    cpu_kernels.require()
    out = jax.ShapeDtypeStruct((x.shape[0], PANEL * panels.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(PANEL_TARGET, out)(x, panels, layer.astype(jnp.int32))


def head_applies(rows: int, head: Array) -> bool:
    """Whether the LM head product takes the FFI call: steps of at most MAX_ROWS rows. XLA CPU
    converts the whole bfloat16 head to float32 every step (25 ms of a 70 ms step here); on a
    float32 head it matches the call at one row and falls behind at 8 (docs/PERFORMANCE.md)."""
    return (rows <= MAX_ROWS and head.dtype in (jnp.float32, jnp.bfloat16) and head.ndim == 2
            and head.shape[1] % 16 == 0 and cpu_kernels.wide_chosen())


def head_matmul(x: Float[Array, "M E"], head: Float[Array, "V E"]) -> Float[Array, "M V"]:
    """x @ head.T in float32, `head` in the embedding's [V, E] layout, read in place; M <= MAX_ROWS.
    bfloat16 x takes `vdpbf16ps` where the CPU has it."""
    if head.shape[1] != x.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features but the head is {head.shape}")
    cpu_kernels.require()
    out = jax.ShapeDtypeStruct((x.shape[0], head.shape[0]), jnp.float32)
    x = x if x.dtype == jnp.bfloat16 and head.shape[1] % 32 == 0 and cpu_kernels.bf16_dot() else x.astype(jnp.float32)
    return jax.ffi.ffi_call(HEAD_TARGET, out)(x, head)


PALETTE_TARGET = "infire_palette_matmul"
# The order `palette_matmul` stores each 64-entry panel run in: stored byte q holds entry
# PALETTE_ORDER[q], so that interleaving bytes per 128-bit lane (vpunpcklbw / vpunpckhbw) gives the
# run's two vectors of bfloat16 in the panel's order.
PALETTE_ORDER = np.array([8 * (q // 16) + q % 16 if q % 16 < 8 else 32 + 8 * (q // 16) + q % 16 - 8
                          for q in range(64)], np.int32)


def palette_kernel() -> bool:
    """Whether `palette_matmul` runs here: the CPU backend with the library's AVX512-BF16 dot."""
    return panel_kernel(jnp.bfloat16)


def palette_matmul(x: Float[Array, "M K"], codes: UInt8[Array, "L P R 32"], sign_mantissa: UInt8[Array, "L P R 64"],
                   palette: UInt8[Array, "L 16"], esc_rows: Int[Array, "L P ..."], esc_exp: UInt8[Array, "L P ..."],
                   layer: Int[Array, ""]) -> Float[Array, "M N"]:
    """x @ w[layer] in float32 for bfloat16 x and w kept palette-compressed in the bfloat16 panel
    layout (`pack_panels`, each run's entries in `PALETTE_ORDER`; the format is described in
    csrc/palette_matmul.cc), decoded in registers: bitwise what the library's panel kernel gives on the
    panels."""
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"palette_matmul takes bfloat16 x, got {x.dtype}")
    if codes.ndim != 4 or x.shape[1] != 2 * codes.shape[2]:
        raise ValueError(f"x has {x.shape[1]} features but the codes {codes.shape} hold {2 * codes.shape[2]}")
    cpu_kernels.require()
    out = jax.ShapeDtypeStruct((x.shape[0], PANEL * codes.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(PALETTE_TARGET, out)(x, codes, sign_mantissa, palette, esc_rows.astype(jnp.int32),
                                                 esc_exp, layer.astype(jnp.int32))


Q4_1_TARGET = "infire_q4_1_matmul"


def q4_1_kernel() -> bool:
    """Whether `q4_1_matmul` runs here: the CPU backend with the library built for AVX-512."""
    return cpu_kernels.on_cpu() and cpu_kernels.avx512()


def q4_1_matmul(x: Float[Array, "M K"], q: UInt8[Array, "L K2 N"], d: Float[Array, "L Kb N"],
                m: Float[Array, "L Kb N"], layer: Int[Array, ""]) -> Float[Array, "M N"]:
    """x @ w[layer] in float32 for w kept as GGUF Q4_1 blocks along its input axis (q: in block b,
    byte 16 b + e holds input 32 b + e in its low nibble and 32 b + 16 + e in its high one; d and m
    float16, one per block and column), read in place and dequantized in registers: w = d * q + m,
    bitwise the layer-body dequantizer's weights (quant/gguf_blocks.py). For decode steps (M <=
    MAX_ROWS), where it streams 5 bits a weight; x is taken as float32."""
    k = x.shape[1]
    if q.ndim != 3 or k != 2 * q.shape[1] or k % 32 or q.shape[2] % 16 or d.shape != (q.shape[0], k // 32, q.shape[2]) \
            or m.shape != d.shape or d.dtype != jnp.float16 or m.dtype != jnp.float16:
        raise ValueError(f"q4_1_matmul: x {x.shape} needs q [L, K / 2, N] (K a multiple of 32, N of 16) and float16 "
                         f"d, m [L, K / 32, N]; got q {q.shape}, d {d.shape} {d.dtype}, m {m.shape} {m.dtype}")
    cpu_kernels.require()
    out = jax.ShapeDtypeStruct((x.shape[0], q.shape[2]), jnp.float32)
    return jax.ffi.ffi_call(Q4_1_TARGET, out)(x.astype(jnp.float32), q, d, m, layer.astype(jnp.int32))
