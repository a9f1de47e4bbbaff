"""Palette-compressed dense weights decoded by the matmul kernels themselves
(infire_jax/models/palette_kernels.py): the CPU kernel (`cpu_matmul.palette_matmul`, panels) bitwise
against the panel matmul of the decoded weights, the GPU kernel (`pallas_kernels.palette_matmul`,
tiles; Pallas interpret mode here) against float64, and models coded for either against the plain
bfloat16 model. The engine-level check is tests/test_compression.py (bitwise the bfloat16 engine).
Every test runs on the CPU device (the `cpu_device` fixture), a GPU machine's too: the CPU kernel
where it is, the GPU kernel in interpret mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from h100 import compiled_kernels, launches

from infire_jax.compression.resident import PaletteParams, compress_resident
from infire_jax.compression.tiles import encode_tile_stack
from infire_jax.models import registry
from infire_jax.models.palette_kernels import (PANELS, TILES, KernelPaletteParams, KernelPaletteWeight, panel_coding,
                                               tile_coding)
from infire_jax.models.registry import build_state
from pallas_kernels import cpu_matmul
from pallas_kernels import palette_matmul as gpu_palette
from test_cpu_matmul import needs_bf16_dot
from test_cpu_panels import CFG, DENSE, _two_steps

pytestmark = pytest.mark.usefixtures("cpu_device")


def _coded(w: np.ndarray, kernel: str) -> KernelPaletteWeight:
    """`w` [L, K, N] as the engine codes a resident w_down for `kernel` (`compress_resident`)."""
    coding = {PANELS: panel_coding, TILES: tile_coding}[kernel]
    parts, layouts = compress_resident({"layers.w_down": w}, {"layers.w_down": ("layers", "mlp", "embed")}, ("mlp",),
                                       None, kernel_coding=lambda name, a: (coding(name, a), kernel))
    assert layouts["w_down"].kernel == kernel
    return KernelPaletteWeight(**{p.rsplit(".", 1)[1]: jnp.asarray(a) for p, a in parts.items()},
                               shape=tuple(w.shape[1:]), kernel=kernel)


def _with_specials(w: np.ndarray) -> np.ndarray:
    """±0, subnormals, infinities, a NaN, every exponent (escapes), and a panel of rare exponents whose
    escape list is the longest, so it fills the capacity and has no sentinel, planted in a bfloat16 stack."""
    bits = w.view(np.uint16).copy()
    bits[0, 0, :4] = [0x0000, 0x8000, 0x0001, 0x807F]
    bits[0, 1, :3] = [0x7F80, 0xFF80, 0x7FC1]
    bits[1, 2:4, :256] = (np.arange(256, dtype=np.uint16) << 7 | 0x0035).reshape(1, 256).repeat(2, 0)
    bits[2, :, 32:64] = (np.arange(bits.shape[1], dtype=np.uint16)[:, None] % 60 + 150) << 7
    return bits.view(w.dtype)


def _stack(rng, k: int, n: int) -> np.ndarray:
    return (rng.standard_normal((3, k, n)) * 0.02).astype(np.float32).astype(jnp.bfloat16)


def _within_float64(got: np.ndarray, x: jax.Array, w: np.ndarray) -> None:
    xf, wf = np.asarray(x, np.float64), np.asarray(w, np.float64)
    want, scale = xf @ wf, np.abs(xf) @ np.abs(wf)
    assert np.all(np.abs(got - want) <= 1e-6 * scale + 1e-30), float(np.max(np.abs(got - want) / scale))


@needs_bf16_dot
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("k,n", [(576, 960), (512, 288)])
def test_cpu_palette_matmul_is_the_panel_matmul_of_the_decoded_weights(rows, k, n):
    """Each row-tile path (1 x 4 panels, 4 x 2, 8 x 1 decoded in registers; prompts through a decoded
    panel): the products are bitwise `panel_matmul`'s on the uncompressed panels, for finite weights
    within float64's bound, and with ±0, subnormals, inf, NaN and escape runs too; one layer decodes
    (`plain`) to its weights bit for bit."""
    rng = np.random.default_rng(rows * 7 + k)
    x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32)).astype(jnp.bfloat16)
    finite = _stack(rng, k, n)
    call, plain_call = jax.jit(cpu_matmul.palette_matmul), jax.jit(cpu_matmul.panel_matmul)
    for w in (finite, _with_specials(finite)):
        coded = _coded(w, PANELS)
        panels = cpu_matmul.pack_panels(jnp.asarray(w))
        for layer in range(3):
            got = np.asarray(call(x, *coded.parts(), jnp.int32(layer)))
            np.testing.assert_array_equal(got.view(np.uint32),
                                          np.asarray(plain_call(x, panels, jnp.int32(layer))).view(np.uint32))
            one = jax.tree.map(lambda a, layer=layer: a[layer], coded)
            np.testing.assert_array_equal(np.asarray(one.plain()).view(np.uint16), w[layer].view(np.uint16))
            if w is finite:
                _within_float64(got, x, w[layer])


def test_cpu_palette_matmul_refuses_what_it_cannot_take():
    codes = jnp.zeros((1, 1, 8, 32), jnp.uint8)
    args = (codes, jnp.zeros((1, 1, 8, 64), jnp.uint8), jnp.zeros((1, 16), jnp.uint8),
            jnp.full((1, 1, 1), 8, jnp.int32), jnp.zeros((1, 1, 1, 64), jnp.uint8), jnp.int32(0))
    with pytest.raises(ValueError, match="takes bfloat16 x"):
        cpu_matmul.palette_matmul(jnp.zeros((2, 16), jnp.float32), *args)
    with pytest.raises(ValueError, match="x has 32 features but the codes"):
        cpu_matmul.palette_matmul(jnp.zeros((2, 32), jnp.bfloat16), *args)


@pytest.mark.parametrize("rows", [1, 17])
def test_gpu_palette_matmul_reads_one_layer_of_a_stack(rows):
    """The Pallas kernel (interpret mode) given the whole stack and a layer index: each layer's
    product within float64's bound of its own weights, with a palette and escape lists per layer; the
    jnp decoder of one layer (steps over MAX_ROWS) gives its weights bit for bit, specials included;
    a weight that is not whole tiles is left to the layer body."""
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 128)).astype(np.float32)).astype(jnp.bfloat16)
    w = _stack(rng, 128, 320)
    w[1] *= 64  # another palette in layer 1
    coded = _coded(w, TILES)
    assert int((np.asarray(coded.esc_rows) < 64).sum()) > 0
    for layer in range(3):
        got = np.asarray(gpu_palette.palette_matmul(x, *coded.parts(), jnp.int32(layer), interpret=True))
        _within_float64(got, x, w[layer])
        one = jax.tree.map(lambda a, layer=layer: a[layer], coded)
        np.testing.assert_array_equal(np.asarray(one.plain()).view(np.uint16), w[layer].view(np.uint16))
    specials = _with_specials(_stack(rng, 128, 320))
    one = jax.tree.map(lambda a: a[2], _coded(specials, TILES))
    np.testing.assert_array_equal(np.asarray(one.plain()).view(np.uint16), specials[2].view(np.uint16))
    with pytest.raises(ValueError, match="at most 64 rows"):
        gpu_palette.palette_matmul(jnp.zeros((65, 128), jnp.bfloat16), *coded.parts(), jnp.int32(0), interpret=True)
    assert tile_coding("w_down", w[:, :100]) is None  # not whole tiles: decoded in the layer body instead
    with pytest.raises(ValueError, match="does not split into 64 x 64 tiles"):
        encode_tile_stack(w[:, :100], name="w_down")


@pytest.mark.parametrize("rows", [1, 64])
def test_gpu_palette_matmul_compiles_for_an_h100(rows):
    """The kernel compiles to sm_90a machine code on this CPU machine (tests/h100.py): its tiles fit an
    H100's shared memory and registers, at one row and at the most it takes."""
    coded = _coded(_stack(np.random.default_rng(0), 512, 1024), TILES)
    x = jax.ShapeDtypeStruct((rows, 512), jnp.bfloat16)
    kernels = compiled_kernels(jax.jit(gpu_palette.palette_matmul), x, *coded.parts(), jnp.int32(1))
    assert launches(kernels, "palette_matmul"), kernels


