"""Dense layer weights repacked into the CPU kernel's panels (`cpu_matmul.pack_panels`,
infire_jax/models/panels.py): the layouts against their index formulas, the panel matmul against
float64 (bfloat16: also bitwise against the row-major kernel), and a repacked random Llama against
the same model unpacked; palette-compressed panels against the panel matmul of their weights. The engine-level checks are tests/test_parity.py (float32, against HF) and
tests/test_compression.py's bfloat16 engines, whose model runners repack their plain weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from infire_jax.compression.resident import PaletteParams, compress_resident
from infire_jax.models import llama
from infire_jax.models.config import ModelConfig
from infire_jax.models.panels import (PalettePanelParams, PalettePanelWeight, PanelParams, PanelWeight, kernel_layout,
                                      palette_panels)
from infire_jax.models.registry import abstract_state, build_state
from pallas_kernels import cpu_matmul
from test_cpu_matmul import HAS_BF16, needs_bf16_dot
from test_kernels import build_metadata, device_meta


def _bf16(rng, shape) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(jnp.bfloat16)


def test_panel_layouts_follow_their_index_formulas():
    """bfloat16: panels[l, p, j, 32 v + 2 lane + i] = w[l, 2 j + i, 32 p + 16 v + lane]; float32:
    panels[l, p, k, c] = w[l, k, 32 p + c]; unpacking (a stack or one layer) gives w back. Plain jnp,
    so it runs anywhere."""
    w = np.arange(2 * 6 * 64, dtype=np.float32).reshape(2, 6, 64)
    bits = jax.lax.bitcast_convert_type(jnp.asarray(w.astype(np.uint16)), jnp.bfloat16)  # distinct values
    panels = np.asarray(jax.lax.bitcast_convert_type(cpu_matmul.pack_panels(bits), jnp.uint16)).astype(np.float32)
    assert panels.shape == (2, 2, 3, 64)
    for l, p, j, v, lane, i in np.ndindex(2, 2, 3, 2, 16, 2):
        assert panels[l, p, j, 32 * v + 2 * lane + i] == w[l, 2 * j + i, 32 * p + 16 * v + lane]
    f32 = np.asarray(cpu_matmul.pack_panels(jnp.asarray(w)))
    assert f32.shape == (2, 2, 6, 32)
    for l, p, k, c in np.ndindex(*f32.shape):
        assert f32[l, p, k, c] == w[l, k, 32 * p + c]
    for stack in (bits, jnp.asarray(w)):
        packed = cpu_matmul.pack_panels(stack)
        np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack_panels(packed)), np.asarray(stack))
        np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack_panels(packed[1])), np.asarray(stack[1]))


def _skip_without_kernel(dtype: str) -> None:
    if dtype == "bfloat16" and not HAS_BF16:
        pytest.skip("this CPU has no AVX512-BF16 instruction")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (2, 32), (64, 224), (128, 544)])
def test_panel_matmul_matches_float64(rows, k, n, dtype):
    """Every row-tile size and remainder (1 x 8 panels, 4 x 3, 8 x 1, 12 x 1), panel counts that leave
    narrower tiles, the first and last layer; float64 of the exact values bounds it, a row's result
    does not depend on the rest of the batch, and bfloat16 is bitwise the row-major kernel's result
    (the same sums in the same order)."""
    _skip_without_kernel(dtype)
    rng = np.random.default_rng(rows * 131 + n)
    x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32)).astype(dtype)
    w = jnp.asarray(rng.standard_normal((3, k, n)).astype(np.float32)).astype(dtype)
    panels = jax.jit(cpu_matmul.pack_panels)(w)
    call = jax.jit(cpu_matmul.panel_matmul)
    for layer in (0, 2):
        got = np.asarray(call(x, panels, jnp.int32(layer)))
        if dtype == "bfloat16":
            np.testing.assert_array_equal(got, np.asarray(jax.jit(cpu_matmul.skinny_matmul)(x, w, jnp.int32(layer))))
        xf, wf = np.asarray(x.astype(jnp.float32), np.float64), np.asarray(w[layer].astype(jnp.float32), np.float64)
        want, scale = xf @ wf, np.abs(xf) @ np.abs(wf)
        assert np.all(np.abs(got - want) <= 1e-6 * scale + 1e-30), float(np.max(np.abs(got - want) / scale))
    np.testing.assert_array_equal(np.asarray(call(x[-1:], panels, jnp.int32(2)))[0], got[-1])


def test_panel_matmul_refuses_what_it_would_round():
    panels = cpu_matmul.pack_panels(jnp.zeros((1, 64, 32), jnp.float32))
    with pytest.raises(ValueError, match="both bfloat16 or both float32"):
        cpu_matmul.panel_matmul(jnp.zeros((2, 64), jnp.bfloat16), panels, jnp.int32(0))
    with pytest.raises(ValueError, match="x has 32 features but the panels hold 64"):
        cpu_matmul.panel_matmul(jnp.zeros((2, 32), jnp.float32), panels, jnp.int32(0))


CFG = ModelConfig(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=8, num_kv_heads=2, head_dim=32)
DENSE = ("wqkv", "wo", "w_gate_up", "w_down")


def _two_steps(model: nnx.Module, dtype) -> list[np.ndarray]:
    """Logits of two engine-like steps: two prompt chunks, then a decode beside a chunk and a new prompt."""
    ps, width, num_pages, num_tokens, num_rows = 8, 6, 16, 32, 4
    pages = [[3, 7, 1], [12, 5, 9, 2], [14, 6]]
    steps = [((0, 11), (0, 17)), ((11, 1), (17, 9), (0, 6))]
    tokens = np.random.default_rng(7).integers(0, CFG.vocab_size, (len(steps), num_tokens))
    kv = (jnp.zeros((CFG.num_layers, num_pages, ps, CFG.num_kv_heads, CFG.head_dim), dtype),) * 2
    out = []
    for rows, step_tokens in zip(steps, tokens):
        meta = build_metadata(rows, pages[:len(rows)], num_tokens=num_tokens, num_rows=num_rows, page_size=ps,
                              width=width)
        last = np.where(np.arange(num_rows) < len(rows), np.maximum(meta.cu_q_lens[1:] - 1, 0), 0)
        logits, kv = model(jnp.asarray(step_tokens), kv, device_meta(meta), jnp.asarray(last), attn_impl="reference")
        out.append(np.asarray(logits)[:len(rows)])
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_repacked_model_computes_what_the_plain_one_does(dtype):
    """The runner's repacking: the four dense stacks become panels (their plain arrays deleted: the
    runner owns them); the steps' logits are the plain model's (bitwise in bfloat16, where both
    paths sum in the same order; to float32 rounding in float32, where the plain model's steps of
    32 tokens take XLA's dot); the abstract layout is the one the weights get (what
    `attach_weights` checks); and a layer whose panels the kernel does not take unpacks to the plain
    weight."""
    _skip_without_kernel(dtype)
    plain = nnx.merge(*build_state(CFG, None, dtype, seed=0))
    graphdef, state = build_state(CFG, None, dtype, seed=0)
    originals = [getattr(nnx.merge(graphdef, state).layers, name)[...] for name in DENSE]
    packed_graphdef, packed_state = kernel_layout(graphdef, state, plan=None)
    packed = nnx.merge(packed_graphdef, packed_state)
    assert all(isinstance(getattr(packed.layers, name), PanelParams) for name in DENSE)
    assert all(a.is_deleted() for a in originals)
    for got, want in zip(_two_steps(packed, dtype), _two_steps(plain, dtype)):
        if dtype == "bfloat16":
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    abstract = kernel_layout(*abstract_state(CFG, dtype, None), plan=None)
    assert abstract[0] == packed_graphdef
    assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract[1]) == \
        jax.tree.map(lambda a: (a.shape, a.dtype), packed_state)

    weights = packed.layers.arrays()
    lp = llama.kernel_weights({name: PanelWeight(weights[name].panels[1], weights[name].shape) for name in DENSE},
                              None, jnp.int32(1), 8)
    for name in DENSE:
        np.testing.assert_array_equal(np.asarray(lp[name]), np.asarray(getattr(plain.layers, name)[...][1]))


def test_only_a_model_off_a_mesh_with_the_kernel_is_repacked():
    for dtype in (jnp.float32, jnp.bfloat16):
        graphdef, state = build_state(CFG, None, dtype, seed=0)
        assert (kernel_layout(graphdef, state, plan=None)[0] != graphdef) == cpu_matmul.panel_kernel(dtype)
        graphdef, state = build_state(CFG, None, dtype, seed=0)
        assert kernel_layout(graphdef, state, plan=object())[0] == graphdef


# ---- palette-compressed panels (issue 10): decoded in registers by `palette_matmul` ------------------

def _palette_panel_weight(w: np.ndarray, kinds=("mlp",)) -> tuple[PalettePanelWeight, dict]:
    """`w` [L, K, N] as the engine codes a resident w_down: `compress_resident` with the kernel's panels."""
    parts, layouts = compress_resident({"layers.w_down": w}, {"layers.w_down": ("layers", "mlp", "embed")}, kinds,
                                       None, panels=palette_panels)
    assert layouts["w_down"].panels
    return PalettePanelWeight(**{p.rsplit(".", 1)[1]: jnp.asarray(a) for p, a in parts.items()},
                              shape=tuple(w.shape[1:])), layouts


