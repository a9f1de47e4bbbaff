"""MXFP4, the OCP microscaling format of gpt-oss's expert weights, as published and as the engine keeps it.

A gpt-oss checkpoint stores each expert weight `[experts, out, in]` as two tensors:
- `*_blocks` uint8 `[experts, out, in / 32, 16]`: a block of 32 consecutive inputs, byte j holding
  input 2j in its low nibble and 2j + 1 in its high one, each an e2m1 FP4 code (`FP4_VALUES`: sign
  bit 3, two exponent bits, one mantissa bit);
- `*_scales` uint8 `[experts, out, in / 32]`: the block's e8m0 scale, 2^(s - 127).
A weight is `FP4_VALUES[code] * 2^(s - 127)`, the exact product rounded once to the serving dtype,
as transformers' dequantizer (integrations/mxfp4.py, `convert_moe_packed_tensors`, torch.ldexp) gives
it: small scales give subnormals, large ones infinity. The product is built as float32 bits from
integers (`_bits`), since XLA:CPU flushes a float product's subnormals to zero.

Kept (quant/grouped.py, kind "mxfp4"), a weight is two parts with the engine weight's logical axes and
its input axis shortened: `fp4` uint8 (the checkpoint's bytes, inputs 2b and 2b + 1 in byte b) and
`scale` uint8 (one e8m0 per 32 inputs). `kept_from_hf` moves a checkpoint's tensors into the engine's
expert layout, w_gate_up [X, E, 2, F] and w_down [X, F, E], as the loader moves float experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Shaped, UInt8

BLOCK = 32  # inputs per e8m0 scale
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def fp4_codes(packed: UInt8[Array, "... B"]) -> UInt8[Array, "... V"]:
    """The e2m1 codes of packed bytes along the last axis, input 2b the low nibble of byte b."""
    pairs = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _bits(codes: Array, scales: Array) -> Array:
    """float32 bits (uint32) of FP4 `codes` times 2^(`scales` - 127), built from integers: the exact
    product rounded once (transformers' torch.ldexp), where XLA:CPU's float product flushes the
    subnormals that scales below 3 give. |value| = c * 2^(s - 129 + max(e, 1)) for the code's
    exponent e and c = mantissa + 2 (e > 0), so 1 or 1.5 times a power of two."""
    codes, s = codes.astype(jnp.int32), scales.astype(jnp.int32)
    e, m = (codes >> 1) & 3, codes & 1
    c = m + 2 * (e > 0)
    k = s - 129 + jnp.maximum(e, 1) + (c >= 2)  # |value| = (1 + half / 2) * 2^k
    half = (c == 3).astype(jnp.int32)
    normal = ((k + 127) << 23) | (half << 22)
    subnormal = (2 + half) << jnp.clip(k + 148, 0, 31)  # k >= -130: at least bit 18
    mag = jnp.where(k > 127, 0x7F800000, jnp.where(k >= -126, normal, subnormal))
    mag = jnp.where(c == 0, 0, mag)
    return (mag | ((codes >> 3) << 31)).astype(jnp.uint32)


def _as(bits: Array, dtype) -> Shaped[Array, "..."]:
    """float32 `bits` in `dtype`: bfloat16 takes the high half (exact: the values hold two significant
    bits, so the low half is zero), float32 the bits; other dtypes round the float32 value."""
    if jnp.dtype(dtype) == jnp.bfloat16:
        return jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), jnp.bfloat16)
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)


def dequantize_blocks(blocks: UInt8[Array, "... G 16"], scales: UInt8[Array, "... G"], dtype=jnp.bfloat16
                      ) -> Shaped[Array, "... I"]:
    """A checkpoint's `*_blocks` and `*_scales` as weights `[..., G * 32]` (the checkpoint's [experts,
    out, in]; transformers returns them transposed to [experts, in, out]) in `dtype`."""
    if blocks.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected blocks [..., G, {BLOCK // 2}] and scales [..., G])")
    codes = fp4_codes(blocks).reshape(*scales.shape, BLOCK)
    bits = _bits(codes, scales[..., None])
    return _as(bits.reshape(*scales.shape[:-1], scales.shape[-1] * BLOCK), dtype)


def dequantize_along(fp4: UInt8[Array, "..."], scale: UInt8[Array, "..."], axis: int, dtype
                     ) -> Shaped[Array, "..."]:
    """Kept parts (inputs along `axis`: bytes of two, scales of 32) as weights in `dtype`, bit for bit
    `dequantize_blocks`'."""
    moved_fp4, moved_scale = jnp.moveaxis(fp4, axis, -1), jnp.moveaxis(scale, axis, -1)
    codes = fp4_codes(moved_fp4)
    groups = moved_scale.shape[-1]
    bits = _bits(codes.reshape(*codes.shape[:-1], groups, BLOCK), moved_scale[..., None])
    return jnp.moveaxis(_as(bits.reshape(codes.shape), dtype), -1, axis)


def _check_hf(name: str, blocks: np.ndarray, scales: np.ndarray) -> tuple[int, int, int]:
    """(experts, out, in) of a checkpoint's MXFP4 expert weight; ValueError naming it otherwise."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim != 4 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"{name}: MXFP4 blocks {blocks.shape} and scales {scales.shape} are not "
                         f"[experts, out, in / 32, 16] and [experts, out, in / 32]")
    x, out, groups = scales.shape
    return x, out, groups * BLOCK


def kept_from_hf(name: str, blocks: UInt8[np.ndarray, "X O G 16"], scales: UInt8[np.ndarray, "X O G"]
                 ) -> dict[str, UInt8[np.ndarray, "..."]]:
    """A checkpoint's expert weight (`name`: "gate_up_proj" or "down_proj"; blocks [X, out, in / 32, 16],
    scales [X, out, in / 32]) as the kept parts {"fp4", "scale"} in the engine's layout: w_gate_up
    [X, E / 2 | E / 32, 2, F] from gpt-oss's gate_up_proj, whose outputs interleave gate (even) and up
    (odd), and w_down [X, F / 2 | F / 32, E]. Host arrays, so the loader places them as they come."""
    if name not in ("gate_up_proj", "down_proj"):
        raise ValueError(f"{name}: not a gpt-oss expert weight (gate_up_proj or down_proj)")
    x, out, inp = _check_hf(name, blocks, scales)
    fp4 = blocks.reshape(x, out, inp // 2).transpose(0, 2, 1)  # [X, in / 2, out]
    scale = scales.transpose(0, 2, 1)  # [X, in / 32, out]
    if name == "gate_up_proj":
        if out % 2:
            raise ValueError(f"{name}: {out} outputs do not interleave gate and up")

        def split(a):  # [..., 2F] gate, up interleaved -> [..., 2, F]
            return a.reshape(*a.shape[:-1], out // 2, 2).swapaxes(-1, -2)

        fp4, scale = split(fp4), split(scale)
    return {"fp4": np.ascontiguousarray(fp4), "scale": np.ascontiguousarray(scale)}
