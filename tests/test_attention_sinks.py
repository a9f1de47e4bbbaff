"""Attention sinks (gpt-oss: a learned logit per query head joins every softmax row as one more column,
whose value is dropped) in the Pallas kernels (interpret mode; lowered for CUDA) and the CPU C++ kernel,
against a float64 numpy oracle of

    out = sum_i e^(s_i - m) v_i / (sum_i e^(s_i - m) + e^(sink_h - m)),  m = max(max_i s_i, sink_h).

The steps are test_local_attention's: decode rows and prefill chunks in one step, grouped query heads
(2 and 3 a kv head, the latter padded to 4 in the kernels' tiles), NaN wherever nothing may be read,
global and sliding-window layers. The sinks span the scores' range and beyond: a head whose sink
exceeds every score (its m is the sink), one far below them (it barely counts).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from h100 import compiled_kernels, gpu_lowered, launches, lowers_triton_here

from pallas_kernels import cpu_attention, cpu_kernels, decode_attention, prefill_attention, ragged_attention, reference
from pallas_kernels.metadata import AttentionMetadata, LocalMask
from pallas_kernels.triton_backend import MASK_VALUE
from test_kernels import LAYER, assert_close, device, device_meta
from test_local_attention import (ON_GPU, SHAPES, LocalCase, _fp8_case, _pool_after_write, case_args, kind_id,
                                  make_case, oracle, real_tokens)

# None: a global layer (the unmasked programs); (0, 10): a sliding window of 10 (gpt-oss's banded layers
# slide over 128); (12, 0): a chunked layer, whose decode row at 150 has only 7 keys for its sink to outweigh.
KINDS = [None, (0, 10), (12, 0)]
SHAPE_KINDS = [(shapes, kind) for shapes in SHAPES for kind in KINDS[:2]]


def param_id(x) -> str:
    return str(x) if not isinstance(x, (tuple, type(None))) else kind_id(x)


def make_sinks(num_q_heads: int, seed: int) -> np.ndarray:
    """One logit per query head: alternately above every score (12), far below them (-30), and in
    their range; values exact in bfloat16, as a checkpoint's are."""
    rng = np.random.default_rng(seed)
    sinks = rng.uniform(-2.0, 3.0, num_q_heads)
    sinks[::3], sinks[1::3] = 12.0, -30.0
    return np.asarray(jnp.asarray(sinks, jnp.bfloat16).astype(jnp.float32))


def assert_heads_close(actual, expected: np.ndarray, tol: float) -> None:
    """Every query head within `tol` of its own largest output: a head whose sink outweighs its keys
    has small outputs, which a tolerance relative to all heads would not check."""
    for h in range(expected.shape[1]):
        assert_close(np.asarray(jnp.asarray(actual).astype(jnp.float32))[:, h], expected[:, h], tol)


def test_the_sinks_matter():
    """The oracle's sinks change the outputs of every head but the -30 ones, beyond any test's tolerance."""
    shapes = SHAPES[1]
    case = make_case(shapes, (0, 10), seed=0)
    real = real_tokens(case.meta)
    sinks = make_sinks(shapes.num_q_heads, 0)
    with_sinks, without = oracle(case, (0, 10), sinks=sinks)[real], oracle(case, (0, 10))[real]
    change = np.abs(with_sinks - without).max(axis=(0, 2)) / np.abs(without).max(axis=(0, 2))
    assert (change[sinks > -30] > 0.05).all() and (change[sinks == -30] < 1e-9).all(), (sinks, change)


@functools.cache
def _jit(fn, **static):
    """`fn` with keyword arguments fixed, jitted once per combination (local kinds share the program)."""
    return jax.jit(functools.partial(fn, **static))


@pytest.mark.parametrize("shapes,kind", SHAPE_KINDS, ids=param_id)
def test_pallas_path_with_sinks(shapes, kind):
    """KV write, decode and prefill kernels with their default tiles on a mixed step; padding tokens 0."""
    case = make_case(shapes, kind, seed=10)
    sinks = make_sinks(shapes.num_q_heads, 1)
    step = _jit(ragged_attention.ragged_paged_attention, scale=shapes.head_dim ** -0.5, interpret=not ON_GPU)
    out, _, _ = step(*case_args(case, shapes), sinks=jnp.asarray(sinks))
    real = real_tokens(case.meta)
    assert_heads_close(np.asarray(out)[real], oracle(case, kind, sinks=sinks)[real], shapes.tol)
    assert not np.asarray(out.astype(jnp.float32))[~real].any()


