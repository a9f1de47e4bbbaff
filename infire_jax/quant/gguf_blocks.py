"""GGUF's Q4_1 and Q8_0 blocks, split into device arrays and dequantized along any axis.

A GGUF row is a run of 32-weight blocks along the input axis. Q4_1 (20 bytes): fp16 scale `d`,
fp16 min `m`, 16 bytes of 4-bit quants, element `i` of the block in the low nibble of byte `i` and
element `i + 16` in its high nibble; `w = d * q + m`. Q8_0 (34 bytes): fp16 `d`, 32 int8 quants,
`w = d * q`. The split keeps the bytes as they are (`q4_1`: the packed nibbles, `q8_0`: the int8
quants, `d`/`m`: float16), one array each, so every part can take the weight's own logical axes
with the block axis shortened, and shards like it.

Both dequantizers are bit-exact against `gguf.quants.dequantize` in float32: `d * q` is exact in
float32 (11 + 8 significant bits), so only the `+ m` rounds, once, with or without a fused
multiply-add.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Shaped, UInt8

QK = 32  # weights per GGUF block (Q4_0/Q4_1/Q8_0)
_SHIFTS = np.array([0, 4], np.uint8)  # low nibbles hold a block's first 16 weights
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}
QUANT_PART = {"Q4_1": "q4_1", "Q8_0": "q8_0"}  # the part holding the quants names the format


def split_blocks(raw: UInt8[np.ndarray, "R B"], kind: str, row_len: int) -> dict[str, np.ndarray]:
    """A GGUF tensor's raw rows `[rows, blocks * bytes]` -> its parts, each `[rows, ...]`.

    `q4_1`: uint8 `[rows, row_len / 2]`; `q8_0`: int8 `[rows, row_len]`; `d`, `m`: float16 `[rows, row_len / 32]`.
    """
    if kind not in BLOCK_BYTES:
        raise ValueError(f"GGUF type {kind} is not kept quantized; supported: {sorted(BLOCK_BYTES)}")
    if row_len % QK or raw.shape[-1] != row_len // QK * BLOCK_BYTES[kind]:
        raise ValueError(f"{kind} rows of {row_len} weights need {row_len // QK * BLOCK_BYTES[kind]} bytes "
                         f"in whole {QK}-weight blocks, got {raw.shape[-1]}")
    blocks = np.ascontiguousarray(raw).reshape(raw.shape[0], row_len // QK, BLOCK_BYTES[kind])
    parts = {"d": np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]}
    if kind == "Q4_1":
        parts["m"] = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
        parts["q4_1"] = blocks[..., 4:].reshape(raw.shape[0], row_len // 2)
    else:
        parts["q8_0"] = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(raw.shape[0], row_len)
    return parts


def dequantize_blocks(parts: dict[str, Shaped[Array, "..."]], axis: int, dtype=jnp.float32) -> Float[Array, "..."]:
    """The weight the parts define; `axis` is the block axis (the weight's input axis) in the result.

    Device code, branch-free and transpose-free: the block axis is split in place into
    (blocks, 1, bytes) and shifted by (0, 4) along the new axis (low nibbles first), then one
    multiply and one add per weight with the block's scales broadcast, so XLA fuses it into one pass.
    A concatenation of the two nibble halves instead ran 7x slower inside the layer scan on XLA:CPU.
    """
    d = parts["d"]
    axis = axis % d.ndim
    nb = d.shape[axis]

    def split(a):  # [..., n * nb, ...] -> [..., nb, n, ...]
        return a.reshape(*a.shape[:axis], nb, a.shape[axis] // nb, *a.shape[axis + 1:])

    def scale(s):
        return jnp.expand_dims(s.astype(jnp.float32), axis + 1)

    if "q4_1" in parts:
        qs = jnp.expand_dims(split(parts["q4_1"]), axis + 1)  # [..., nb, 1, 16, ...]
        shifts = jnp.asarray(_SHIFTS).reshape(2, *[1] * (qs.ndim - axis - 2))
        q = ((qs >> shifts) & 0xF).astype(jnp.float32)  # [..., nb, 2, 16, ...]
        q = q.reshape(*q.shape[:axis + 1], QK, *q.shape[axis + 3:])
        w = scale(d) * q + scale(parts["m"])
    elif "q8_0" in parts:
        w = scale(d) * split(parts["q8_0"]).astype(jnp.float32)
    else:
        raise ValueError(f"GGUF block parts {sorted(parts)} hold neither q4_1 nor q8_0 quants")
    return w.reshape(*w.shape[:axis], nb * QK, *w.shape[axis + 2:]).astype(dtype)
