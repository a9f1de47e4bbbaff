"""The CPU matmul kernels (XLA FFI calls, pallas_kernels/cpu_matmul.py) against float64 numpy, and
in the model: a decode step takes them and agrees with XLA's dot; float32 prefill-sized steps do
not take them, bfloat16 ones do where the CPU has AVX512-BF16. The engine-level checks are
tests/test_parity.py (float32) and tests/test_compression.py (bfloat16 engines), whose CPU decode
steps run through the layer kernel on any CPU, and through the panel and head kernels on a CPU with
AVX-512 (elsewhere the models keep XLA's dot for those; here they are made to take them)."""

from __future__ import annotations

import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infire_jax.models import llama
from infire_jax.models.config import ModelConfig
from infire_jax.models.parallel import Reductions
from pallas_kernels import cpu_kernels, cpu_matmul

# Without a C++ compiler the engine keeps XLA's dot (cpu_kernels.available() is False), so there is
# nothing of ours to test; with one, a kernel that fails to build fails here instead of skipping.
pytestmark = [pytest.mark.skipif(not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")),
                                 reason="no C++ compiler on this machine: the engine uses XLA's dot instead"),
              pytest.mark.usefixtures("models_choose_cpu_kernels")]


def test_kernel_builds_where_a_compiler_exists():
    assert cpu_kernels.available(), "the C++ kernel failed to build or register (see the warning logged)"


def _stack(rng, layers, k, n):
    return rng.standard_normal((layers, k, n)).astype(np.float32)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16])
@pytest.mark.parametrize("k,n", [(4, 16), (576, 960), (576, 3072), (1536, 576), (64, 1600)])
def test_matches_float64(rows, k, n):
    """Every row count up to MAX_ROWS, weights narrower and wider than one column chunk, a chunk
    count that does not divide the columns, and the first and last layer of the stack."""
    rng = np.random.default_rng(rows * 7919 + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = _stack(rng, 3, k, n)
    call = jax.jit(cpu_matmul.skinny_matmul)
    for layer in (0, 2):
        got = np.asarray(call(jnp.asarray(x), jnp.asarray(w), jnp.int32(layer)))
        want = x.astype(np.float64) @ w[layer].astype(np.float64)
        scale = np.abs(x).astype(np.float64) @ np.abs(w[layer]).astype(np.float64)
        assert np.all(np.abs(got - want) <= 1e-6 * scale + 1e-30), (layer, float(np.max(np.abs(got - want) / scale)))


@pytest.mark.parametrize("rows", [1, 8])
def test_bfloat16_weights_are_widened_exactly(rows):
    """bfloat16 weights with float32 activations give the float32 product of their exact values."""
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 576)).astype(np.float32))
    w = jnp.asarray(_stack(rng, 2, 576, 960)).astype(jnp.bfloat16)
    call = jax.jit(cpu_matmul.skinny_matmul)
    np.testing.assert_array_equal(np.asarray(call(x, w, jnp.int32(1))),
                                  np.asarray(call(x, w.astype(jnp.float32), jnp.int32(1))))
    want = np.asarray(x, np.float64) @ np.asarray(w[1].astype(jnp.float32), np.float64)
    np.testing.assert_allclose(np.asarray(call(x, w, jnp.int32(1))), want, rtol=1e-4, atol=1e-4)


# The `vdpbf16ps` path is compiled only for a CPU that has the instruction; where the CPU has it, a
# library built without it fails test_bf16_dot_is_built_where_the_cpu_has_it instead of skipping.
HAS_BF16 = "avx512_bf16" in cpu_kernels.host_cpu()
needs_bf16_dot = pytest.mark.skipif(not HAS_BF16, reason="this CPU has no AVX512-BF16 instruction")


def test_bf16_dot_is_built_where_the_cpu_has_it():
    assert cpu_kernels.bf16_dot() == HAS_BF16


