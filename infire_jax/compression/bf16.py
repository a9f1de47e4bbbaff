"""The split of a BF16 weight into its exponent byte and its sign+mantissa byte, and back.

BF16 is `s eeeeeeee mmmmmmm`. Trained weights use few exponents (about 2.6 bits of entropy), while
sign and mantissa are close to uniform, so only the exponent is worth coding; the other byte is
stored as it is. Both halves are plain uint8 arrays of the weight's shape.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
from jaxtyping import Shaped, UInt8

BF16 = np.dtype(ml_dtypes.bfloat16)


def as_bf16(x: np.ndarray) -> np.ndarray:
    """`x` as a bfloat16 array (rounded to nearest even from a wider float: the exponent is kept)."""
    x = np.asarray(x)
    if x.dtype == BF16:
        return x
    if x.dtype.kind != "f" and x.dtype != BF16:
        raise TypeError(f"expected a floating-point array, got {x.dtype}")
    return x.astype(BF16)


def split_bf16(x: Shaped[np.ndarray, "..."]) -> tuple[UInt8[np.ndarray, "..."], UInt8[np.ndarray, "..."]]:
    """(exponent, sign_mantissa) bytes of a bfloat16 array: bits 14..7, and bit 15 with bits 6..0."""
    if x.dtype != BF16:
        raise TypeError(f"split_bf16 takes a bfloat16 array, got {x.dtype}")
    bits = np.ascontiguousarray(x).view(np.uint16)
    exponent = ((bits >> 7) & 0xFF).astype(np.uint8)
    sign_mantissa = (((bits >> 8) & 0x80) | (bits & 0x7F)).astype(np.uint8)
    return exponent, sign_mantissa


def merge_bf16(exponent: UInt8[np.ndarray, "..."], sign_mantissa: UInt8[np.ndarray, "..."]) -> np.ndarray:
    """The bfloat16 array whose halves are `exponent` and `sign_mantissa` (the inverse of split_bf16)."""
    if exponent.shape != sign_mantissa.shape:
        raise ValueError(f"exponent {exponent.shape} and sign_mantissa {sign_mantissa.shape} differ in shape")
    e = exponent.astype(np.uint16)
    sm = sign_mantissa.astype(np.uint16)
    return (((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)).astype(np.uint16).view(BF16)
