"""fp8 KV pages in the attention kernels: the jnp reference, the CPU C++ kernel and the Pallas kernels
(interpret mode; lowered for CUDA) against a float64 numpy oracle of attention over the dequantized
fp8 values, and the exact fp8 bits a write stores.

The oracle dequantizes with ml_dtypes' own float8_e4m3fn (numpy), not with the kernels' code.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import cpu_attention, cpu_kernels, ragged_attention, reference
from pallas_kernels.metadata import AttentionMetadata
from test_kernels import (LAYER, NUM_TOKENS, Shapes, device_meta, lower_pallas_step_for_cuda, make_case,
                          numpy_attention)

SHAPES = Shapes(page_size=4, head_dim=64, num_q_heads=9, num_kv_heads=3)  # SmolLM2's grouping
FP8_TOL = 2e-5  # the same fp8 values: only float32 rounding differs


def _codes(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """x / scale per head ([..., H, D]), saturated and rounded to e4m3 by ml_dtypes."""
    y = np.clip(x.astype(np.float32) / scale[:, None].astype(np.float32), -448, 448)
    return y.astype(ml_dtypes.float8_e4m3fn)


def _dequant(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return _codes(x, scale).astype(np.float64) * scale[:, None]


@pytest.fixture(scope="module")
def fp8_case():
    case = make_case(SHAPES, seed=3, poison=False)
    rng = np.random.default_rng(0)
    kv_scale = rng.uniform(0.004, 0.02, size=(2, SHAPES.num_kv_heads)).astype(np.float32)
    oracle_case = case._replace(k_history=[_dequant(h, kv_scale[0]) for h in case.k_history],
                                v_history=[_dequant(h, kv_scale[1]) for h in case.v_history])
    k_bits = _codes(case.k_pages, kv_scale[0]).view(np.uint8)  # cached histories and stale slots, as fp8 bits
    v_bits = _codes(case.v_pages, kv_scale[1]).view(np.uint8)
    return case, kv_scale, k_bits, v_bits, numpy_attention(oracle_case, SHAPES.num_q_heads)


def _run(fn, case, kv_scale, k_bits, v_bits):
    return fn(jnp.asarray(case.q), jnp.asarray(case.k), jnp.asarray(case.v), jnp.asarray(k_bits),
              jnp.asarray(v_bits), jnp.int32(LAYER), device_meta(case.meta), scale=SHAPES.head_dim ** -0.5,
              kv_scale=jnp.asarray(kv_scale))


def _real(case) -> np.ndarray:
    return np.arange(NUM_TOKENS) < case.meta.cu_q_lens[case.meta.num_seqs]


@pytest.mark.parametrize("kernel", ["reference", "cpu"])
def test_fp8_attention_matches_numpy_over_dequantized_values(fp8_case, kernel):
    case, kv_scale, k_bits, v_bits, want = fp8_case
    if kernel == "cpu" and not cpu_kernels.on_cpu():
        pytest.skip("no CPU kernels (no C++ compiler)")
    fn = reference.ragged_paged_attention if kernel == "reference" else cpu_attention.paged_attention
    out, k_pages, v_pages = _run(fn, case, kv_scale, k_bits, v_bits)
    assert k_pages.dtype == jnp.uint8
    real = _real(case)
    np.testing.assert_allclose(np.asarray(out, np.float64)[real], want[real], atol=FP8_TOL, rtol=FP8_TOL)


def test_write_stores_the_quantized_bits(fp8_case):
    """Each real token's slot holds exactly ml_dtypes' e4m3 bits of k / k_scale (saturating), and
    nothing else in the pool changes but the null page (padding tokens write there)."""
    case, kv_scale, k_bits, v_bits, _ = fp8_case
    k = case.k.copy()
    k[0, 0, :4] = [1e4, -1e4, 1e-7, 0.0]  # beyond ±448 * scale saturates; tiny values round to 0 / subnormals
    case = case._replace(k=k)
    _, k_pages, v_pages = _run(reference.ragged_paged_attention, case, kv_scale, k_bits, v_bits)
    real = _real(case)
    slots = case.meta.slot_mapping[real]
    ps = SHAPES.page_size
    want_k, want_v = k_bits.copy(), v_bits.copy()
    want_k[LAYER, slots // ps, slots % ps] = _codes(case.k[real], kv_scale[0]).view(np.uint8)
    want_v[LAYER, slots // ps, slots % ps] = _codes(case.v[real], kv_scale[1]).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(k_pages)[:, 1:], want_k[:, 1:])
    np.testing.assert_array_equal(np.asarray(v_pages)[:, 1:], want_v[:, 1:])
    assert np.asarray(k_pages)[LAYER, slots[0] // ps, slots[0] % ps, 0, 0] == 0x7E  # +448


def test_fp8_code_widening_is_exact():
    """Every finite e4m3 code through the CPU kernel's widening: token i is alone in its sequence
    and its value is 16 codes, so its output (attention over one position) is those codes' values."""
    if not cpu_kernels.on_cpu():
        pytest.skip("no CPU kernels (no C++ compiler)")
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[~np.isnan(codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32))]  # 0x7f, 0xff are NaN
    d = 16
    codes = np.concatenate([codes, np.zeros((-len(codes)) % d, np.uint8)]).reshape(-1, 1, d)  # [n, Hkv=1, D]
    n = codes.shape[0]
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    pool = np.zeros((1, n + 1, 1, 1, d), np.uint8)
    seq = np.arange(n, dtype=np.int32)
    meta = AttentionMetadata(np.zeros(n, np.int32), seq + 1, seq, (seq + 1)[:, None], np.ones(n, np.int32),
                             np.arange(n + 1, dtype=np.int32), np.int32(n))
    out, _, v_pages = cpu_attention.paged_attention(
        jnp.zeros((n, 1, d)), jnp.zeros((n, 1, d)), jnp.asarray(values), jnp.asarray(pool), jnp.asarray(pool),
        jnp.int32(0), device_meta(meta), scale=1.0, kv_scale=jnp.ones((2, 1), jnp.float32))
    np.testing.assert_array_equal(np.asarray(v_pages)[0, 1:, 0], codes)
    np.testing.assert_array_equal(np.asarray(out), values)


