"""Weights kept palette-compressed in device memory and decoded one layer at a time.

A compressed stacked weight is a `PaletteParams` module in place of its `nnx.Param`: its parts
keep the weight's logical axes (codes halve the last axis; escape lists have one block per shard
along each sharded axis and one per layer), so they shard exactly like the weight and each device
decodes its own shard. The scanned layer body decodes the current layer's weights just before
use (`decode_layer`), so at most one layer is ever held as bfloat16, never the whole model.
On one device the dense stacks are coded for a matmul kernel that decodes them itself instead, where
one applies (`compress_resident`'s `kernel_coding`, models/palette_kernels.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array

from infire_jax.compression import KINDS, as_bf16, parse_kinds, selected
from infire_jax.compression.palette import PALETTE_SIZE, ROW, PaletteTensor, decode_palette_block, encode_palette
from infire_jax.errors import ConfigError
from infire_jax.quant.weight_parts import WeightParts

RESIDENT_FORMATS = ("palette",)
RESIDENT_KINDS = ("mlp", "attn")  # stacked layer weights; the embedding is read whole every step


@dataclasses.dataclass(frozen=True)
class ResidentLayout:
    """What a compressed weight's abstract shapes need beyond the weight: its grid and escape
    capacity, and the matmul kernel whose arrangement it is coded in, if any (models/palette_kernels.py)."""

    grid: tuple[int, ...]
    capacity: int
    kernel: str | None = None


def parse_resident(spec: str) -> tuple[str, tuple[str, ...]]:
    """`"palette"` or `"palette:mlp,attn"` -> (format, kinds); ValueError naming the problem."""
    fmt, _, kinds = spec.partition(":")
    if fmt not in RESIDENT_FORMATS:
        raise ValueError(f"unknown weights compression {fmt!r}; choose from {list(RESIDENT_FORMATS)}")
    parsed = parse_kinds(kinds or None)
    bad = [k for k in parsed if k not in RESIDENT_KINDS]
    if bad:
        raise ValueError(f"resident compression covers {list(RESIDENT_KINDS)} weights, not {bad}")
    return fmt, parsed


class PaletteParams(WeightParts):
    """The parts of one palette-coded stacked weight, each a parameter with logical axes."""

    def __init__(self, shape: tuple[int, ...], axes: tuple[str | None, ...], layout: ResidentLayout):
        def part(part_shape, part_axes, dtype):
            return nnx.Param(jnp.zeros(part_shape, dtype), axes=tuple(part_axes), init="zeros")

        self.palette = part((shape[0], PALETTE_SIZE), (axes[0], None), jnp.uint8)
        self.codes = part((*shape[:-1], shape[-1] // 2), axes, jnp.uint8)
        self.sign_mantissa = part(shape, axes, jnp.uint8)
        self.esc_rows = part((*layout.grid, layout.capacity), (*axes, None), jnp.int32)
        self.esc_exp = part((*layout.grid, layout.capacity, ROW), (*axes, None, None), jnp.uint8)


def grid_for(shape: tuple[int, ...], axes: tuple[str | None, ...], plan) -> tuple[int, ...]:
    """One block per layer, and per shard along each axis the plan splits."""
    grid = [shape[0]]
    for name in axes[1:]:
        mesh_axis = plan.axis(name) if plan is not None and name else None
        grid.append(plan.sizes[mesh_axis] if mesh_axis else 1)
    return tuple(grid)


def compress_resident(weights: Mapping[str, np.ndarray], axes: Mapping[str, tuple[str | None, ...]],
                      kinds: tuple[str, ...], plan,
                      kernel_coding: Callable[[str, np.ndarray], tuple[PaletteTensor, str] | None] | None = None
                      ) -> tuple[dict[str, np.ndarray], dict[str, ResidentLayout]]:
    """Host weights with the selected ones replaced by their palette parts ("layers.w_down.codes",
    ...), and each compressed weight's layout by short name, for the abstract model.

    `kernel_coding(short name, weight)` codes a weight for a matmul kernel that decodes it itself
    and names that kernel, or gives None (models/palette_kernels.py); other weights are coded in
    their own layout, to be decoded in the layer body."""
    names = selected(list(weights), kinds)
    if not names:
        raise ConfigError(f"weights_compression covers {sorted(n for k in kinds for n in KINDS[k])}, and this "
                          "model has none of them (its layer stacks are not models/llama.py's)")
    out = dict(weights)
    layouts = {}
    for name in names:
        short = name.split(".", 1)[1]
        w = as_bf16(out.pop(name))
        coded = kernel_coding(short, w) if kernel_coding is not None else None
        t, kernel = coded if coded is not None else (
            encode_palette(w, stacked=True, grid=grid_for(w.shape, axes[name], plan), name=name), None)
        out.update({f"{name}.{part}": a for part, a in t.arrays().items()})
        layouts[short] = ResidentLayout(t.grid, t.esc_rows.shape[-1], kernel)
    return out, layouts


def resident_layouts(graphdef: nnx.GraphDef, state: nnx.State) -> dict[str, ResidentLayout]:
    """Each palette-coded layer weight's layout, by short name, read back from a placed model (what a
    checkpoint of it must record to be restored: the escape capacity depends on the weights)."""
    layouts = {}
    for path, node in nnx.iter_graph(nnx.merge(graphdef, state)):
        if isinstance(node, PaletteParams):
            esc = node.esc_rows.get_value()
            layouts[str(path[-1])] = ResidentLayout(tuple(esc.shape[:-1]), esc.shape[-1], getattr(node, "kernel", None))
    return layouts


def decode_layer(lp: Mapping[str, Any]) -> dict[str, Array]:
    """One layer's weights with every palette-coded one decoded to bfloat16 (inside the scan body)."""
    return {k: decode_palette_block(**v) if isinstance(v, Mapping) else v for k, v in lp.items()}
