"""MXFP4 weights (OCP microscaling, as gpt-oss checkpoints store their experts) -> bfloat16.

A weight's rows are cut into blocks of 32 values along its input axis: `*_blocks` holds each block as
16 bytes, two e2m1 values a byte (the low nibble first), and `*_scales` one e8m0 byte per block, the
power of two 2^(s - 127) that multiplies the block. Every such value is exact in bfloat16 (one
mantissa bit, and bfloat16's exponent range), so dequantizing to it loses nothing and takes half
float32's memory; the model casts to its dtype when it places the weight.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from infire_jax.errors import UnsupportedModelError

# e2m1 codes 0..15: sign bit, 2 exponent bits, 1 mantissa bit.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)


def dequantize_rows(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., G, B], scales uint8 [..., G] -> bfloat16 [..., G * 2B]: each row's values in order."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
        raise UnsupportedModelError(f"MXFP4 blocks {blocks.dtype}{list(blocks.shape)} and scales "
                                    f"{scales.dtype}{list(scales.shape)}: expected uint8 [..., G, B] and [..., G]")
    values = np.stack([E2M1_VALUES[blocks & 0x0F], E2M1_VALUES[blocks >> 4]], axis=-1)
    values = values.reshape(*blocks.shape[:-1], 2 * blocks.shape[-1])
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.astype(ml_dtypes.bfloat16).reshape(*blocks.shape[:-2], -1)


def dequantize_experts(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A stack of expert weights, blocks [X, R, G, B] and scales [X, R, G] (R output rows, G * 2B inputs),
    as transformers' `convert_moe_packed_tensors` gives them: [X, G * 2B, R], inputs first. One expert
    at a time, so the float32 temporaries are one expert's."""
    if blocks.ndim != 4:
        raise UnsupportedModelError(f"MXFP4 expert blocks must be [experts, rows, groups, bytes], got {blocks.shape}")
    return np.stack([dequantize_rows(b, s).T for b, s in zip(blocks, scales)])