@needs_bf16_dot
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 17, 40, 100])
@pytest.mark.parametrize("k,n", [(576, 960), (576, 576), (1536, 576), (2, 32), (64, 224), (128, 544)])
def test_bfloat16_dot_matches_float64(rows, k, n):
    """bfloat16 x and w (`vdpbf16ps`): every row-tile size and remainder, prefill-sized steps, column
    counts that leave every narrower tile; against float64 of the exact bfloat16 values (the
    products are exact, the sums float32), and a row's result does not depend on the batch."""
    rng = np.random.default_rng(rows * 31 + n)
    x = jnp.asarray(rng.standard_normal((rows, k)).astype(np.float32)).astype(jnp.bfloat16)
    w = jnp.asarray(_stack(rng, 3, k, n)).astype(jnp.bfloat16)
    assert cpu_matmul.applies(rows, w)
    call = jax.jit(cpu_matmul.skinny_matmul)
    for layer in (0, 2):
        got = np.asarray(call(x, w, jnp.int32(layer)))
        xf, wf = np.asarray(x.astype(jnp.float32), np.float64), np.asarray(w[layer].astype(jnp.float32), np.float64)
        want, scale = xf @ wf, np.abs(xf) @ np.abs(wf)
        assert np.all(np.abs(got - want) <= 1e-6 * scale + 1e-30), (layer, float(np.max(np.abs(got - want) / scale)))
    alone = np.asarray(call(x[-1:], w, jnp.int32(2)))[0]
    np.testing.assert_array_equal(alone, got[-1])


@needs_bf16_dot
def test_bfloat16_dot_only_where_it_is_exact():
    """The dot kernel needs bfloat16 activations (rounding float32 ones would change the result) and
    its shapes; float32 activations with bfloat16 weights keep the widening kernel."""
    w = jnp.zeros((2, 576, 960), jnp.bfloat16)
    assert cpu_matmul.applies(512, w) and not cpu_matmul.applies(512, w.astype(jnp.float32))
    assert not cpu_matmul.applies(17, jnp.zeros((2, 576, 48), jnp.bfloat16))  # columns not a multiple of 32
    x32 = jnp.asarray(np.random.default_rng(0).standard_normal((3, 576)).astype(np.float32))
    hlo = jax.jit(cpu_matmul.skinny_matmul).lower(x32, w, jnp.int32(0)).as_text()
    assert "(tensor<3x576xf32>, tensor<2x576x960xbf16>, tensor<i32>)" in hlo


@pytest.mark.parametrize("rows", [1, 3, 4, 8, 16])
@pytest.mark.parametrize("vocab", [1000, 49152])
@pytest.mark.parametrize("x_dtype,head_dtype", [("float32", "bfloat16"), ("bfloat16", "bfloat16"),
                                                ("float32", "float32")])
def test_head_matches_float64(rows, vocab, x_dtype, head_dtype):
    """The LM head kernel (x @ head.T, head [V, E]; bfloat16 x and head through `vdpbf16ps` where
    the CPU has it): every row count up to MAX_ROWS, a vocab that is not a multiple of its row
    chunk; against float64 of the exact values, and a row's logits do not depend on the batch."""
    rng = np.random.default_rng(rows + vocab)
    x = jnp.asarray(rng.standard_normal((rows, 576)).astype(np.float32)).astype(x_dtype)
    head = jnp.asarray(rng.standard_normal((vocab, 576)).astype(np.float32)).astype(head_dtype)
    assert cpu_matmul.head_applies(rows, head) and not cpu_matmul.head_applies(rows, head.astype(jnp.float16))
    assert not cpu_matmul.head_applies(cpu_matmul.MAX_ROWS + 1, head)
    got = np.asarray(jax.jit(cpu_matmul.head_matmul)(x, head))
    hf, xf = np.asarray(head.astype(jnp.float32), np.float64), np.asarray(x.astype(jnp.float32), np.float64)
    want = xf @ hf.T
    scale = np.abs(xf) @ np.abs(hf).T
    assert np.all(np.abs(got - want) <= 1e-6 * scale)
    np.testing.assert_array_equal(np.asarray(jax.jit(cpu_matmul.head_matmul)(x[-1:], head))[0], got[-1])


