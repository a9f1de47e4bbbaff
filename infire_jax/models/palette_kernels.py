"""Palette-compressed dense weights coded for a matmul kernel that decodes them itself.

Resident compression (compression/resident.py) decodes a layer's weights in the layer body, which
writes the layer out in bfloat16 and reads it back: more traffic than the plain weights, not less.
Where a kernel can decode in its own registers or on chip, the dense stacks are coded in that
kernel's arrangement instead, so a weight costs its 12 coded bits of memory traffic:
- **panels** (CPU with AVX512-BF16): `cpu_matmul.palette_matmul`, the bfloat16 panels of
  `cpu_matmul.pack_panels` with each run's entries in `PALETTE_ORDER`, one escape list per layer
  and panel; its sums are bitwise those of the plain bfloat16 panels;
- **tiles** (GPU): the Pallas kernel `pallas_kernels.palette_matmul`, [L, K, N] with escape lists
  per layer and 64 x 64 tile (compression/tiles.py).

The choice is made at load (`kernel_coding`, one device only), not by the runner's repacking,
because the escape capacity depends on the data and the abstract model must know it before the
weights arrive. The layer body hands the whole stack and the layer index to the kernel (`InPlace`
in models/llama.py), so no layer of it is ever copied out.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from infire_jax.compression.palette import PaletteTensor, decode_palette_block, encode_palette
from infire_jax.compression.resident import PaletteParams, ResidentLayout
from infire_jax.compression.tiles import decode_tiles, encode_tile_stack
from infire_jax.models.panels import pack, stack_view_shape
from pallas_kernels import cpu_matmul, placement
from pallas_kernels import palette_matmul as gpu_palette

PANELS, TILES = "panels", "tiles"
_STORED_TO_PANEL = np.argsort(cpu_matmul.PALETTE_ORDER)  # a stored panel run back in the panel's order


def panel_coding(name: str, w: np.ndarray) -> PaletteTensor | None:
    """A bfloat16 stack coded as `cpu_matmul.palette_matmul` reads it, or None where it does not fit."""
    view = stack_view_shape(name, tuple(w.shape))
    if view is None or not cpu_matmul.panels_apply(jax.ShapeDtypeStruct(view, jnp.bfloat16)):
        return None
    stored = np.asarray(pack(jnp.asarray(w, jnp.bfloat16), view))[..., cpu_matmul.PALETTE_ORDER]
    return encode_palette(stored, stacked=True, grid=(*stored.shape[:2], 1, 1), name=name)


def tile_coding(name: str, w: np.ndarray) -> PaletteTensor | None:
    """A bfloat16 stack coded as the GPU kernel reads it, or None where it does not fit its tiles."""
    view = stack_view_shape(name, tuple(w.shape))
    if view is None or view[1] % gpu_palette.TILE_N or view[2] % gpu_palette.TILE_N:
        return None
    return encode_tile_stack(np.asarray(w).reshape(view), name=name)


def palette_kernel_here() -> str | None:
    """The kernel that decodes palette weights on this backend (one device), if any."""
    if cpu_matmul.palette_kernel():
        return PANELS
    return TILES if placement.platform() == "gpu" else None


def kernel_coding(name: str, w: np.ndarray) -> tuple[PaletteTensor, str] | None:
    """`name`'s stack coded for the kernel that decodes palette weights on this backend, and which
    (`ResidentLayout.kernel`); None where none applies (then it is decoded in the layer body)."""
    kernel = palette_kernel_here()
    coded = {PANELS: panel_coding, TILES: tile_coding}[kernel](name, w) if kernel else None
    return (coded, kernel) if coded is not None else None


@dataclasses.dataclass(frozen=True)
class KernelPaletteWeight:
    """The palette parts of a stack coded by `kernel_coding` (one layer's inside the scan), and one
    layer's weight shape as the einsums see it and the kernel (static)."""

    codes: Array
    sign_mantissa: Array
    palette: Array
    esc_rows: Array
    esc_exp: Array
    shape: tuple[int, ...]
    kernel: str

    def parts(self) -> tuple[Array, ...]:
        return self.codes, self.sign_mantissa, self.palette, self.esc_rows, self.esc_exp

    def applies(self, tokens: int) -> bool:
        """Whether its kernel takes a step of `tokens` here: the CPU kernel any step where it runs,
        the GPU kernel (in interpret mode off the GPU) steps its accumulators hold."""
        return tokens <= gpu_palette.MAX_ROWS if self.kernel == TILES else cpu_matmul.palette_kernel()

    def matmul(self, x: Float[Array, "M K"], layer: Int[Array, ""]) -> Float[Array, "M N"]:
        """x @ w[layer] in float32, decoded by the kernel."""
        if self.kernel == PANELS:
            return cpu_matmul.palette_matmul(x, *self.parts(), layer)
        return gpu_palette.palette_matmul(x, *self.parts(), layer, interpret=placement.platform() != "gpu")

    def plain(self) -> Array:
        """One layer decoded to its weight in its einsum shape (for a step the kernel does not take)."""
        if self.palette.ndim != 1:
            raise ValueError(f"plain() decodes one layer, got a palette of shape {self.palette.shape}")
        if self.kernel == TILES:
            return decode_tiles(*self.parts()).reshape(self.shape)
        stored = jax.vmap(decode_palette_block, in_axes=(0, 0, None, 0, 0))(*self.parts())  # per panel
        # moved as 16-bit integers: XLA CPU's legacy emitters copy bfloat16 NaNs through float32, losing payloads
        bits = jax.lax.bitcast_convert_type(stored, jnp.uint16)[..., _STORED_TO_PANEL]
        return jax.lax.bitcast_convert_type(cpu_matmul.unpack_panels(bits), stored.dtype).reshape(self.shape)


jax.tree_util.register_dataclass(KernelPaletteWeight, data_fields=["codes", "sign_mantissa", "palette", "esc_rows",
                                                                   "esc_exp"], meta_fields=["shape", "kernel"])


class KernelPaletteParams(PaletteParams):
    """One stack coded by `kernel_coding` (`layout.kernel` names the arrangement), and one layer's
    plain shape."""

    def __init__(self, name: str, shape: tuple[int, ...], layout: ResidentLayout):
        n_layers, k, n = stack_view_shape(name, shape)
        if layout.kernel == PANELS:
            coded, axes = (n_layers, n // cpu_matmul.PANEL, k // 2, 2 * cpu_matmul.PANEL), ("layers", None, None, None)
        elif layout.kernel == TILES:
            coded, axes = (n_layers, k, n), ("layers", None, None)
        else:
            raise ValueError(f"{name}: no palette kernel arrangement {layout.kernel!r}")
        super().__init__(coded, axes, layout)
        self.shape = tuple(shape[1:])
        self.kernel = layout.kernel

    def arrays(self) -> KernelPaletteWeight:
        return KernelPaletteWeight(**super().arrays(), shape=self.shape, kernel=self.kernel)

    def axes(self) -> KernelPaletteWeight:
        return KernelPaletteWeight(**super().axes(), shape=self.shape, kernel=self.kernel)
