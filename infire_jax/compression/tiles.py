"""The palette format laid out for the GPU matmul kernel (pallas_kernels/palette_matmul.py).

The same palette code, with escape lists per (block_k x 64) tile instead of per shard (the grid
of `encode_palette`), and the two codes of a byte taken from columns j and j + 32 of a 64-column
group instead of neighbours, so the kernel decodes each half of a tile with no interleave.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int32, Shaped, UInt8

from infire_jax.compression.palette import ROW, PaletteTensor, encode_palette, merge_device


def _halves(codes: np.ndarray) -> np.ndarray:
    """Neighbour-packed codes [..., N / 2] -> a byte per column pair (j, j + 32) of each 64-column group."""
    *lead, half = codes.shape
    pairs = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*lead, half // (ROW // 2), 2, ROW // 2)
    return (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).astype(np.uint8).reshape(*lead, half)


def encode_tile_stack(w: Shaped[np.ndarray, "L K N"], block_k: int = 64, name: str = "tensor") -> PaletteTensor:
    """A bfloat16 stack coded for the kernel: a palette per layer, escape lists per layer and tile."""
    layers, k, n = w.shape
    if k % block_k or n % ROW:
        raise ValueError(f"{name}: a {w.shape[1:]} matrix does not split into {block_k} x {ROW} tiles")
    t = encode_palette(w, stacked=True, grid=(layers, k // block_k, n // ROW), name=name)
    return dataclasses.replace(t, codes=_halves(t.codes))


def encode_tiles(w: Shaped[np.ndarray, "K N"], block_k: int = 64) -> dict[str, np.ndarray]:
    """codes, sm, palette, esc_rows, esc_exp of a bfloat16 matrix, as `palette_matmul` takes them."""
    t = encode_tile_stack(w[None], block_k)
    return {"codes": t.codes[0], "sm": t.sign_mantissa[0], "palette": t.palette[0], "esc_rows": t.esc_rows[0],
            "esc_exp": t.esc_exp[0]}


def decode_tiles(codes: UInt8[Array, "K N2"], sm: UInt8[Array, "K N"], palette: UInt8[Array, "16"],
                 esc_rows: Int32[Array, "Kb Nb C"], esc_exp: UInt8[Array, "Kb Nb C 64"]) -> Shaped[Array, "K N"]:
    """One matrix of `encode_tile_stack` decoded on the device with jnp (for steps the kernel does not
    take): the palette gathered, each tile's escape rows scattered in (sentinels dropped)."""
    k, n = sm.shape
    kb, nb = esc_rows.shape[:2]
    pairs = codes.reshape(k, n // ROW, ROW // 2)
    exponent = jnp.take(palette, jnp.concatenate([pairs & 0xF, pairs >> 4], axis=-1).astype(jnp.int32), mode="clip")
    tiles = exponent.reshape(kb, k // kb, nb, ROW).transpose(0, 2, 1, 3)  # [Kb, Nb, block_k, 64]
    tiles = tiles.at[jnp.arange(kb)[:, None, None], jnp.arange(nb)[None, :, None], esc_rows].set(esc_exp, mode="drop")
    return merge_device(tiles.transpose(0, 2, 1, 3).reshape(k, n), sm)
