"""Stacked weights that quantized matmul kernels read in place: the GPU's Pallas kernels
(pallas_kernels/quant_matmul.py), and the CPU's for GGUF Q4_1 (pallas_kernels/csrc/q4_1_matmul.cc).

Weights kept quantized (quant/resident.py: GGUF Q4_1 / Q8_0, int8 per channel, GPTQ / AWQ int4;
quant/grouped.py: compressed-tensors int4, fp8 blocks, MXFP4) are otherwise dequantized one layer at a
time in the layer body, which writes the layer out in full precision and reads it back: 4-9x the
bytes of the quantized weight. Here the layer body hands a kernel the whole stack and the layer
index instead, and the kernel dequantizes each tile on chip (in registers, on a CPU):
- on a GPU, dense weights in steps of up to `MAX_DENSE_ROWS` tokens (decode-sized; a longer prompt
  chunk dequantizes the layer and takes XLA's GEMM, which amortizes that copy over its rows, as
  vLLM's AWQ path does above 256 tokens), and a MoE layer's experts, plain or quantized, at every
  step size (`grouped_matmul`, each tile of a group's rows reading its expert once), in place of
  moe.py's loop over row tiles;
- on a CPU with the kernel library, Q4_1 dense weights in decode steps (`cpu_matmul.MAX_ROWS`
  tokens), on one device.

`INFIRE_JAX_QUANT_MATMUL=pallas|cpu|xla` and `INFIRE_JAX_MOE_GROUPED=pallas|tiled|ragged_dot`
choose; pallas is the default on a GPU (on one device or inside a mesh's shard_map, on each
device's shard), cpu and tiled on a CPU. Pallas chosen off a GPU runs in interpret mode (tests).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

import jax
from jaxtyping import Array, Float, Int

from infire_jax.errors import ConfigError
from pallas_kernels import cpu_kernels, cpu_matmul, placement
from pallas_kernels.quant_blocks import MAX_TILE_ROWS
from pallas_kernels.quant_matmul import (QuantStack, grouped_matmul, head_matmul, quant_matmul, quant_matmul_parts,
                                         sum_parts, supported)
from pallas_kernels.residual_norm import residual_rms_norm

MAX_DENSE_ROWS = 256
# Plain (unquantized) dense stacks take the kernel in steps of at most one row tile: it reads the
# weights once per row tile, so a wider step would read them several times, where XLA's GEMM copies the
# layer out once (two more passes over it) and then reads it once.
MAX_PLAIN_ROWS = MAX_TILE_ROWS
DENSE_IMPLS = ("pallas", "cpu", "xla")
PLAIN_IMPLS = ("pallas", "xla")
GROUPED_IMPLS = ("pallas", "tiled", "ragged_dot")  # a MoE layer's grouped matmul (models/moe.py)
# How many leading axes of one expert's weight are its inputs: w_gate_up [E, 2, F], w_down [F, E].
EXPERT_INPUTS = {"w_gate_up": 1, "w_down": 1}


def dense_impl() -> str:
    default = "pallas" if placement.platform() == "gpu" else "cpu" if cpu_kernels.on_cpu() else "xla"
    impl = os.environ.get("INFIRE_JAX_QUANT_MATMUL", default)
    if impl not in DENSE_IMPLS:
        raise ConfigError(f"INFIRE_JAX_QUANT_MATMUL={impl!r}; choose one of {DENSE_IMPLS}")
    return impl


def plain_impl() -> str:
    """How a GPU multiplies a decode-sized step by a plain (bf16 / f32) dense layer weight: `pallas`
    (default on a GPU), the kernel reading the layer of the stack in place, or `xla`, XLA's GEMM on the
    layer's slice, which XLA's GPU compiler in jax 0.10.2 copies out of the stack first (the whole
    model, every decode step: docs/PERFORMANCE.md); INFIRE_JAX_DENSE_MATMUL chooses. Off a GPU, `xla`
    (the CPU's own kernels read plain weights: `cpu_matmul`)."""
    impl = os.environ.get("INFIRE_JAX_DENSE_MATMUL", "pallas" if placement.platform() == "gpu" else "xla")
    if impl not in PLAIN_IMPLS:
        raise ConfigError(f"INFIRE_JAX_DENSE_MATMUL={impl!r}; choose one of {PLAIN_IMPLS}")
    return impl


def default_grouped_impl() -> str:
    """`pallas` (the grouped kernel reading the layer's experts in place) on a GPU, `tiled` (moe.py's
    loop over row tiles) elsewhere, unless INFIRE_JAX_MOE_GROUPED says otherwise."""
    impl = os.environ.get("INFIRE_JAX_MOE_GROUPED", "pallas" if placement.platform() == "gpu" else "tiled")
    if impl not in GROUPED_IMPLS:
        raise ConfigError(f"INFIRE_JAX_MOE_GROUPED={impl!r}; choose one of {GROUPED_IMPLS}")
    return impl


def _interpret() -> bool:
    return placement.platform() != "gpu"


@dataclasses.dataclass(frozen=True)
class KernelQuantWeight:
    """A stack viewed as the kernel reads it ([L * X, K / p, N] parts, X = `experts` or 1), and one
    layer's (dense) or one expert's weight shape as the einsums see it (static)."""

    stack: QuantStack
    shape: tuple[int, ...]
    experts: int = 0  # experts (or heads) a layer (0: a dense stack)
    kernel: str = "pallas"  # or "cpu" (Q4_1 dense stacks)
    heads: bool = False  # a stack of per-head matrices [L * H, K, N] (MLA's W_uk, W_uv)

    def matmul(self, x: Float[Array, "M K"], layer: Int[Array, ""]) -> Float[Array, "M N"]:
        """x @ W[layer] in float32."""
        if self.kernel == "cpu":
            return cpu_matmul.q4_1_matmul(x, self.stack.values, self.stack.scale, self.stack.minimum, layer)
        return quant_matmul(x, self.stack, layer, interpret=_interpret())

    def grouped(self, x: Float[Array, "M K"], group_sizes: Int[Array, "X"], layer: Int[Array, ""]
                ) -> Float[Array, "M N"]:
        """Rows sorted by expert, each times its expert of layer `layer`, in float32."""
        return grouped_matmul(x, group_sizes, self.stack, layer * self.experts, interpret=_interpret())

    @property
    def fuses(self) -> bool:
        """Whether this is a dense stack of the Pallas kernel, whose unsummed partials the fused
        epilogues below take (`residual_norm`, `swiglu_mlp`)."""
        return self.kernel == "pallas" and not self.experts


jax.tree_util.register_dataclass(KernelQuantWeight, data_fields=["stack"],
                                 meta_fields=["shape", "experts", "kernel", "heads"])


def residual_norm(h: Float[Array, "T E"], x: Float[Array, "T K"], w: KernelQuantWeight, layer: Int[Array, ""],
                  norm: Float[Array, "L E"], eps: float) -> tuple[Float[Array, "T E"], Float[Array, "T E"]]:
    """h + x @ W[layer] and its RMSNorm with `norm[layer]`, in h's dtype: the matmul's K-split partials
    summed, added and normed by one kernel (pallas_kernels/residual_norm.py) where XLA launches two."""
    return residual_rms_norm(h, quant_matmul_parts(x, w.stack, layer, interpret=_interpret()), norm, layer, eps,
                             interpret=_interpret())


def swiglu_mlp(x: Float[Array, "T E"], gate_up: KernelQuantWeight, down: KernelQuantWeight,
               layer: Int[Array, ""]) -> Float[Array, "T E"]:
    """down(silu(gate) * up) of x, float32: the down projection's kernel forms silu(gate) * up from
    the gate/up projection's partials as it loads them, where XLA would launch a kernel for it."""
    parts = quant_matmul_parts(x, gate_up.stack, layer, interpret=_interpret())
    return sum_parts(quant_matmul_parts(parts, down.stack, layer, interpret=_interpret(), swiglu_dtype=x.dtype),
                     x.shape[0])


@dataclasses.dataclass(frozen=True)
class LayerExperts:
    """A MoE layer's experts for the grouped kernel: the whole stack and this layer's index."""

    weight: KernelQuantWeight
    layer: Int[Array, ""]

    @property
    def num_experts(self) -> int:
        return self.weight.experts

    def grouped(self, x: Float[Array, "M K"], group_sizes: Int[Array, "X"]) -> Float[Array, "M N"]:
        return self.weight.grouped(x, group_sizes, self.layer)


jax.tree_util.register_dataclass(LayerExperts, data_fields=["weight", "layer"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class LayerHeads:
    """A layer's per-head matrices for `head_matmul`: the whole stack [L * H, K, N] and this layer's index."""

    weight: KernelQuantWeight
    layer: Int[Array, ""]

    def matmul(self, x: Float[Array, "T H K"]) -> Float[Array, "T H N"]:
        """Head h's rows times its matrix of this layer, float32."""
        heads = self.weight.experts
        return head_matmul(x, self.weight.stack, self.layer * heads, interpret=_interpret())


jax.tree_util.register_dataclass(LayerHeads, data_fields=["weight", "layer"], meta_fields=[])


def _stack(value: Array | Mapping[str, Array], lead: int, inputs: int, plain: bool) -> QuantStack | None:
    """`value` ([lead axes, input axes, output axes], the last input axis shortened in the parts) viewed
    as the kernel's [S, K / p, N] parts, or None for a form it does not read (act-order int4, palette
    codes; plain arrays unless `plain`)."""

    def flat(a: Array) -> Array:
        s = a.shape
        return a.reshape(math.prod(s[:lead]), math.prod(s[lead:lead + inputs]), math.prod(s[lead + inputs:]))

    if not isinstance(value, Mapping):  # plain floats only: not palette codes or CPU panels
        floats = isinstance(value, jax.Array) and jax.numpy.issubdtype(value.dtype, jax.numpy.floating)
        return QuantStack(flat(value)) if plain and floats else None

    def part(name: str) -> Array:
        return flat(value[name])

    if "q4_1" in value:
        return QuantStack(part("q4_1"), part("d"), minimum=part("m"), packing="q4_1")
    if "q8_0" in value:
        return QuantStack(part("q8_0"), part("d"))
    if "int8" in value:
        return QuantStack(part("int8"), part("scale"))
    if "q4" in value and "g_idx" not in value:
        return QuantStack(part("q4"), part("scale"), part("zero"), packing="int4")
    if "packed" in value:  # compressed-tensors: stored q + 8
        return QuantStack(part("packed"), part("scale"), packing="int4", zero_point=8)
    if "fp8" in value:
        return QuantStack(part("fp8"), part("scale"))
    if "fp4" in value:  # MXFP4 (gpt-oss's experts): bytes of two e2m1 codes, uint8 e8m0 scales
        return QuantStack(part("fp4"), part("scale"), packing="mxfp4")
    return None


def _plain_shape(value: Array | Mapping[str, Array], lead: int, inputs: int, stack: QuantStack) -> tuple[int, ...]:
    """One layer's (or expert's) weight shape: the parts' with the last input axis whole again."""
    any_part = value if not isinstance(value, Mapping) else next(iter(value.values()))
    shape = list(any_part.shape[lead:])
    shape[inputs - 1] = stack.num_inputs // math.prod(shape[:inputs - 1])
    return tuple(shape)


def _cpu_reads(stack: QuantStack) -> bool:
    """Whether the CPU kernel reads `stack` here: Q4_1 blocks, K a multiple of 32 and N of 16, on a
    CPU with AVX-512."""
    return (stack.packing == "q4_1" and stack.num_inputs % 32 == 0 and stack.num_outputs % 16 == 0
            and cpu_matmul.q4_1_kernel())


def kernel_stacks(weights: Mapping[str, Any], tokens: int, dense_inputs: Mapping[str, int],
                  expert_inputs: Mapping[str, int] | None = None, one_device: bool = True,
                  head_inputs: Mapping[str, int] | None = None) -> dict[str, KernelQuantWeight]:
    """The stacks of `weights` ([L, ...] each) that the kernels take for a step of `tokens` tokens.

    `dense_inputs[name]`: how many leading axes of one layer's dense weight are inputs (K), for the
    quantized dense stacks (INFIRE_JAX_QUANT_MATMUL's choice: pallas for at most MAX_DENSE_ROWS
    tokens, cpu for Q4_1 stacks in decode steps on `one_device`), and the plain ones in steps of at
    most MAX_PLAIN_ROWS tokens where `plain_impl` is pallas. `expert_inputs` likewise for a MoE
    layer's expert stacks [L, X, ...], plain or quantized, given when the grouped matmul is the
    kernel (moe.py); they are taken together or not at all (palette-coded experts stay with the loop
    over row tiles). `head_inputs` likewise for plain per-head stacks [L, H, ...] (`head_matmul`),
    taken where the plain dense ones are.
    """
    impl, out = dense_impl(), {}
    plain = tokens <= MAX_PLAIN_ROWS and plain_impl() == "pallas"
    for name, inputs in dense_inputs.items():
        value = weights.get(name)
        stack = None if value is None else _stack(value, 1, inputs, plain=plain)
        if stack is None:
            continue
        if impl == "pallas" and tokens <= MAX_DENSE_ROWS and supported(stack):
            out[name] = KernelQuantWeight(stack, _plain_shape(value, 1, inputs, stack))
        elif impl == "cpu" and one_device and tokens <= cpu_matmul.MAX_ROWS and _cpu_reads(stack):
            out[name] = KernelQuantWeight(stack, _plain_shape(value, 1, inputs, stack), kernel="cpu")
    for name, inputs in (head_inputs or {}).items() if plain else ():
        value = weights.get(name)
        stack = None if value is None or isinstance(value, Mapping) else _stack(value, 2, inputs, plain=True)
        if stack is not None and supported(stack):
            out[name] = KernelQuantWeight(stack, _plain_shape(value, 2, inputs, stack), value.shape[1], heads=True)
    experts = {}
    for name, inputs in (expert_inputs or {}).items():
        value = weights[name]
        stack = _stack(value, 2, inputs, plain=True)
        if stack is None or not supported(stack):
            return out
        experts[name] = KernelQuantWeight(stack, _plain_shape(value, 2, inputs, stack),
                                          jax.tree.leaves(value)[0].shape[1])
    return {**out, **experts}


def layer_stacks(weights: Mapping[str, Any], tokens: int, dense_inputs: Mapping[str, int], moe: bool,
                 one_device: bool, head_inputs: Mapping[str, int] | None = None
                 ) -> dict[str, tuple[KernelQuantWeight, tuple[int, ...]]]:
    """A decoder stack's weights that the kernels read in place for a step of `tokens` tokens, as
    (the stack as read, one layer's weight shape): its quantized dense weights (`dense_inputs`, the
    expert weights left out in a MoE stack, its router added: XLA's GEMM copied the router's slice out
    of the stack every decode step), its plain per-head ones (`head_inputs`) and, where the grouped
    matmul is the kernel, a MoE stack's experts."""
    dense = {k: v for k, v in dense_inputs.items() if not (moe and k in EXPERT_INPUTS)}
    if moe:
        dense["router"] = 1
    experts = EXPERT_INPUTS if moe and default_grouped_impl() == "pallas" else None
    stacks = kernel_stacks(weights, tokens, dense, experts, one_device=one_device, head_inputs=head_inputs)
    return {name: (kw, kw.shape) for name, kw in stacks.items()}