@pytest.mark.parametrize("interpret", [True, False], ids=["interpret", "gpu"])
def test_pallas_kernels_read_fp8_pages(fp8_case, interpret):
    """The Pallas path on an fp8 pool (float8_e4m3fn): in interpret mode anywhere, compiled by Triton
    on a GPU; the same oracle, and the same stored bits as the reference's write."""
    if not interpret and jax.default_backend() != "gpu":
        pytest.skip("the compiled Triton kernels need a GPU")
    case, kv_scale, k_bits, v_bits, want = fp8_case
    fp8 = ml_dtypes.float8_e4m3fn
    out, k_pages, v_pages = _run(functools.partial(ragged_attention.ragged_paged_attention, interpret=interpret),
                                 case, kv_scale, k_bits.view(fp8), v_bits.view(fp8))
    assert k_pages.dtype == jnp.float8_e4m3fn
    real = _real(case)
    np.testing.assert_allclose(np.asarray(out, np.float64)[real], want[real], atol=1e-4, rtol=1e-4)
    _, ref_k, ref_v = _run(reference.ragged_paged_attention, case, kv_scale, k_bits, v_bits)
    np.testing.assert_array_equal(np.asarray(k_pages).view(np.uint8)[:, 1:], np.asarray(ref_k)[:, 1:])
    np.testing.assert_array_equal(np.asarray(v_pages).view(np.uint8)[:, 1:], np.asarray(ref_v)[:, 1:])


def test_gpu_lowering_with_an_fp8_pool():
    """The Pallas path lowers for CUDA (Triton) with float8_e4m3fn pools, as test_kernels' bfloat16 one."""
    assert "f8E4M3FN" in lower_pallas_step_for_cuda(jnp.float8_e4m3fn)