@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_kernels_with_small_tiles_and_splits(kind):
    """Decode over 3 splits of 8-key blocks (the sink joins once, in the combine, not per split) and
    prefill in tiles of 4 tokens x 2 heads, each row its own head's sink; float32."""
    shapes = SHAPES[0]
    case = make_case(shapes, kind, seed=11)
    sinks = make_sinks(shapes.num_q_heads, 2)
    k_pages, v_pages = (device(x, shapes) for x in _pool_after_write(case))
    args = (device(case.q, shapes), k_pages, v_pages, jnp.int32(LAYER), device_meta(case.meta))
    want = oracle(case, kind, sinks=sinks)
    scale = shapes.head_dim ** -0.5
    decoded, is_decode = _jit(decode_attention.decode_attention, scale=scale, block_k=8, num_splits=3,
                              interpret=True)(*args, sinks=jnp.asarray(sinks))
    prefilled, is_prefill = _jit(prefill_attention.prefill_attention, scale=scale, tile_rows=8, block_k=8,
                                 interpret=True)(*args, sinks=jnp.asarray(sinks))
    for out, covered in ((decoded, is_decode), (prefilled, is_prefill)):
        covered = np.asarray(covered)
        assert covered.any()
        assert_heads_close(np.asarray(out)[covered], want[covered], shapes.tol)


