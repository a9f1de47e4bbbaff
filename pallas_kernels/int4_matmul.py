"""Pallas (Triton) matmul that reads compressed-tensors int4 weights and dequantizes them on chip.

`y = x @ W.T` for W [N, K] stored as Kimi ships it (infire_jax/quant/formats.py `Int4Group`):
`packed` int32 [N, K/8] with weight `8j + i` of a row in bits 4i..4i+3 of word j (stored q + 8),
`scale` [N, K/32], `w = q * scale`. Grid: one program per 64 output rows. A program walks K in
blocks of `block_k`; per block it loads the words and the scales of its rows, and for each nibble
plane i (the weights 8j + i) subtracts 8, multiplies by the scale of each weight's group (selected
from the block's few scales, no gather) and feeds the plane to a dot against the matching columns
of x. x is split into those planes once, outside the kernel, so the weights are never interleaved
on chip and never exist dequantized in HBM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int32, Shaped

from pallas_kernels.triton_backend import compiler_params, next_power_of_2

TILE_N = 64  # output rows (weight rows) per program
GROUP = 32  # weights per scale
MIN_ROWS = 16  # Triton's smallest dot tile


def _kernel(x_ref, packed_ref, scale_ref, out_ref, *, block_k: int):
    n = pl.program_id(0)
    words, groups = block_k // 8, block_k // GROUP
    rows = pl.ds(n * TILE_N, TILE_N)
    group_of_word = lax.broadcasted_iota(jnp.int32, (TILE_N, words), 1) // (GROUP // 8)

    def body(kb, acc):
        packed = packed_ref[rows, pl.ds(kb * words, words)]
        scales = scale_ref[rows, pl.ds(kb * groups, groups)].astype(jnp.float32)
        scale = jnp.zeros((TILE_N, words), jnp.float32)
        for g in range(groups):  # each word's group scale, by selects
            scale = jnp.where(group_of_word == g, scales[:, g:g + 1], scale)
        for i in range(8):
            w = ((((packed >> (4 * i)) & 0xF) - 8).astype(jnp.float32) * scale).astype(x_ref.dtype)
            x = x_ref[i, :, pl.ds(kb * words, words)]
            acc = acc + lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc

    acc = jnp.zeros((x_ref.shape[1], TILE_N), jnp.float32)
    out_ref[...] = lax.fori_loop(0, packed_ref.shape[1] // words, body, acc)


def int4_matmul(x: Float[Array, "T K"], packed: Int32[Array, "N K8"], scale: Shaped[Array, "N K32"], *,
                block_k: int = 128, interpret: bool = False) -> Float[Array, "T N"]:
    """x @ dequantize(W).T in float32 accumulation, W dequantized tile by tile on chip."""
    t, k = x.shape
    n = packed.shape[0]
    if block_k % GROUP or k % block_k or n % TILE_N:
        raise ValueError(f"int4 matmul needs K % block_k == 0 (block_k a multiple of {GROUP}) and N % {TILE_N} == 0; "
                         f"got x {x.shape}, weight_packed {packed.shape}, block_k {block_k}")
    if packed.shape != (n, k // 8) or scale.shape != (n, k // GROUP):
        raise ValueError(f"weight_packed {packed.shape} / weight_scale {scale.shape} do not fit K={k} "
                         f"(expected [N, K/8] and [N, K/{GROUP}])")
    rows = max(MIN_ROWS, next_power_of_2(t))
    planes = jnp.pad(x, ((0, rows - t), (0, 0))).reshape(rows, k // 8, 8).transpose(2, 0, 1)  # [8, rows, K/8]
    whole = pl.BlockSpec()
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k),
        grid=(n // TILE_N,),
        in_specs=[whole] * 3,
        out_specs=pl.BlockSpec((rows, TILE_N), lambda i: (0, i)),
        out_shape=jax.ShapeDtypeStruct((rows, n), jnp.float32),
        compiler_params=compiler_params(num_warps=4, num_stages=2),
        interpret=interpret,
        name="int4_matmul",
    )(planes, packed, scale)
    return out[:t]