def _resident(monkeypatch, coding) -> tuple[nnx.Module, nnx.Module]:
    """The plain bfloat16 model and the same weights compressed (mlp, attn) with `coding` at load."""
    monkeypatch.setattr(registry, "kernel_coding", coding)
    plain = nnx.merge(*build_state(CFG, None, jnp.bfloat16, seed=0))
    weights = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(plain))}
    return plain, nnx.merge(*build_state(CFG, weights, jnp.bfloat16, compress=("mlp", "attn")))


def test_a_resident_compressed_model_takes_the_cpu_kernel_where_it_runs(monkeypatch):
    """Coded at load for the CPU kernel where it runs (else in their own layout, decoded in the layer
    body), the steps' logits are bitwise the bfloat16 model's."""
    plain, model = _resident(monkeypatch, registry.kernel_coding)
    for name in DENSE:
        got = getattr(model.layers, name)
        if cpu_matmul.palette_kernel():
            assert isinstance(got, KernelPaletteParams) and got.kernel == PANELS
        else:
            assert type(got) is PaletteParams
    for got, want in zip(_two_steps(model, jnp.bfloat16), _two_steps(plain, jnp.bfloat16)):
        np.testing.assert_array_equal(got, want)


def test_a_model_coded_for_the_gpu_kernel_computes_the_bfloat16_model(monkeypatch):
    """Coded for the GPU kernel (what a GPU's `kernel_coding` picks; Pallas interpret mode here): the
    steps' logits are the bfloat16 model's up to bfloat16 rounding of differently ordered sums, and
    with the kernel's row limit below the step, where each layer is decoded in the layer body, bitwise."""
    plain, model = _resident(monkeypatch, lambda name, w: (tile_coding(name, w), TILES))
    assert all(getattr(model.layers, name).kernel == TILES for name in DENSE)
    want = _two_steps(plain, jnp.bfloat16)
    for got, ref in zip(_two_steps(model, jnp.bfloat16), want):
        np.testing.assert_allclose(got, ref, rtol=0.02, atol=0.02 * float(np.abs(ref).max()))
    monkeypatch.setattr(gpu_palette, "MAX_ROWS", 16)
    for got, ref in zip(_two_steps(model, jnp.bfloat16), want):
        np.testing.assert_array_equal(got, ref)
