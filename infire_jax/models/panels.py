"""Dense layer weights repacked once into the CPU kernel's panel layout (`cpu_matmul.pack_panels`).

The CPU matmul reads a row-major [K, N] layer slice in runs of 64-512 bytes at a stride of N,
which streams at about half the machine's bandwidth; the same weights as 32-column panels stream
as a few sequential runs (docs/PERFORMANCE.md). This is the engine's counterpart of vLLM's
"process weights after loading": checkpoints and the loaders keep the portable row-major layout,
and the model runner, which owns the placed weights, repacks them for the kernel it will run:
- only off a mesh, where the CPU kernel library is built (for bfloat16, with its AVX512-BF16 dot);
- only the plain (not compressed or quantized) stacked `wqkv`, `wo`, `w_gate_up`, `w_down`.

A repacked weight is a `PanelParams` module in place of its `nnx.Param`, as compressed and
quantized weights are; the layer body hands its panels to the kernel in place, or unpacks one
layer where the kernel does not apply, so a repacked model computes what the plain one does.

Weights kept palette-compressed take the same panels, coded at load (models/palette_kernels.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx
from jaxtyping import Array

from infire_jax.models.xla_options import ONCE_OVER_WEIGHTS
from pallas_kernels import cpu_matmul

# The stacked dense weights that can be repacked, with the leading axes of one layer's weight that
# the activations span (the matmul's K); the rest are N.
INPUT_AXES = {"wqkv": 1, "wo": 2, "w_gate_up": 1, "w_down": 1}
DENSE_RANK = {"wqkv": 4, "wo": 3, "w_gate_up": 3, "w_down": 2}  # one dense (not MoE) layer's weight


@dataclasses.dataclass(frozen=True)
class PanelWeight:
    """Panels of a stack (`cpu_matmul.pack_panels`; one layer's inside the scan), and one layer's
    weight shape as the einsums see it (static)."""

    panels: Array
    shape: tuple[int, ...]

    def plain(self) -> Array:
        """One layer's weight in its einsum shape (for a step the kernel does not take)."""
        if self.panels.ndim != 3:
            raise ValueError(f"plain() unpacks one layer's panels, got an array of shape {self.panels.shape}")
        return cpu_matmul.unpack_panels(self.panels).reshape(self.shape)


jax.tree_util.register_dataclass(PanelWeight, data_fields=["panels"], meta_fields=["shape"])


class PanelParams(nnx.Module):
    """One repacked stacked weight: its panels as a parameter, and one layer's plain shape."""

    def __init__(self, panels, shape: tuple[int, ...]):
        self.panels = nnx.Param(panels, axes=("layers", None, None, None))
        self.shape = tuple(shape)

    def arrays(self) -> PanelWeight:
        return PanelWeight(self.panels[...], self.shape)

    def axes(self) -> PanelWeight:
        return PanelWeight(self.panels.axes, self.shape)


def stack_view_shape(name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """A dense stacked weight's [L, K, N] matmul shape, or None if `name` is not one (MoE experts)."""
    if name not in INPUT_AXES or len(shape) != DENSE_RANK[name] + 1:
        return None
    split = 1 + INPUT_AXES[name]
    return shape[0], int(np.prod(shape[1:split])), int(np.prod(shape[split:]))


@functools.partial(jax.jit, static_argnums=1, compiler_options=ONCE_OVER_WEIGHTS)
def pack(w: Array, view: tuple[int, int, int]) -> Array:
    """A stack viewed as [L, K, N] (`view`), as panels."""
    return cpu_matmul.pack_panels(w.reshape(view))


def kernel_layout(graphdef: nnx.GraphDef, state: nnx.State, *, plan) -> tuple[nnx.GraphDef, nnx.State]:
    """The model with its eligible dense layer weights repacked into panels (see the module
    docstring), or unchanged. `state` may be shapes alone (`jax.ShapeDtypeStruct`s). The plain
    arrays of repacked weights are deleted: the runner that calls this owns the weights."""
    if plan is not None:
        return graphdef, state
    model = nnx.merge(graphdef, state)
    layers = getattr(model, "layers", None)
    if not getattr(layers, "takes_panels", False):  # a layer stack whose body reads `PanelWeight`s
        return graphdef, state
    changed = False
    for name in INPUT_AXES:
        var = getattr(layers, name, None)
        if not isinstance(var, nnx.Param):
            continue
        value = var.get_value()
        view = stack_view_shape(name, tuple(value.shape))
        if view is None or not cpu_matmul.panels_apply(jax.ShapeDtypeStruct(view, value.dtype)):
            continue
        layer_shape = tuple(value.shape[1:])
        if isinstance(value, jax.ShapeDtypeStruct):
            panels = jax.eval_shape(pack, value, view)
        else:
            panels = pack(value, view)
            value.delete()
        setattr(layers, name, PanelParams(panels, layer_shape))
        changed = True
    return nnx.split(model) if changed else (graphdef, state)
