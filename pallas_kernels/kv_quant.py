"""fp8 (e4m3) KV pages: quantization at write time and the per-head scales every kernel applies.

A pool in float8_e4m3fn holds `k / k_scale` and `v / v_scale`, saturated to ±448, with one float32
scale per (layer, kv head) (`kv_scale[layer] = [k_scale, v_scale]`, each [Hkv]). The kernels never
dequantize a page: scores take `q * k_scale` (per kv head) against the fp8 keys widened in
registers, and the output of the softmax-weighted sum of fp8 values is multiplied by `v_scale`.
Both are exact rewrites of attention over the dequantized values. This step's fresh keys and values
are quantized the same way before use, so a token reads the same key whether fresh or cached.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) == jnp.dtype(FP8)


def quantize(x: Float[Array, "T H D"], scale: Float[Array, "H"]) -> Array:
    """`x / scale` per head, saturated to ±448 and rounded to e4m3 (nearest even)."""
    y = x.astype(jnp.float32) / scale[:, None]
    return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(FP8)


def compute_dtype(pool_dtype, q_dtype) -> jnp.dtype:
    """The dtype the Pallas kernels multiply in: the pool's, or q's for an fp8 pool (its pages are
    widened in registers, never copied)."""
    return jnp.dtype(q_dtype) if is_fp8(pool_dtype) else jnp.dtype(pool_dtype)


def fold_query(q: Float[Array, "T Hq D"], k_scale: Float[Array, "Hkv"]) -> Float[Array, "T Hq D"]:
    """q times its kv head's key scale (query head j*G + i reads kv head j), in float32."""
    t, hq, d = q.shape
    hkv = k_scale.shape[0]
    return (q.astype(jnp.float32).reshape(t, hkv, hq // hkv, d) * k_scale[:, None, None]).reshape(t, hq, d)


def unfold_output(o: Float[Array, "T Hq D"], v_scale: Float[Array, "Hkv"]) -> Float[Array, "T Hq D"]:
    """The weighted sum of fp8 values times its kv head's value scale."""
    t, hq, d = o.shape
    hkv = v_scale.shape[0]
    return (o.reshape(t, hkv, hq // hkv, d) * v_scale[:, None, None].astype(o.dtype)).reshape(t, hq, d)
