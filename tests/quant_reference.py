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


def reference_rtn(w: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """AutoGPTQ's asymmetric round to nearest (`Quantizer.find_params`, the scale stored in float16):
    per-input codes, zeros and float16 scales `[O, I]` of `w [O, I]`, one group at a time in float64."""
    out, inp = w.shape
    q, zero, scale = np.zeros((out, inp)), np.zeros((out, inp)), np.zeros((out, inp), np.float16)
    for start in range(0, inp, group):
        cols = slice(start, min(start + group, inp))
        x = w[:, cols].astype(np.float64)
        lo, hi = np.minimum(x.min(axis=1), 0.0), np.maximum(x.max(axis=1), 0.0)
        empty = (lo == 0) & (hi == 0)
        lo, hi = np.where(empty, -1.0, lo), np.where(empty, 1.0, hi)
        s = np.maximum(((hi - lo) / 15).astype(np.float16), np.float16(2.0 ** -24))
        z = np.clip(np.round(-lo / s.astype(np.float64)), 0, 15)
        q[:, cols] = np.clip(np.round(x / s.astype(np.float64)[:, None]) + z[:, None], 0, 15)
        zero[:, cols], scale[:, cols] = z[:, None], s[:, None]
    return q, zero, scale


def attend_to_e4m3(modeling, config, kv_scales, monkeypatch, pool_layer=lambda layer: layer) -> None:
    """Makes an HF model (its `modeling` module, its attention's `config`) attend to its keys and values as
    an fp8 pool holds them (pallas_kernels/kv_quant.py): each (layer, kv head)'s `x / scale`, saturated to
    +-448 and rounded to e4m3, times the scale. `kv_scales` [pool layers, 2, Hkv]: the engine's
    [k_scale, v_scale]; `pool_layer`: an HF layer's index in the pool."""
    import torch

    scales = torch.from_numpy(np.asarray(kv_scales, np.float32))
    eager = modeling.eager_attention_forward

    def e4m3(x, scale):
        s = scale[None, :, None, None]
        return torch.clamp(x / s, -448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype) * s

    def attention(module, query, key, value, *args, **kwargs):
        k_scale, v_scale = scales[pool_layer(module.layer_idx)]
        return eager(module, query, e4m3(key, k_scale), e4m3(value, v_scale), *args, **kwargs)

    monkeypatch.setattr(modeling, "eager_attention_forward", attention)
    config._attn_implementation = "eager"
