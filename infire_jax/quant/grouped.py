"""A published checkpoint's int4 groups, fp8 blocks or MXFP4 blocks kept in device memory, dequantized where they are used.

`weights_quantization="checkpoint"` (loaders/deepseek_quant.py) keeps each quantized linear weight
of a DeepSeek-V3-family checkpoint as published, moved into the model's layout exactly as the float
weight is moved. Both formats are held the same way: quantized values along the weight's input
axis, and one scale per output channel and `group` consecutive inputs.

- int4 (compressed-tensors pack-quantized, Kimi K2/K2.5's routed experts): `packed` int32 words of
  8 consecutive inputs each (low nibble first, stored as q + 8), `scale` in the checkpoint's dtype
  (Kimi: bfloat16); the group is the checkpoint's `group_size`.
- fp8 (DeepSeek-V3): `fp8` float8_e4m3fn values, `scale` float32: the 128 x 128 block's
  `weight_scale_inv` repeated on each of the block's output rows (4 bytes per 128 weights, 3% on
  top of the fp8 bytes), so a weight's output axis can be permuted, reshaped, fused and split
  over tp as the float weight's is.
- mxfp4 (gpt-oss's routed experts, quant/mxfp4.py): `fp4` uint8 bytes of two e2m1 inputs (low
  nibble first), `scale` uint8 e8m0 (2^(s - 127)) per 32 inputs: 4.25 bits a weight. The loader
  moves a checkpoint's `*_blocks` / `*_scales` into the expert layout with `mxfp4.kept_from_hf`.

The parts keep the weight's logical axes with the input axis shortened, so they shard as the
weight does (a shard must hold whole groups: the loader checks). The arithmetic is formats.py's
(a float32 product, then the serving dtype), so a kept weight dequantizes bit for bit to the
weight the load-time dequantizer gives.

The scan body dequantizes one layer's dense weights (attention, dense and shared MLPs: small), but
not its routed experts (Kimi K2.5: 384 x 7168 x 2048 x 3, 34 GB in bf16 a layer): the grouped
matmul (models/moe.py) takes each expert's parts as its row tile reaches it (`expert_weight`), so
at most one expert is ever in full precision. On a GPU the Pallas kernels read the parts in place
instead (models/quant_kernels.py): the experts at every step, the dense weights in decode-sized steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Int, Shaped

from infire_jax.quant import mxfp4
from infire_jax.quant.weight_parts import WeightParts
from pallas_kernels import placement

# The input axis of each DeepSeek layer weight that a checkpoint may quantize, counted from the end:
# wq_a [E, Rq], wq_b [Rq, H, Dq], wkv_a [E, R + Dr], w_uk [H, Dn, R] and w_uv [H, R, Dv] (kv_b's input
# is the latent), wo [H, Dv, E] (groups within a head), w_gate_up [(X,) E, 2, F], w_down [(X,) F, E], and
# the shared ones.
INPUT_AXIS = {"wq_a": -2, "wq_b": -3, "wkv_a": -2, "w_uk": -1, "w_uv": -2, "wo": -2, "w_gate_up": -3,
              "w_down": -2, "w_shared_gate_up": -3, "w_shared_down": -2}
VALUE_PART = {"int4": "packed", "fp8": "fp8", "mxfp4": "fp4"}
ROUTED_EXPERTS = ("w_gate_up", "w_down")  # in a MoE layer, dequantized one expert at a time
_VALUES_PER_ITEM = {"int4": 8, "fp8": 1, "mxfp4": 2}
_VALUE_DTYPE = {"int4": jnp.int32, "fp8": jnp.float8_e4m3fn, "mxfp4": jnp.uint8}


@dataclasses.dataclass(frozen=True)
class GroupedLayout:
    """A kept weight's format: "int4", "fp8" or "mxfp4" (group 32, scale uint8), inputs per scale, and
    the scale's dtype."""

    kind: str
    group: int
    scale_dtype: Any

    def part_shapes(self, name: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], Any]]:
        """Each part's (shape, dtype) for the weight `name` ("moe_layers.w_gate_up") of `shape`;
        ValueError naming the weight unless its input axis is whole groups."""
        axis = len(shape) + INPUT_AXIS[name.rpartition(".")[2]]
        n = shape[axis]
        if self.kind == "mxfp4" and (self.group != mxfp4.BLOCK or jnp.dtype(self.scale_dtype) != jnp.uint8):
            raise ValueError(f"{name}: MXFP4 has one uint8 scale per {mxfp4.BLOCK} inputs, got groups of "
                             f"{self.group} and {jnp.dtype(self.scale_dtype).name} scales")
        if n % self.group:
            raise ValueError(f"{name}: {self.kind} groups of {self.group} inputs do not tile its input axis of {n}")

        def along(m: int) -> tuple[int, ...]:
            return tuple(m if i == axis else s for i, s in enumerate(shape))

        values = _VALUE_DTYPE[self.kind]
        return {VALUE_PART[self.kind]: (along(n // _VALUES_PER_ITEM[self.kind]), values),
                "scale": (along(n // self.group), self.scale_dtype)}


# How a `dummy:` model draws kept parts (models/registry.py): random int4 nibbles (stored q + 8) or FP4
# pairs, and the scale that gives them a float dummy's spread (MXFP4's values have an RMS of 2.9: a
# scale of 2^-7 gives 0.023).
DUMMY_INIT = {"int4": {"packed": "int4-words", "scale": "int4-scale"},
              "mxfp4": {"fp4": "uint8-bits", "scale": "mxfp4-scale"}}


class GroupedParams(WeightParts):
    """The parts of one kept stacked weight, each a parameter with the weight's logical axes."""

    def __init__(self, name: str, shape: tuple[int, ...], axes: tuple[str | None, ...], layout: GroupedLayout):
        for part, (part_shape, dtype) in layout.part_shapes(name, shape).items():
            init = DUMMY_INIT.get(layout.kind, {}).get(part, "zeros")
            setattr(self, part, nnx.Param(jnp.zeros(part_shape, dtype), axes=axes, init=init))


def is_kept(value: Any) -> bool:
    return isinstance(value, Mapping) and "scale" in value and any(p in value for p in VALUE_PART.values())


def dequantize(parts: Mapping[str, Array], short: str, dtype) -> Shaped[Array, "..."]:
    """One kept weight (any leading axes: a layer, or the whole stack) in `dtype`."""
    scale = parts["scale"]
    a = scale.ndim + INPUT_AXIS[short]
    if "fp4" in parts:
        return mxfp4.dequantize_along(parts["fp4"], scale, a, dtype)
    if "packed" in parts:  # nibbles by a broadcast shift on a new axis after the word axis
        words = jnp.expand_dims(parts["packed"], a + 1)
        shifts = (jnp.arange(8, dtype=jnp.int32) * 4).reshape((8,) + (1,) * (scale.ndim - a - 1))
        nibbles = (words >> shifts) & 0xF
        q = (nibbles.reshape(*scale.shape[:a], -1, *scale.shape[a + 1:]) - 8).astype(jnp.float32)
    else:
        q = parts["fp8"].astype(jnp.float32)
    n, groups = q.shape[a], scale.shape[a]
    grouped = q.reshape(*q.shape[:a], groups, n // groups, *q.shape[a + 1:])
    full = grouped * jnp.expand_dims(scale.astype(jnp.float32), a + 1)
    return full.reshape(q.shape).astype(dtype)


def dequantize_kept(lp: Mapping[str, Any], dtype, per_expert: tuple[str, ...] = ()) -> dict[str, Any]:
    """One layer's weights with every kept one dequantized to `dtype` (inside the scan body), except
    those named in `per_expert` (a MoE layer's `ROUTED_EXPERTS`), which stay parts for `expert_weight`."""
    return {k: dequantize(v, k, dtype) if is_kept(v) and k not in per_expert else v for k, v in lp.items()}


def expert_weight(stack: Array | Mapping[str, Array], g: Int[Array, ""], short: str, dtype
                  ) -> Shaped[Array, "..."]:
    """Expert `g` of a stacked expert weight [X, ...]: the float stack's slice as it is, or the kept
    parts' slices dequantized to `dtype`, so only this expert is built in full precision."""
    kept = is_kept(stack)
    if kept or placement.platform() == "cpu":
        # Tied to g, the stack is no longer loop invariant: XLA:CPU widens a bf16 or fp8 slice's whole
        # operand to float32 and would hoist that out of the loop, a float32 copy of every expert each
        # step (plain bf16 experts: 409 MB of temporaries and 14x slower at 8 tokens, docs/PERFORMANCE.md).
        stack, g = jax.lax.optimization_barrier((stack, g))
    return dequantize({p: v[g] for p, v in stack.items()}, short, dtype) if kept else stack[g]