def test_combine_with_a_sink_is_the_softmax_with_one_more_column():
    """`combine_splits` on hand-made partials, split 1 empty (MASK_VALUE, 0): the sink counts once."""
    rng = np.random.default_rng(3)
    scores = rng.standard_normal((2, 5))  # [K, keys of a split]
    values = rng.standard_normal((2, 5, 4))
    row_max = scores.max(axis=1)
    total = np.exp(scores - row_max[:, None]).sum(axis=1)
    acc = np.einsum("km,kmd->kd", np.exp(scores - row_max[:, None]), values)
    row_max[1], total[1], acc[1] = MASK_VALUE, 0, 0
    sink = 1.5
    got = decode_attention.combine_splits(*(jnp.asarray(x, jnp.float32).reshape(2, 1, 1, 1, *x.shape[1:])
                                            for x in (acc, row_max, total)), jnp.full((1, 1), sink, jnp.float32))
    first = scores[0]
    m = max(first.max(), sink)
    want = np.exp(first - m) @ values[0] / (np.exp(first - m).sum() + np.exp(sink - m))
    np.testing.assert_allclose(np.asarray(got)[0, 0, 0], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shapes", SHAPES, ids=str)
@pytest.mark.parametrize("kind", KINDS, ids=kind_id)
def test_cpu_kernel_with_sinks(shapes, kind):
    """The C++ kernel's sink target, global (chunk = window = 0) and local layers, on the pool as the
    CPU path stores it (bfloat16 as uint16 bits)."""
    if not cpu_kernels.on_cpu():
        pytest.skip("no CPU kernels (no C++ compiler): the engine uses the reference instead")
    case = make_case(shapes, kind, seed=12)
    sinks = make_sinks(shapes.num_q_heads, 4)
    storage = reference.pool_storage_dtype(shapes.dtype, "reference")
    args = case_args(case, shapes, lambda x: reference.to_storage(device(x, shapes), storage))
    step = _jit(cpu_attention.paged_attention, scale=shapes.head_dim ** -0.5)
    assert f"custom_call @{cpu_attention.TARGET_SINKS}(" in step.lower(*args, sinks=jnp.asarray(sinks)).as_text()
    out, _, _ = step(*args, sinks=jnp.asarray(sinks))
    real = real_tokens(case.meta)
    assert_heads_close(np.asarray(out)[real], oracle(case, kind, sinks=sinks)[real], shapes.tol)
    assert not np.asarray(out.astype(jnp.float32))[~real].any()


def _dequantized(case: LocalCase, kv_scale: np.ndarray) -> LocalCase:
    """The case with its histories as the fp8 pool holds them: ml_dtypes' e4m3 codes times the scales."""
    def dequant(x, scale):
        codes = np.clip(x / scale[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
        return codes.astype(np.float64) * scale[:, None]

    return case._replace(k_history=[dequant(h, kv_scale[0]) for h in case.k_history],
                         v_history=[dequant(h, kv_scale[1]) for h in case.v_history])


@pytest.mark.parametrize("impl", ["cpu", "pallas"])
def test_fp8_pool_with_sinks(impl):
    """An fp8 pool (k_scale folds into q: the sinks join the true scores) on a chunked layer; the oracle
    attends over ml_dtypes' dequantized values."""
    if impl == "cpu" and not cpu_kernels.on_cpu():
        pytest.skip("no CPU kernels (no C++ compiler)")
    kind = (12, 0)
    case, kv_scale, k_bits, v_bits, _ = _fp8_case(kind)
    sinks = make_sinks(case.q.shape[1], 5)
    want = oracle(_dequantized(case, kv_scale), kind, sinks=sinks)
    scale = SHAPES[0].head_dim ** -0.5
    if impl == "pallas":
        fn = _jit(ragged_attention.ragged_paged_attention, scale=scale, interpret=not ON_GPU)
        k_bits, v_bits = k_bits.view(ml_dtypes.float8_e4m3fn), v_bits.view(ml_dtypes.float8_e4m3fn)
    else:
        fn = _jit(cpu_attention.paged_attention, scale=scale)
    out, _, _ = fn(jnp.asarray(case.q), jnp.asarray(case.k), jnp.asarray(case.v), jnp.asarray(k_bits),
                   jnp.asarray(v_bits), jnp.int32(LAYER), device_meta(case.meta), kv_scale=jnp.asarray(kv_scale),
                   sinks=jnp.asarray(sinks))
    real = real_tokens(case.meta)
    tol = 1e-4 if impl == "pallas" else 2e-5
    assert_heads_close(np.asarray(out)[real], want[real], tol)


@lowers_triton_here
@pytest.mark.parametrize("pool_dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
def test_gpu_lowering_with_sinks(pool_dtype):
    """The Pallas path with sinks on gpt-oss-120b's attention shapes (64 query heads, 8 kv heads,
    head_dim 64) and a sliding window lowers for CUDA through Triton and compiles for an H100 (the
    prefill kernel's [rows] sink block is a power of two); the sinks reach the prefill kernel."""
    t, s, hq, hkv, d, ps = 64, 16, 64, 8, 64, 16
    sd, i32 = jax.ShapeDtypeStruct, jnp.int32
    scales = sd((2, hkv), jnp.float32) if jnp.dtype(pool_dtype) == jnp.float8_e4m3fn else None
    meta = AttentionMetadata(sd((t,), i32), sd((t,), i32), sd((t,), i32), sd((s, 256), i32), sd((s,), i32),
                             sd((s + 1,), i32), sd((), i32), None, LocalMask(sd((), i32), sd((), i32)))
    pool = sd((2, 1024, ps, hkv, d), pool_dtype)

    def step(q, k, v, k_pages, v_pages, layer, meta, kv_scale, sinks):
        return ragged_attention.ragged_paged_attention(q, k, v, k_pages, v_pages, layer, meta, scale=d ** -0.5,
                                                       kv_scale=kv_scale, sinks=sinks)

    tokens = sd((t, hq, d), jnp.bfloat16), sd((t, hkv, d), jnp.bfloat16), sd((t, hkv, d), jnp.bfloat16)
    lowered = gpu_lowered(jax.jit(step, donate_argnums=(3, 4)), *tokens, pool, pool, sd((), i32), meta, scales,
                          sd((hq,), jnp.float32))
    hlo = lowered.as_text()
    rows = prefill_attention.TILE_ROWS
    assert f"tensor<{hkv}x{rows}xf32>" in hlo  # the sinks as the prefill kernel takes them
    kernels = compiled_kernels(lowered)
    assert all(launches(kernels, name) for name in ("paged_decode_attention", "paged_prefill_attention")), kernels
