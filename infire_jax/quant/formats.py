"""Published weight-only quantization formats, kept packed on the device and dequantized in the matmul.

Each format is a pytree of its stored arrays, in the checkpoint's own layout (HF `[out, in]`), so a
checkpoint's tensors are placed as they are read. `dequantize` follows the format's definition
exactly (tests/test_quant.py checks it bit for bit against a float64 implementation of the
published definition), and `linear` is `x @ dequantize(w).T` as one jitted expression, so the
dequantization is the matmul's prologue:

- `Int4Group`: compressed-tensors `pack-quantized` (Kimi K2's experts): `weight_packed` int32
  `[out, in / 8]` with value `8j + i` of a row in bits `4i..4i+3` of word `j`, stored unsigned
  (`q + 8`); `weight_scale` `[out, in / group]`; symmetric, `w = q * scale`.
- `Fp8Block`: DeepSeek-V3's fp8: `weight` float8_e4m3fn `[out, in]`, `weight_scale_inv` float32
  `[ceil(out / 128), ceil(in / 128)]`, `w = float32(weight) * scale_inv[o // 128, i // 128]`.
- `Int8Channel`: `weight` int8 `[out, in]`, `weight_scale` `[out, 1]`, `w = q * scale[o]`.
- `Fp8Channel`: `weight` float8_e4m3fn `[out, in]`, `weight_scale` `[out, 1]`, `w = float32(q) *
  scale[o]` (llm-compressor's FP8 channel scheme, fbgemm_fp8; a per-tensor scale repeated on each row).

Dequantized values are computed in float32 (for int4 and int8 the product is exact there; for fp8
it is the definition's float32 product) and cast to the requested dtype last.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jaxtyping import Array, Float, Int32, Shaped

INT4_GROUP = 32  # Kimi K2's group size
FP8_BLOCK = 128  # DeepSeek-V3's weight_block_size
_NIBBLE_SHIFTS = np.arange(8, dtype=np.int32) * 4


def _check(field: str, a, shape: tuple[int, ...], dtypes: tuple) -> None:
    """Raises ValueError naming `field` unless `a` has `shape` and one of `dtypes`."""
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{field} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    if jnp.dtype(a.dtype) not in [jnp.dtype(d) for d in dtypes]:
        raise ValueError(f"{field} has dtype {jnp.dtype(a.dtype).name}, expected one of "
                         f"{[jnp.dtype(d).name for d in dtypes]}")


_SCALE_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int4Group:
    """compressed-tensors pack-quantized int4, symmetric, one scale per `group` inputs of a row."""

    weight_packed: Int32[Array, "O I8"]
    weight_scale: Shaped[Array, "O Ig"]
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    group: int = dataclasses.field(default=INT4_GROUP, metadata=dict(static=True))

    def __post_init__(self):
        out, inp = self.shape
        if inp % self.group or self.group % 8:
            raise ValueError(f"weight_shape {self.shape}: inputs must be a multiple of the group {self.group}, "
                             f"itself a multiple of 8")
        _check("weight_packed", self.weight_packed, (out, inp // 8), (jnp.int32,))
        _check("weight_scale", self.weight_scale, (out, inp // self.group), _SCALE_DTYPES)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Block:
    """float8_e4m3fn weights with one float32 inverse scale per 128 x 128 block."""

    weight: Shaped[Array, "O I"]
    weight_scale_inv: Float[Array, "Ob Ib"]
    block: int = dataclasses.field(default=FP8_BLOCK, metadata=dict(static=True))

    def __post_init__(self):
        out, inp = self.weight.shape
        _check("weight", self.weight, (out, inp), (jnp.float8_e4m3fn,))
        _check("weight_scale_inv", self.weight_scale_inv,
               (math.ceil(out / self.block), math.ceil(inp / self.block)), (jnp.float32,))


@dataclasses.dataclass(frozen=True)
class _RowScaled:
    """8-bit weights (`VALUES`, a subclass's) with one scale per output channel (row)."""

    weight: Shaped[Array, "O I"]
    weight_scale: Shaped[Array, "O 1"]
    VALUES: ClassVar[tuple] = ()

    def __post_init__(self):
        _check("weight", self.weight, self.weight.shape, self.VALUES)
        _check("weight_scale", self.weight_scale, (self.weight.shape[0], 1), _SCALE_DTYPES)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Channel(_RowScaled):
    """int8 weights with one scale per output channel (row)."""

    VALUES: ClassVar[tuple] = (jnp.int8,)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Channel(_RowScaled):
    """float8_e4m3fn weights with one scale per output channel (row)."""

    VALUES: ClassVar[tuple] = (jnp.float8_e4m3fn,)


QuantizedWeight = Int4Group | Fp8Block | Int8Channel | Fp8Channel


def unpack_int4(packed: Int32[Array, "... W"]) -> Int32[Array, "... V"]:
    """Signed int4 values (-8..7) of compressed-tensors' int32 words, eight a word, low bits first."""
    nibbles = (packed[..., None] >> jnp.asarray(_NIBBLE_SHIFTS)) & 0xF
    return nibbles.reshape(*packed.shape[:-1], packed.shape[-1] * 8) - 8


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> Shaped[Array, "O I"]:
    """The full-precision weight `[out, in]` the format defines (float32 arithmetic, then `dtype`)."""
    if isinstance(w, Int4Group):
        out, inp = w.shape
        q = unpack_int4(w.weight_packed).astype(jnp.float32).reshape(out, inp // w.group, w.group)
        full = (q * w.weight_scale.astype(jnp.float32)[..., None]).reshape(out, inp)
    elif isinstance(w, Fp8Block):
        out, inp = w.weight.shape
        scale = jnp.repeat(jnp.repeat(w.weight_scale_inv, w.block, axis=0), w.block, axis=1)[:out, :inp]
        full = w.weight.astype(jnp.float32) * scale
    elif isinstance(w, _RowScaled):
        full = w.weight.astype(jnp.float32) * w.weight_scale.astype(jnp.float32)
    else:
        raise TypeError(f"not a quantized weight: {type(w).__name__}")
    return full.astype(dtype)


@jax.jit
def linear(x: Float[Array, "T I"], w: QuantizedWeight) -> Float[Array, "T O"]:
    """`x @ dequantize(w).T` in x's dtype with float32 accumulation: the dequantization is the dot's
    operand expression, so the compiler places it (XLA:CPU: one fusion writing the operand the dot
    reads; XLA:GPU's Triton GEMM fusion can read it inside the kernel)."""
    return jax.lax.dot_general(x, dequantize(w, x.dtype), (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32).astype(x.dtype)


# ---- host quantizers: make the formats from float weights (tests, and quantizing a float model) ----

def quantize_int4_group(w: Float[np.ndarray, "O I"], group: int = INT4_GROUP, scale_dtype=np.float32) -> Int4Group:
    """Round-to-nearest symmetric int4 (scale = absmax / 7), packed as compressed-tensors packs it."""
    out, inp = w.shape
    g = w.astype(np.float32).reshape(out, inp // group, group)
    scale = (np.abs(g).max(axis=-1) / 7).astype(scale_dtype)
    s = np.where(scale.astype(np.float32) == 0, 1, scale.astype(np.float32))[..., None]
    q = np.clip(np.rint(g / s), -8, 7).astype(np.int32).reshape(out, inp)
    words = ((q + 8).reshape(out, inp // 8, 8) << _NIBBLE_SHIFTS).sum(axis=-1, dtype=np.int64)
    packed = words.astype(np.uint32).view(np.int32)
    return Int4Group(jnp.asarray(packed), jnp.asarray(scale), (out, inp), group)


def quantize_fp8_block(w: Float[np.ndarray, "O I"], block: int = FP8_BLOCK) -> Fp8Block:
    """Per-block scale so the block's absmax maps to e4m3's largest finite value (448)."""
    out, inp = w.shape
    ob, ib = math.ceil(out / block), math.ceil(inp / block)
    padded = np.zeros((ob * block, ib * block), np.float32)
    padded[:out, :inp] = w
    amax = np.abs(padded.reshape(ob, block, ib, block)).max(axis=(1, 3))
    scale_inv = np.where(amax == 0, 1, amax / 448).astype(np.float32)
    full = np.repeat(np.repeat(scale_inv, block, 0), block, 1)[:out, :inp]
    q = (w.astype(np.float32) / full).astype(ml_dtypes.float8_e4m3fn)
    return Fp8Block(jnp.asarray(q), jnp.asarray(scale_inv), block)


def quantize_int8_channel(w: Float[np.ndarray, "O I"]) -> Int8Channel:
    """Symmetric per-row int8 (scale = absmax / 127)."""
    scale = (np.abs(w).max(axis=1, keepdims=True) / 127).astype(np.float32)
    q = np.clip(np.rint(w / np.where(scale == 0, 1, scale)), -127, 127).astype(np.int8)
    return Int8Channel(jnp.asarray(q), jnp.asarray(scale))
