"""Quantized stacked weights kept in device memory and dequantized one layer at a time in the scan.

Five sources: a GGUF file's Q4_1 / Q8_0 blocks kept as they are (loaders/gguf_quant.py), any
float model quantized at load to int8 or fp8 (e4m3) with one scale per output channel
(`quantize_channels`; vLLM's `--quantization fp8`, per channel rather than per tensor) or to
int4 groups with zero points (quant/int4_rtn.py), a GPTQ / AWQ checkpoint's int4 groups with
zero points (loaders/llama_quant.py, quant/gptq_awq.py), or an 8-bit checkpoint's fp8 or int8
weights with a scale per output channel (llm-compressor, AutoFP8, fbgemm_fp8), or per output channel
and block of inputs (Qwen3's FP8 releases; loaders/llama_quant.py).

Like palette compression (compression/resident.py), a quantized stacked weight is a module of
parts in place of its `nnx.Param`. Each part keeps the weight's logical axes, with the input
(block) axis shortened, so the parts shard exactly as the weight does (act-order int4's zero /
scale tables excepted: whole on every device). The scanned layer body
dequantizes the current layer's weights just before their matmuls (`dequantize_layer`), so only
one layer is ever held in full precision. On a GPU, decode-sized steps (and MoE experts) skip even
that: a Pallas kernel reads the parts in place and dequantizes each tile on chip
(models/quant_kernels.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array

from infire_jax.errors import ConfigError
from infire_jax.quant.gguf_blocks import QK, QUANT_PART, dequantize_blocks
from infire_jax.quant.gptq_awq import dequantize_parts
from infire_jax.quant.weight_parts import WeightParts

# int8 / fp8: `quantize_channels`; int4: quant/int4_rtn.py; "checkpoint": quant/grouped.py, loaders/llama_quant.py
QUANTIZATION_MODES = ("gguf", "int8", "fp8", "int4", "checkpoint")
# The input axis of each quantizable layer weight, counted from the end (dense and MoE alike):
# wqkv [E, Hkv, G+2, D], wo [Hq, D, E] (blocks run along D within a head), w_gate_up [(X,) E, 2, F],
# w_down [(X,) F, E], and a shared expert's (Llama 4) like a dense MLP's.
# w_shared_*: a shared expert's (Llama 4's, GLM-4.5's, Qwen3.5's); w_experts_*: Gemma 4's MoE block, beside its
# dense MLP, [X, E, 2, F] and [X, F, E]; Qwen3.5's attention (wq [E, H, 2, D] with its gate, wk and wv
# [E, Hkv, D]) and Gated DeltaNet projections (w_qkv [E, C], w_z [E, V], w_out [V, E]).
INPUT_AXIS = {"wqkv": -4, "wo": -2, "w_gate_up": -3, "w_down": -2, "w_shared_gate_up": -3, "w_shared_down": -2,
              "w_experts_gate_up": -3, "w_experts_down": -2, "wq": -4, "wk": -3, "wv": -3, "w_qkv": -2,
              "w_z": -2, "w_out": -2}
CHANNEL_VALUES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}  # 8-bit kinds: their values' part and dtype
CHANNEL_MAX = {"int8": 127.0, "fp8": 448.0}  # the largest value each keeps (symmetric; e4m3's finite maximum)


@dataclasses.dataclass(frozen=True)
class QuantLayout:
    """A quantized weight's format (a GGUF block type, int8 per output channel, or int4 with zero
    points in groups of `group` inputs, consecutive or, with `act_order`, any); the parts' shapes
    and logical axes follow from the weight's."""

    kind: str  # "Q4_1", "Q8_0", "int8", "fp8" (e4m3; a float32 scale per output channel, as int8) or "int4"
    # int4: inputs per scale and zero (the whole input axis for one group per row); fp8: inputs per scale
    # (a block-scaled checkpoint's, 0 for one scale per output channel)
    group: int = 0
    scale_dtype: Any = jnp.float16  # int4: the checkpoint's
    act_order: bool = False  # int4: groups are sets of inputs named by a per-input index (GPTQ desc_act)

    def part_specs(self, short: str, shape: tuple[int, ...], axes: tuple[str | None, ...]
                   ) -> dict[str, tuple[tuple[int, ...], Any, tuple[str | None, ...]]]:
        """Each part's (shape, dtype, logical axes) for a weight of `shape` and `axes`: the weight's
        axes with the input axis shortened, so each part splits as the weight does, except where a
        part holds one entry for all of an axis or, act-order, a whole table every input may index.
        ValueError naming the weight if its input axis is not whole blocks."""
        axis = len(shape) + INPUT_AXIS[short]

        def along(n: int, dtype) -> tuple[tuple[int, ...], Any, tuple]:
            """The input axis shortened to n; one entry there (a per-channel scale) is not split."""
            part = tuple(n if i == axis else s for i, s in enumerate(shape))
            return part, dtype, tuple(None if i == axis and n == 1 else a for i, a in enumerate(axes))

        if self.kind in CHANNEL_VALUES:  # a float32 scale per output channel (and group of inputs)
            if self.group and shape[axis] % self.group:
                raise ValueError(f"{short}: {self.kind} groups of {self.group} inputs do not tile its input axis "
                                 f"of {shape[axis]}")
            groups = shape[axis] // self.group if self.group else 1
            return {self.kind: (shape, CHANNEL_VALUES[self.kind], axes), "scale": along(groups, jnp.float32)}
        if self.kind == "int4":
            return self._int4_specs(short, shape, axes, axis, along)
        if shape[axis] % QK:
            raise ValueError(f"{short}: input axis of {shape[axis]} weights is not a whole number of "
                             f"{QK}-weight blocks")
        scales = {"d": along(shape[axis] // QK, jnp.float16)}
        if self.kind == "Q4_1":
            return {"q4_1": along(shape[axis] // 2, jnp.uint8), **scales, "m": scales["d"]}
        if self.kind == "Q8_0":
            return {"q8_0": (shape, jnp.int8, axes), **scales}
        raise ValueError(f"{short}: GGUF type {self.kind} is not kept quantized; supported: {sorted(QUANT_PART)}")

    def _int4_specs(self, short: str, shape: tuple[int, ...], axes: tuple[str | None, ...], axis: int,
                    along: Callable) -> dict[str, tuple[tuple[int, ...], Any, tuple[str | None, ...]]]:
        """q4 int32 words along the input axis; zero / scale per group of consecutive inputs or, act-order,
        the whole tables (G entries on the input axis, 1 on wo's head axis, unsplit) and the int16 "g_idx"
        (the weight's shape with its last axis 1)."""
        first = axis - 1 if short == "wo" else axis  # wo's inputs are heads x head_dim
        inputs = math.prod(shape[first:axis + 1]) if self.act_order else shape[axis]
        if shape[axis] % 8 or inputs % self.group:
            raise ValueError(f"{short}: int4 groups of {self.group} inputs do not tile its {inputs} inputs "
                             f"(in words of 8 along an axis of {shape[axis]})")
        specs = {"q4": along(shape[axis] // 8, jnp.int32)}
        if not self.act_order:
            return {**specs, "zero": along(inputs // self.group, jnp.uint8),
                    "scale": along(inputs // self.group, self.scale_dtype)}
        whole = tuple(range(first, axis + 1))
        table = tuple(inputs // self.group if i == axis else 1 if i in whole else n for i, n in enumerate(shape))
        table_axes = tuple(None if i in whole else a for i, a in enumerate(axes))
        return {**specs, "zero": (table, jnp.uint8, table_axes), "scale": (table, self.scale_dtype, table_axes),
                "g_idx": ((*shape[:-1], 1), jnp.int16, (*axes[:-1], None))}


# How a `dummy:` model draws quantized parts (models/registry.py), per layout kind: values uniform over
# the format's range (int8's symmetric one; fp8: every e4m3 value alike; int4 words of random nibbles,
# zero point 8), and a scale that gives them the spread of a float dummy's weights.
DUMMY_INIT = {"int8": {"int8": "int8", "scale": "int8-scale"}, "fp8": {"fp8": "fp8", "scale": "fp8-scale"},
              "int4": {"q4": "int4-words", "zero": "int4-zero", "scale": "int4-scale"}}


class QuantParams(WeightParts):
    """The parts of one quantized stacked weight, each a parameter with its logical axes."""

    def __init__(self, short: str, shape: tuple[int, ...], axes: tuple[str | None, ...], layout: QuantLayout):
        for part, (part_shape, dtype, part_axes) in layout.part_specs(short, shape, axes).items():
            init = DUMMY_INIT.get(layout.kind, {}).get(part, "zeros")
            setattr(self, part, nnx.Param(jnp.zeros(part_shape, dtype), axes=part_axes, init=init))


def keep_quantized(stack: nnx.Module, resident: Mapping[str, QuantLayout]) -> None:
    """Replaces each of `stack`'s weights that `resident` names by its quantized parts (`QuantParams`);
    a name the stack lacks (another stack's weight, as Llama 4's shared expert in its dense stack) is skipped."""
    for short, layout in resident.items():
        plain = getattr(stack, short, None)
        if isinstance(plain, nnx.Param):
            setattr(stack, short, QuantParams(short, tuple(plain.shape), plain.axes, layout))


def quant_layouts(model: str, resident: Mapping[str, Any] | None) -> dict[str, QuantLayout]:
    """A model's `resident` layouts, which must all be quantized ones: ConfigError naming `model` for
    palette-compressed weights (weights_compression), which its layers do not decode."""
    resident = dict(resident or {})
    if not all(isinstance(layout, QuantLayout) for layout in resident.values()):
        raise ConfigError(f"weights_compression is not supported for {model}; weights_quantization int8 / fp8 / "
                          "int4 keeps its layer weights quantized")
    return resident


def is_quantized(value: Any) -> bool:
    return isinstance(value, Mapping) and any(p in value for p in (*QUANT_PART.values(), *CHANNEL_VALUES, "q4"))


def _dequantize(parts: Mapping[str, Array], short: str, dtype) -> Array:
    if "q4" in parts:
        return dequantize_parts(parts, INPUT_AXIS[short], dtype)
    for kind in CHANNEL_VALUES:  # each group of inputs (one per row: the whole axis) times its scale
        if kind in parts:
            q, scale = parts[kind].astype(jnp.float32), parts["scale"]
            a = q.ndim + INPUT_AXIS[short]
            groups = q.reshape(*q.shape[:a], scale.shape[a], -1, *q.shape[a + 1:])
            return (groups * jnp.expand_dims(scale, a + 1)).reshape(q.shape).astype(dtype)
    return dequantize_blocks(parts, INPUT_AXIS[short], dtype)


def dequantize_layer(lp: Mapping[str, Any], dtype) -> dict[str, Any]:
    """One layer's weights with every quantized one dequantized to `dtype` (inside the scan body);
    other entries (plain arrays, palette parts) pass through."""
    return {k: _dequantize(v, k, dtype) if is_quantized(v) else v for k, v in lp.items()}


def quantize_channels(weights: Mapping[str, np.ndarray], kind: str
                      ) -> tuple[dict[str, np.ndarray], dict[str, QuantLayout]]:
    """Host weights with every quantizable stacked layer weight of every stack replaced by 8-bit parts
    of `kind` ("int8" or "fp8": "layers.wqkv.int8", "layers.wqkv.scale"; Llama 4: "moe_layers.wqkv.fp8",
    ...): symmetric, one float32 scale per output channel (absmax over the input axis, over the kind's
    largest value), rounded to the nearest value the kind holds. The layouts are by weight name
    (`wqkv`), as the models take them."""
    top = CHANNEL_MAX[kind]
    out, layouts = dict(weights), {}
    for name in [k for k in weights if k.count(".") == 1 and k.partition(".")[2] in INPUT_AXIS]:
        short = name.partition(".")[2]
        stack = out.pop(name)
        axis = stack.ndim - 1 + INPUT_AXIS[short]  # in one layer's weight
        values = np.empty(stack.shape, CHANNEL_VALUES[kind])
        scales = np.empty(tuple(1 if i == axis + 1 else n for i, n in enumerate(stack.shape)), np.float32)
        for i in range(stack.shape[0]):  # a layer at a time: one layer's float32 copy at most, not the stack's
            w = np.asarray(stack[i], np.float32)
            scale = np.abs(w).max(axis=axis, keepdims=True) / top
            scales[i] = np.where(scale == 0, 1, scale)
            q = np.clip(w / scales[i], -top, top)
            values[i] = np.rint(q) if kind == "int8" else q
        out[f"{name}.{kind}"], out[f"{name}.scale"] = values, scales
        layouts[short] = QuantLayout(kind)
    return out, layouts
