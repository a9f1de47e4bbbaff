"""Dense layer weights repacked into the CPU kernel's panels (`cpu_matmul.pack_panels`,
infire_jax/models/panels.py): the layouts against their index formulas, the panel matmul against
float64 (bfloat16: also bitwise against the row-major kernel), and a repacked random Llama against
the same model unpacked. The engine-level checks are tests/test_parity.py (float32, against HF) and
tests/test_compression.py's bfloat16 engines, whose model runners repack their plain weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from infire_jax.models import llama
from infire_jax.models.config import ModelConfig
from infire_jax.models.panels import PanelParams, PanelWeight, kernel_layout
from infire_jax.models.registry import abstract_state, build_state
from pallas_kernels import cpu_matmul
from test_cpu_matmul import HAS_BF16
from test_kernels import build_metadata, device_meta

pytestmark = pytest.mark.usefixtures("models_choose_cpu_kernels")


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
                              {}, jnp.int32(1), 8, cpu=False)
    for name in DENSE:
        np.testing.assert_array_equal(np.asarray(lp[name]), np.asarray(getattr(plain.layers, name)[...][1]))


def test_only_a_model_off_a_mesh_with_the_kernel_is_repacked():
    for dtype in (jnp.float32, jnp.bfloat16):
        graphdef, state = build_state(CFG, None, dtype, seed=0)
        assert (kernel_layout(graphdef, state, plan=None)[0] != graphdef) == cpu_matmul.panel_kernel(dtype)
        graphdef, state = build_state(CFG, None, dtype, seed=0)
        assert kernel_layout(graphdef, state, plan=object())[0] == graphdef

