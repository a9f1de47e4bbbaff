"""A float model's layer weights quantized at load to int4 with zero points, in the GPTQ / AWQ kept form.

`weights_quantization="int4"` on a real model (loaders/gguf_quant.py `place_quantized_at_load`).
Each stacked layer weight (q/k/v, o, gate/up, down) is quantized per output channel in groups of
`group` consecutive inputs in HF's input order (wo's: head after head), the last group shorter
where `group` does not divide the inputs (as GPTQ's ceil(I / group) groups; SmolLM2's 576 hidden
inputs are 4 groups of 128 and one of 64). Round to nearest, asymmetric, as AutoGPTQ's RTN
(`Quantizer.find_params`, unsymmetric; no GPTQ error-correcting solve, no AWQ activation scaling):

    lo = min(min(x), 0), hi = max(max(x), 0) over a group (-1 and 1 where both are 0)
    scale = float16((hi - lo) / 15)   (at least float16's least step)
    zero = round(-lo / scale),  q = clip(round(x / scale) + zero, 0, 15)

the zero and the codes taken against the stored float16 scale (as AutoGPTQ packs), in float64, so
no code depends on a float32 rounding. Every zero is in [0, 15] and `(q - zero) * scale` is within
about half a scale of the weight (0.5 * scale plus float16's rounding of the scale at a group's ends).

The result is what quant/gptq_awq.py `kept_parts` makes of a checkpoint, so it takes that form's
paths (quant/resident.py in the layer scan, the GPU's kernel in place, tp splits): values packed
eight to an int32 along the input axis, a uint8 zero and a float16 scale per piece of a group,
the group cut to divide the inputs and, for wo, a head (`at_load_group`; each group's zero and
scale repeated on its pieces).
"""

from __future__ import annotations

import math
from typing import Mapping

import jax.numpy as jnp
import numpy as np
from jaxtyping import Float, Shaped, UInt8

from infire_jax.quant.gptq_awq import pack_words
from infire_jax.quant.resident import CHANNEL_VALUES, INPUT_AXIS, QuantLayout

INT4_GROUPS = (32, 128)  # group sizes offered: AWQ's / GPTQ's usual ones
DEFAULT_INT4_GROUP = 128
_LEAST_SCALE = np.float16(2.0 ** -24)  # float16's least positive value: a group whose range rounds below it
_CHUNK = 1 << 22  # float64 elements a chunk of rows holds while quantizing (32 MiB)


def quantize_rtn(w: Float[np.ndarray, "O I"], group: int
                 ) -> tuple[UInt8[np.ndarray, "O I"], UInt8[np.ndarray, "O G"], Shaped[np.ndarray, "O G"]]:
    """Codes `q [O, I]`, `zero` and float16 `scale` `[O, ceil(I / group)]` of `w` (see the module doc);
    ValueError if a group's values are not finite or span more than a float16 scale holds."""
    x = np.asarray(w, np.float64)
    starts = np.arange(0, x.shape[1], group)
    lo = np.minimum(np.minimum.reduceat(x, starts, axis=1), 0)
    hi = np.maximum(np.maximum.reduceat(x, starts, axis=1), 0)
    flat = (lo == 0) & (hi == 0)
    lo[flat], hi[flat] = -1.0, 1.0
    with np.errstate(over="ignore", invalid="ignore"):
        scale = ((hi - lo) / 15).astype(np.float16)
    if not np.isfinite(scale).all():
        raise ValueError("values that are not finite or span more than a float16 scale holds")
    scale = np.maximum(scale, _LEAST_SCALE)
    s = scale.astype(np.float64)
    zero = np.clip(np.rint(-lo / s), 0, 15)
    each = np.arange(x.shape[1]) // group
    q = np.clip(np.rint(x / s[:, each]) + zero[:, each], 0, 15)
    return q.astype(np.uint8), zero.astype(np.uint8), scale


def _input_axes(short: str, ndim: int) -> tuple[int, ...]:
    """A layer weight's input axes in HF's order: wo's [Hq, D, E] takes heads x head_dim."""
    axis = ndim + INPUT_AXIS[short]
    return (axis - 1, axis) if short == "wo" else (axis,)