def test_a_row_does_not_depend_on_the_batch():
    """Each output is summed in one order whatever M is: a row alone equals that row in a batch."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 576)).astype(np.float32))
    w = jnp.asarray(_stack(rng, 2, 576, 960))
    call = jax.jit(cpu_matmul.skinny_matmul)
    batch = np.asarray(call(x, w, jnp.int32(1)))
    for m in (0, 5, 15):
        np.testing.assert_array_equal(np.asarray(call(x[m:m + 1], w, jnp.int32(1)))[0], batch[m])
    np.testing.assert_array_equal(np.asarray(call(x[:8], w, jnp.int32(1))), batch[:8])


def test_applies_only_to_what_it_computes():
    w = jnp.zeros((2, 576, 960), jnp.float32)
    assert cpu_matmul.applies(1, w) and cpu_matmul.applies(cpu_matmul.MAX_ROWS, w)
    assert not cpu_matmul.applies(cpu_matmul.MAX_ROWS + 1, w)  # float32 prefill: XLA's dot
    assert cpu_matmul.applies(1, w.astype(jnp.bfloat16)) and not cpu_matmul.applies(1, w.astype(jnp.float16))
    assert cpu_matmul.applies(cpu_matmul.MAX_ROWS + 1, w.astype(jnp.bfloat16)) == cpu_kernels.bf16_dot()
    assert not cpu_matmul.applies(1, jnp.zeros((2, 576, 40), jnp.float32))  # columns not a multiple of 16
    assert not cpu_matmul.applies(1, jnp.zeros((2, 6, 960), jnp.float32))  # K not a multiple of 4
    with pytest.raises(ValueError, match="features"):
        cpu_matmul.skinny_matmul(jnp.zeros((1, 64)), w, jnp.int32(0))


def test_the_models_choose_by_this_cpus_vectors(monkeypatch):
    """Unforced, the models take the decode-step layer kernel on any CPU (it reads the stack in place,
    and beat XLA's dot with AVX2 too), but the kernels on 16-float register tiles (panels, the LM
    head) only where the library was built for AVX-512 (with AVX2 alone they were slower than XLA's)."""
    monkeypatch.delenv("INFIRE_JAX_FORCE_CPU_KERNELS")
    w = jnp.zeros((2, 576, 960), jnp.float32)
    assert cpu_kernels.chosen() and cpu_matmul.applies(1, w)
    assert cpu_kernels.wide_chosen() == cpu_kernels.avx512()
    assert cpu_matmul.panel_kernel(jnp.float32) == cpu_kernels.avx512()
    assert cpu_matmul.head_applies(1, jnp.zeros((64, 576), jnp.float32)) == cpu_kernels.avx512()
    monkeypatch.setenv("INFIRE_JAX_FORCE_CPU_KERNELS", "1")
    assert cpu_kernels.wide_chosen() and cpu_matmul.panel_kernel(jnp.float32)


LAYERS, EMBED, MLP, HEADS, KV_HEADS, HEAD_DIM = 3, 64, 128, 4, 2, 16
DENSE_CFG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=EMBED, intermediate_size=MLP,
                        num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)


def _weights(rng):
    """A small dense Llama stack in the model's layout (DecoderLayers)."""
    n, e, f, hkv, d = LAYERS, EMBED, MLP, KV_HEADS, HEAD_DIM
    shapes = {"wqkv": (n, e, hkv, HEADS // hkv + 2, d), "wo": (n, HEADS, d, e), "w_gate_up": (n, e, 2, f),
              "w_down": (n, f, e)}
    return {k: jnp.asarray(0.1 * rng.standard_normal(s).astype(np.float32)) for k, s in shapes.items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 8, 32])
