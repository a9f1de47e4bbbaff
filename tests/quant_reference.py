"""The quantization formats' published definitions, written out in float64 numpy, element by element
where the definition is one, independent of infire_jax.quant (which is checked against these)."""

from __future__ import annotations

import numpy as np


def int4_pack_quantized(packed: np.ndarray, scale: np.ndarray, shape: tuple[int, int], group: int) -> np.ndarray:
    """compressed-tensors `unpack_from_int32` (packed_dim=1, num_bits=4) then `q * scale` (zero point 0)."""
    out, inp = shape
    words = packed.astype(np.int64) & 0xFFFFFFFF
    q = np.zeros((out, inp), np.float64)
    for i in range(8):  # unpacked[:, i::8] = (value >> 4i) & 15, then minus 2**4 // 2
        q[:, i::8] = ((words >> (4 * i)) & 0xF) - 8
    return q * np.repeat(scale.astype(np.float64), group, axis=1)


def e4m3fn_value(byte: int) -> float:
    """OCP float8 E4M3FN: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return float("nan")
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def fp8_block(weight_bytes: np.ndarray, scale_inv: np.ndarray, block: int) -> np.ndarray:
    """DeepSeek-V3 `weight_dequant`: fp8 value times the scale of its 128 x 128 block."""
    table = np.array([e4m3fn_value(b) for b in range(256)])
    out, inp = weight_bytes.shape
    rows, cols = np.arange(out) // block, np.arange(inp) // block
    return table[weight_bytes] * scale_inv.astype(np.float64)[rows][:, cols]


def int8_channel(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float64) * scale.astype(np.float64)