def at_load_group(short: str, shape: tuple[int, ...], group: int, name: str | None = None) -> int:
    """Inputs per kept zero / scale of a layer weight of `shape` (one layer's, the model's layout):
    `group` cut to divide the inputs and, for wo, a head; ValueError naming the weight (`name`, default
    "layers.<short>") unless that is whole 8-input words."""
    axes = _input_axes(short, len(shape))
    inputs = math.prod(shape[a] for a in axes)
    kept = math.gcd(group, inputs, shape[axes[-1]])
    if kept % 8:
        raise ValueError(f"{name or f'layers.{short}'}: int4 groups of {group} over its {inputs} inputs"
                         f"{f' (heads of {shape[axes[-1]]})' if short == 'wo' else ''} would be kept in pieces of "
                         f"{kept}, not whole 8-input words")
    return kept


def _layer_parts(short: str, w: np.ndarray, group: int, kept: int) -> dict[str, np.ndarray]:
    """One layer's weight (model layout) as kept parts "q4", "zero", "scale" (model layout, input axis shortened)."""
    ins = _input_axes(short, w.ndim)
    order = [a for a in range(w.ndim) if a not in ins] + list(ins)
    inputs = math.prod(w.shape[a] for a in ins)
    m = w.transpose(order).reshape(-1, inputs)
    rows = max(1, _CHUNK // inputs)
    chunks = [quantize_rtn(m[r:r + rows], group) for r in range(0, len(m), rows)]
    q, zero, scale = (np.concatenate(c) for c in zip(*chunks))
    first = np.arange(0, inputs, kept) // group  # the group of each kept piece

    def back(a: np.ndarray) -> np.ndarray:
        lead = [w.shape[i] for i in order[:-1]]
        return np.ascontiguousarray(a.reshape(*lead, -1).transpose(np.argsort(order)))

    return {"q4": back(pack_words(q)), "zero": back(zero[:, first]), "scale": back(scale[:, first])}


def quantize_int4(weights: Mapping[str, np.ndarray], group: int = DEFAULT_INT4_GROUP
                  ) -> tuple[dict[str, np.ndarray], dict[str, QuantLayout]]:
    """Host weights with every quantizable stacked layer weight of every stack ("layers.wqkv" [L, ...];
    Llama 4: "dense_layers.wqkv", "moe_layers.wqkv", ...) replaced by its kept int4 parts
    ("layers.wqkv.q4", ".zero", ".scale"), and their layouts by weight name, as the models take them
    (one for a name in every stack: pieces that divide each stack's groups); other weights as they are.
    ValueError naming the weight where it cannot be kept."""
    out = dict(weights)
    names = [k for k in weights if k.count(".") == 1 and k.partition(".")[2] in INPUT_AXIS]
    layouts = int4_layouts({name: weights[name].shape for name in names}, group)
    for name in names:
        short = name.partition(".")[2]
        w, kept = out.pop(name), layouts[short].group
        per_layer = []
        for i in range(w.shape[0]):
            try:
                per_layer.append(_layer_parts(short, np.asarray(w[i]), group, kept))
            except ValueError as e:
                raise ValueError(f"{name} (layer {i}): {e}") from e
        out.update({f"{name}.{p}": np.stack([lp[p] for lp in per_layer]) for p in ("q4", "zero", "scale")})
    return out, layouts


def layouts_at_load(stacks: Mapping[str, tuple[int, ...]], mode: str, group: int = DEFAULT_INT4_GROUP
                    ) -> dict[str, QuantLayout]:
    """The layout of each quantizable weight name among `stacks` (path -> stacked shape) as
    `weights_quantization=mode` quantizes it at load: "int8" / "fp8" per output channel, "int4" by
    `int4_layouts`."""
    if mode in CHANNEL_VALUES:
        return {name.rpartition(".")[2]: QuantLayout(mode) for name in stacks if name.rpartition(".")[2] in INPUT_AXIS}
    return int4_layouts(stacks, group)


def int4_layouts(stacks: Mapping[str, tuple[int, ...]], group: int = DEFAULT_INT4_GROUP) -> dict[str, QuantLayout]:
    """The int4 layout of each quantizable weight name among `stacks` (path -> stacked shape [L, ...],
    "moe_layers.w_down"), by the name in its stack as the models take them: groups of `group` inputs kept
    in pieces that divide every stack's groups of that name (Llama 4's, GLM-4.5's dense and MoE w_down
    differ in width). ValueError naming a weight that cannot be kept in whole 8-input words."""
    pieces: dict[str, int] = {}
    for name, shape in stacks.items():
        short = name.rpartition(".")[2]
        if short in INPUT_AXIS:
            pieces[short] = math.gcd(pieces.get(short, 0), at_load_group(short, tuple(shape[1:]), group, name))
    return {short: QuantLayout("int4", kept, jnp.float16) for short, kept in pieces.items()}