def test_layer_body_takes_the_kernel(tokens, dtype):
    """The dense weights of a step the kernels take (any float32 decode step; any bfloat16 step on
    an AVX512-BF16 CPU) are read in place by the FFI call and give XLA's result; other steps keep
    XLA's dot; a mesh (any reduction axis) never takes it. A weight decoded in the layer body
    (compressed or quantized storage) takes the same kernel as a stack of one, with bitwise the
    same result as the stored weight read in place."""
    rng = np.random.default_rng(tokens)
    weights = {k: w.astype(dtype) for k, w in _weights(rng).items()}
    x = jnp.asarray(rng.standard_normal((tokens, EMBED)).astype(np.float32)).astype(dtype)
    kernel = tokens <= cpu_matmul.MAX_ROWS or (dtype == "bfloat16" and cpu_kernels.bf16_dot())
    in_place = llama.in_place_weights(DENSE_CFG, weights, tokens, Reductions())
    assert set(in_place) == ({"wqkv", "wo", "w_gate_up", "w_down"} if kernel else set())
    assert llama.in_place_weights(DENSE_CFG, weights, 1, Reductions(attn=("tp",), mlp=("tp",))) == {}

    def body(mode: str, x, weights, layer):
        lp = {k: w[layer] for k, w in weights.items()}
        if mode == "stacked":
            in_place = llama.in_place_weights(DENSE_CFG, weights, x.shape[0], Reductions())
            lp = llama.kernel_weights(lp, in_place, layer, x.shape[0], cpu=True)
        elif mode == "decoded":  # as if every weight had been decoded in the layer body
            lp = llama.kernel_weights(lp, {}, layer, x.shape[0], cpu=True)
        q, k, v = llama.project_qkv(lp, x, False)
        o = llama.linear(q, lp["wo"], "thd,hde->te")
        return q, k, v, o, llama.dense_mlp(lp, x)

    tol = 1e-5 if dtype == "float32" else 2e-2  # bfloat16: XLA rounds in other places
    for layer in (0, 2):
        got, decoded, want = (jax.jit(functools.partial(body, mode))(x, weights, jnp.int32(layer))
                              for mode in ("stacked", "decoded", "xla"))
        for g, d, w in zip(got, decoded, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_array_equal(np.asarray(g), np.asarray(d))
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)
    for mode in ("stacked", "decoded"):
        hlo = jax.jit(functools.partial(body, mode)).lower(x, weights, jnp.int32(0)).as_text()
        assert (cpu_matmul.TARGET in hlo) == kernel


@pytest.mark.skipif(not cpu_matmul.q4_1_kernel(), reason="the GGUF Q4_1 kernel needs a CPU with AVX-512")
@pytest.mark.parametrize("k,n", [(64, 80), (576, 960), (1536, 576)])
def test_q4_1_matmul_dequantizes_exactly_and_sums_within_float32(k, n):
    """The default model's kept Q4_1 layers read in place: one-hot rows give each weight, the format's
    d * q + m rounded once to float32, bit for bit; products of any step size lie within float32's
    accumulation bound of float64; a row's result does not depend on the rows beside it (64- and
    32-column tiles of 4 and 8 rows, and a 16-column tail at n = 80)."""
    from test_quant_matmul import make_stack, within_f32_bound

    stack, w = make_stack("q4_1", k, n)
    call = jax.jit(cpu_matmul.q4_1_matmul)
    parts = (stack.values, stack.scale, stack.minimum)
    rows = np.sort(np.random.default_rng(k).choice(k, 40, replace=False))
    got = np.asarray(call(jnp.eye(k, dtype=jnp.float32)[rows], *parts, jnp.int32(2)))
    np.testing.assert_array_equal(got, w[2].astype(np.float32)[rows])
    x = np.random.default_rng(n).standard_normal((16, k)).astype(np.float32)
    whole = np.asarray(call(jnp.asarray(x), *parts, jnp.int32(1)))
    within_f32_bound(whole, x, w[1].astype(np.float32))
    for m in (1, 3, 5, 9):
        np.testing.assert_array_equal(np.asarray(call(jnp.asarray(x[:m]), *parts, jnp.int32(1))), whole[:m])
    with pytest.raises(ValueError, match="q4_1_matmul"):
        cpu_matmul.q4_1_matmul(jnp.asarray(x[:, :32]), *parts, jnp.int32(0))


def test_micro_benchmark_runs(capsys):
    """`python -m infire_jax.bench.cpu_matmul` (the figures in docs/PERFORMANCE.md) end to end."""
    from infire_jax.bench import cpu_matmul as cpu_matmul_bench

    assert cpu_matmul_bench.main(["--rows", "1", "64", "--dtype", "bfloat16", "float32", "--iters", "1",
                                  "--layers", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:2] == ["dtype", "T"] and [ln.split()[:2] for ln in lines[1:]] == [
        ["bfloat16", "1"], ["bfloat16", "64"], ["float32", "1"], ["float32", "64"]]
    assert all(float(ln.split()[8].rstrip("x")) > 0 for ln in lines[1:])  # the speed-up
    q4_1 = [ln.split()[9] for ln in lines[1:]]  # the Q4_1 column: float32 on an AVX-512 CPU
    assert q4_1[:2] == ["-", "-"]
    assert all(float(q) > 0 for q in q4_1[2:]) if cpu_matmul.q4_1_kernel() else q4_1[2:] == ["-", "-"]
