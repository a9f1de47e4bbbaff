"""The palette format laid out for the GPU matmul kernel (pallas_kernels/palette_matmul.py).

The same palette code, with escape lists per (block_k x 64) tile instead of per shard (the grid
of `encode_palette`), and the two codes of a byte taken from columns j and j + 32 of a 64-column
group instead of neighbours, so the kernel decodes each half of a tile with no interleave.
"""

from __future__ import annotations

import numpy as np
from jaxtyping import Shaped

from infire_jax.compression.palette import ROW, encode_palette


def encode_tiles(w: Shaped[np.ndarray, "K N"], block_k: int = 64) -> dict[str, np.ndarray]:
    """codes, sm, palette, esc_rows, esc_exp of a bfloat16 matrix, as `palette_matmul` takes them."""
    k, n = w.shape
    if k % block_k or n % ROW:
        raise ValueError(f"a {w.shape} matrix does not split into {block_k} x {ROW} tiles")
    t = encode_palette(w, stacked=False, grid=(k // block_k, n // ROW))
    codes = np.stack([t.codes & 0xF, t.codes >> 4], axis=-1).reshape(k, n // ROW, 2, ROW // 2)
    halves = (codes[:, :, 0] | (codes[:, :, 1] << 4)).astype(np.uint8)
    return {"codes": halves.reshape(k, n // 2), "sm": t.sign_mantissa, "palette": t.palette[0],
            "esc_rows": t.esc_rows, "esc_exp": t.esc_exp}
