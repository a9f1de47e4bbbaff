"""GPTQ and AWQ (GEMM) 4-bit checkpoints: their tensors read into one form, dequantized exactly.

What this relies on (the formats as AutoGPTQ / GPTQModel, AutoAWQ and vLLM's `gptq` / `awq` layers
define them; no code taken from them). Per linear module with I inputs, O outputs and G groups
(G = I / group_size; 1 for group_size -1):

- GPTQ: `qweight` int32 `[I / 8, O]`, packed along the input axis: input `8j + k` of output o is
  bits `4k..4k+3` of word `[j, o]`. `qzeros` int32 `[G, O / 8]`, packed along the output axis in
  the same nibble order; `scales` `[G, O]` (fp16); `g_idx` int32 `[I]`, each input's group
  (`i // group_size`, or any assignment after act-order's `desc_act` permutation).
  `checkpoint_format` "gptq" (v1: AutoGPTQ, and the default) stores each zero minus one, and its
  dequantizers add one to the 4-bit field (a stored 15 is a zero of 16); "gptq_v2" (GPTQModel)
  stores the zero itself. `sym` only means every zero is 8.
  `w[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o]`.
- AWQ, `version: gemm` (AutoAWQ's WQLinear_GEMM; `awq/utils/packing_utils.py` `dequantize_gemm`,
  `reverse_awq_order`): `qweight` int32 `[I, O / 8]` packed along the OUTPUT axis, bits `4k` of word
  `[i, j]` holding output `8j + AWQ_ORDER[k]`, AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]; `qzeros` int32
  `[G, O / 8]` packed the same way, zeros stored as they are; `scales` `[G, O]`; groups are runs of
  consecutive inputs. `w[o, i] = (q[i, o] - z[i // g, o]) * s[i // g, o]`.

`q - z` is a small integer and the scale a 16-bit float, so the float32 product is exact: the
dequantized weight is the definition's value, on the host at load (`dequantize`) or on the device
in the layer scan (`dequantize_parts`, the form kept by `kept_parts`, or `kept_parts_act_order`
with the per-input group index), bit for bit alike.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jaxtyping import Array, Float, Int32, Shaped, UInt8

AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])
_SHIFTS = np.arange(8, dtype=np.int64) * 4


@dataclasses.dataclass(frozen=True)
class Int4Zero:
    """One module's 4-bit weight unpacked, HF orientation: value `q [O, I]`, per-group `zero` and
    `scale [O, G]`, and each input's group `g_idx [I]`."""

    q: UInt8[np.ndarray, "O I"]
    zero: UInt8[np.ndarray, "O G"]
    scale: Shaped[np.ndarray, "O G"]
    g_idx: Int32[np.ndarray, "I"]

    @property
    def act_order(self) -> bool:
        """Whether the groups are not runs of consecutive inputs (GPTQ desc_act)."""
        inp, groups = self.q.shape[1], self.scale.shape[1]
        return not np.array_equal(self.g_idx, np.arange(inp) // (inp // groups))


def _check(field: str, a: np.ndarray, shape: tuple[int, ...], dtypes: tuple) -> None:
    """ValueError naming `field` unless `a` has `shape` and one of `dtypes`."""
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{field} has shape {tuple(a.shape)}, expected {tuple(shape)}")
    if a.dtype not in [np.dtype(d) for d in dtypes]:
        raise ValueError(f"{field} has dtype {a.dtype}, expected one of {[np.dtype(d).name for d in dtypes]}")


def _nibbles(words: np.ndarray) -> np.ndarray:
    """The eight 4-bit fields of each int32 word, low bits first, on a new last axis."""
    return ((words.astype(np.int64)[..., None] >> _SHIFTS) & 0xF).astype(np.uint8)


def _scale_check(scales: np.ndarray, groups: int, out: int) -> None:
    _check("scales", scales, (groups, out), (np.float16, np.float32, ml_dtypes.bfloat16))


def _groups(inp: int, group: int) -> int:
    size = inp if group == -1 else group
    if inp % 8 or size <= 0 or inp % size:
        raise ValueError(f"group_size {group} does not tile the {inp} inputs (a multiple of 8)")
    return inp // size


def unpack_gptq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, g_idx: np.ndarray, group: int,
                zero_offset: int) -> Int4Zero:
    """A GPTQ module's tensors (`zero_offset`: 1 for checkpoint_format v1, 0 for v2)."""
    _check("qweight", qweight, (qweight.shape[0], qweight.shape[-1]), (np.int32,))
    inp, out = qweight.shape[0] * 8, qweight.shape[1]
    if out % 8:
        raise ValueError(f"qweight has {out} outputs, not a multiple of 8")
    groups = _groups(inp, group)
    _check("qzeros", qzeros, (groups, out // 8), (np.int32,))
    _scale_check(scales, groups, out)
    _check("g_idx", g_idx, (inp,), (np.int32, np.int64))
    if g_idx.min() < 0 or g_idx.max() >= groups:
        raise ValueError(f"g_idx has groups {g_idx.min()}..{g_idx.max()}, outside 0..{groups - 1}")
    q = _nibbles(qweight).transpose(1, 0, 2).reshape(out, inp)  # [I/8, O, 8] -> [O, I]
    zero = (_nibbles(qzeros).reshape(groups, out) + zero_offset).astype(np.uint8)
    return Int4Zero(q, zero.T.copy(), scales.T.copy(), g_idx.astype(np.int32))


def unpack_awq(qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray, group: int) -> Int4Zero:
    """An AWQ GEMM module's tensors."""
    _check("qweight", qweight, (qweight.shape[0], qweight.shape[-1]), (np.int32,))
    inp, out = qweight.shape[0], qweight.shape[1] * 8
    groups = _groups(inp, group)
    _check("qzeros", qzeros, (groups, out // 8), (np.int32,))
    _scale_check(scales, groups, out)
    order = np.argsort(AWQ_ORDER)  # nibble k holds output AWQ_ORDER[k]: output m is nibble order[m]

    def outputs(words: np.ndarray) -> np.ndarray:
        return _nibbles(words)[..., order].reshape(words.shape[0], -1)

    g_idx = np.arange(inp, dtype=np.int32) // (inp // groups)
    return Int4Zero(outputs(qweight).T.copy(), outputs(qzeros).T.copy(), scales.T.copy(), g_idx)


def dequantize(w: Int4Zero) -> Float[np.ndarray, "O I"]:
    """The float32 weight `[O, I]` the format defines."""
    diff = w.q.astype(np.int32) - w.zero[:, w.g_idx].astype(np.int32)
    return diff.astype(np.float32) * w.scale[:, w.g_idx].astype(np.float32)


def pack_words(q: UInt8[np.ndarray, "O I"]) -> Int32[np.ndarray, "O I8"]:
    """Values `[O, I]` packed eight to an int32 along the input axis (input `8j + k` in bits 4k of word j)."""
    out, inp = q.shape
    return (q.astype(np.int64).reshape(out, inp // 8, 8) << _SHIFTS).sum(-1).astype(np.uint32).view(np.int32)


def kept_parts(w: Int4Zero, per_group: int) -> dict[str, np.ndarray]:
    """The device form of a weight whose groups are consecutive inputs, HF orientation: "q4" int32
    `[O, I / 8]`, and "zero" / "scale" `[O, I / per_group]`, each group's entry repeated if
    `per_group` divides the checkpoint's group (so groups never cross a head of wo)."""
    size = w.q.shape[1] // w.scale.shape[1]
    if w.act_order or size % per_group:
        raise ValueError(f"groups of {size} inputs (act-order: {w.act_order}) are not kept in groups of {per_group}")
    repeat = size // per_group
    return {"q4": pack_words(w.q), "zero": np.repeat(w.zero, repeat, axis=1), "scale": np.repeat(w.scale, repeat, axis=1)}


def kept_parts_act_order(w: Int4Zero) -> dict[str, np.ndarray]:
    """The device form of a weight whose groups are any sets of inputs (GPTQ desc_act): "q4" as
    `kept_parts`, the whole "zero" / "scale" tables `[O, G]`, and "g_idx" int16 `[I]`, each
    input's group, by which the device gathers them."""
    groups = w.scale.shape[1]
    if groups > np.iinfo(np.int16).max + 1:
        raise ValueError(f"{groups} groups do not fit the int16 group index")
    return {"q4": pack_words(w.q), "zero": w.zero, "scale": w.scale, "g_idx": w.g_idx.astype(np.int16)}


def kept_group(size: int, head_dim: int | None) -> int:
    """Inputs per kept group: the checkpoint's, cut to fit within a head for wo (`head_dim`)."""
    return size if head_dim is None else math.gcd(size, head_dim)


def dequantize_parts(parts: dict[str, Array], axis: int, dtype) -> Shaped[Array, "..."]:
    """A kept weight (any layout; `axis`, counted from the end, is its input axis) in `dtype`:
    `(q - zero) * scale` in float32, so bit for bit the load-time weight. With a "g_idx" part
    (act-order: the weight's shape with its last axis 1) each input's zero and scale are gathered
    from the whole tables, which hold G entries on the input axis."""
    words, zero, scale = parts["q4"], parts["zero"], parts["scale"]
    a = words.ndim + axis
    shifts = (jnp.arange(8, dtype=jnp.int32) * 4).reshape((8,) + (1,) * (words.ndim - a - 1))
    q = (jnp.expand_dims(words, a + 1) >> shifts) & 0xF  # [..., I / 8, 8, ...]
    q = q.reshape(*words.shape[:a], -1, *words.shape[a + 1:])
    if "g_idx" in parts:
        idx = parts["g_idx"].astype(jnp.int32)
        diff = (q - jnp.take_along_axis(zero, idx, axis=a).astype(jnp.int32)).astype(jnp.float32)
        return (diff * jnp.take_along_axis(scale, idx, axis=a).astype(jnp.float32)).astype(dtype)
    n, groups = q.shape[a], scale.shape[a]
    grouped = q.reshape(*q.shape[:a], groups, n // groups, *q.shape[a + 1:])
    diff = (grouped - jnp.expand_dims(zero.astype(jnp.int32), a + 1)).astype(jnp.float32)
    return (diff * jnp.expand_dims(scale.astype(jnp.float32), a + 1)).reshape(q.shape).astype(dtype)