def _with_specials(w: np.ndarray) -> np.ndarray:
    """±0, subnormals, infinities, a NaN, every exponent (escapes), and a panel of rare exponents whose
    escape list is the longest, so it fills the capacity and has no sentinel, planted in a bfloat16 stack."""
    bits = w.view(np.uint16).copy()
    bits[0, 0, :4] = [0x0000, 0x8000, 0x0001, 0x807F]
    bits[0, 1, :3] = [0x7F80, 0xFF80, 0x7FC1]
    bits[1, 2:4, :256] = (np.arange(256, dtype=np.uint16) << 7 | 0x0035).reshape(1, 256).repeat(2, 0)
    bits[2, :, 32:64] = (np.arange(bits.shape[1], dtype=np.uint16)[:, None] % 60 + 150) << 7
    return bits.view(w.dtype)


@needs_bf16_dot
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("k,n", [(576, 960), (512, 288)])
def test_palette_matmul_is_the_panel_matmul_of_the_decoded_weights(rows, k, n):
    """Each row-tile path (1 x 4 panels, 4 x 2, 8 x 1 decoded in registers; prompts through a decoded
    panel): the products are bitwise `panel_matmul`'s on the uncompressed panels, for finite weights
    within float64's bound, and with ±0, subnormals, inf, NaN and escape runs (including a panel that
    is all escapes) too; one layer decodes (`plain`) to its weights bit for bit."""
    rng = np.random.default_rng(rows * 7 + k)
    x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32)).astype(jnp.bfloat16)
    finite = (rng.standard_normal((3, k, n)) * 0.02).astype(np.float32).astype(jnp.bfloat16)
    call, plain_call = jax.jit(cpu_matmul.palette_matmul), jax.jit(cpu_matmul.panel_matmul)
    for w in (finite, _with_specials(finite)):
        coded, _ = _palette_panel_weight(w)
        panels = cpu_matmul.pack_panels(jnp.asarray(w))
        for layer in range(3):
            got = np.asarray(call(x, *coded.parts(), jnp.int32(layer)))
            np.testing.assert_array_equal(got.view(np.uint32),
                                          np.asarray(plain_call(x, panels, jnp.int32(layer))).view(np.uint32))
            one = jax.tree.map(lambda a, layer=layer: a[layer], coded)
            np.testing.assert_array_equal(np.asarray(one.plain()).view(np.uint16), w[layer].view(np.uint16))
            if w is finite:
                xf, wf = np.asarray(x, np.float64), np.asarray(w[layer], np.float64)
                want, scale = xf @ wf, np.abs(xf) @ np.abs(wf)
                assert np.all(np.abs(got - want) <= 1e-6 * scale + 1e-30)


def test_palette_matmul_refuses_what_it_cannot_take():
    codes = jnp.zeros((1, 1, 8, 32), jnp.uint8)
    args = (codes, jnp.zeros((1, 1, 8, 64), jnp.uint8), jnp.zeros((1, 16), jnp.uint8),
            jnp.full((1, 1, 1), 8, jnp.int32), jnp.zeros((1, 1, 1, 64), jnp.uint8), jnp.int32(0))
    with pytest.raises(ValueError, match="takes bfloat16 x"):
        cpu_matmul.palette_matmul(jnp.zeros((2, 16), jnp.float32), *args)
    with pytest.raises(ValueError, match="x has 32 features but the codes"):
        cpu_matmul.palette_matmul(jnp.zeros((2, 32), jnp.bfloat16), *args)


def test_a_resident_compressed_model_takes_palette_panels_where_the_kernel_runs():
    """`build_state` with resident compression codes the four dense stacks as palette panels where
    `palette_matmul` runs (else in their own layout, decoded in the layer body); either way the steps'
    logits are bitwise the bfloat16 model's, and the abstract model is the placed one's layout."""
    plain = nnx.merge(*build_state(CFG, None, jnp.bfloat16, seed=0))
    weights = {".".join(map(str, p)): np.asarray(v.get_value())
               for p, v in nnx.to_flat_state(nnx.state(plain))}
    graphdef, state = build_state(CFG, weights, jnp.bfloat16, compress=("mlp", "attn"))
    model = nnx.merge(graphdef, state)
    kind = PalettePanelParams if cpu_matmul.palette_kernel() else PaletteParams
    assert all(type(getattr(model.layers, name)) is kind for name in DENSE)
    for got, want in zip(_two_steps(model, jnp.bfloat16), _two_steps(plain, jnp.bfloat16)):
        np.testing.assert_array_equal(got, want)
