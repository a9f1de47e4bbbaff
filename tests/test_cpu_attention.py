"""The CPU paged attention (an XLA FFI call, pallas_kernels/cpu_attention.py) against the float64
numpy oracle and the `jnp` reference of tests/test_kernels.py, on pools whose unread slots are NaN;
and the dispatch: every step off a mesh takes it, a mesh keeps the reference. The engine-level
checks are tests/test_parity.py (float32, against HF) and tests/test_compression.py (bfloat16
engines), whose CPU steps run through it."""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_attention, cpu_kernels, reference
from pallas_kernels.attention import paged_attention
from test_kernels import (LAYER, NUM_TOKENS, ROWS, SHAPES, Shapes, assert_close, build_metadata, device,
                          device_meta, make_case, module_reference, numpy_attention, pool_after_write, row_tokens)

pytestmark = pytest.mark.skipif(not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")),
                                reason="no C++ compiler on this machine: the engine uses the reference instead")


# A step with two rows long enough for bfloat16 products (32 tokens or more), a decode and a short chunk.
LONG = dict(rows=((0, 40), (13, 1), (90, 33), (5, 12)), num_tokens=96, num_rows=5)


def _pool(pages: np.ndarray, shapes: Shapes) -> jax.Array:
    """A pool as the CPU reference stores it (bfloat16 as its uint16 bits)."""
    return reference.to_storage(device(pages, shapes), reference.pool_storage_dtype(shapes.dtype, "reference"))


@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_matches_numpy_with_poisoned_pool(shapes):
    """Every row of the case (prefill chunks, decodes over short and long contexts, padding), page
    sizes that are not 16, grouped and plain heads; slots no token may read are NaN."""
    assert cpu_kernels.available()
    case = make_case(shapes, seed=21, poison=True)
    out, k_pages, v_pages = jax.jit(cpu_attention.paged_attention, static_argnames="scale")(
        device(case.q, shapes), device(case.k, shapes), device(case.v, shapes), _pool(case.k_pages, shapes),
        _pool(case.v_pages, shapes), jnp.int32(LAYER), device_meta(case.meta), scale=shapes.head_dim ** -0.5)
    assert out.dtype == jnp.dtype(shapes.dtype)
    real = np.arange(NUM_TOKENS) < case.meta.cu_q_lens[case.meta.num_seqs]
    assert_close(np.asarray(out)[real], numpy_attention(case, shapes.num_q_heads)[real], shapes.tol)
    assert_close(np.asarray(out)[real], module_reference(case, shapes)[real], shapes.tol)
    assert not np.asarray(out.astype(jnp.float32))[~real].any()
    for pages, expected in zip((k_pages, v_pages), pool_after_write(case)):
        got = np.asarray(reference.from_storage(pages).astype(jnp.float32))
        np.testing.assert_array_equal(got[:, 1:], expected[:, 1:])


@pytest.mark.parametrize("shapes", [
    Shapes(page_size=16, head_dim=80, num_q_heads=10, num_kv_heads=5),  # groups of 2 queries; 4 + 1 dim vectors
    Shapes(page_size=16, head_dim=48, num_q_heads=5, num_kv_heads=1),  # groups of 5 queries; 3 dim vectors
    Shapes(page_size=8, head_dim=96, num_q_heads=14, num_kv_heads=2, dtype="bfloat16"),  # 7 queries; 4 + 2
], ids=str)
def test_every_register_tile_remainder(shapes):
    """The kernel runs a work item's queries 4 at a time and each value sum over 4 vectors of dims at a
    time (csrc/paged_attention.cc): queries per item and head dims that leave each remainder, against
    the float64 oracle; with rows long enough for bfloat16 products too."""
    case = make_case(shapes, seed=26, poison=True, **LONG)
    out, _, _ = cpu_attention.paged_attention(
        device(case.q, shapes), device(case.k, shapes), device(case.v, shapes), _pool(case.k_pages, shapes),
        _pool(case.v_pages, shapes), jnp.int32(LAYER), device_meta(case.meta), scale=shapes.head_dim ** -0.5)
    real = np.arange(LONG["num_tokens"]) < case.meta.cu_q_lens[case.meta.num_seqs]
    assert_close(np.asarray(out)[real], numpy_attention(case, shapes.num_q_heads)[real], shapes.tol)


@pytest.mark.parametrize("shapes", [SHAPES[4], Shapes(page_size=8, head_dim=96, num_q_heads=14, num_kv_heads=2,
                                                      dtype="bfloat16")], ids=str)
def test_bfloat16_products_stay_within_bfloat16_rounding(shapes):
    """bfloat16 queries over a bfloat16 pool multiply in bfloat16 (`vdpbf16ps`, where the library has
    it): their error against float64 is within 1.5x that of float32 products whose output is rounded to
    bfloat16 (about 1.6e-3 against 1.2e-3 mean, relative, measured). Rows of 32 tokens or more in a
    step take them; a decode row and a short chunk keep float32 products, bit for bit those of float32
    queries."""
    case = make_case(shapes, seed=27, poison=True, **LONG)
    q, pools = device(case.q, shapes), (_pool(case.k_pages, shapes), _pool(case.v_pages, shapes))
    assert cpu_attention.bf16_products(q, pools[0]) == cpu_kernels.bf16_dot()
    assert not cpu_attention.bf16_products(q.astype(jnp.float32), pools[0])
    real = np.arange(LONG["num_tokens"]) < case.meta.cu_q_lens[case.meta.num_seqs]
    long = row_tokens(case.meta, lambda n: n >= 32)
    expected = numpy_attention(case, shapes.num_q_heads)[real]

    def call(queries):
        out = cpu_attention.paged_attention(queries, device(case.k, shapes), device(case.v, shapes), *pools,
                                            jnp.int32(LAYER), device_meta(case.meta), scale=shapes.head_dim ** -0.5)[0]
        return np.asarray(out.astype(jnp.bfloat16).astype(jnp.float32), np.float64)

    def errors(got):
        got = got[real]
        assert np.isfinite(got).all()
        return (np.abs(got - expected).mean() / np.abs(expected).mean(),
                np.abs(got - expected).max() / np.abs(expected).max())

    with_products, widened = call(q), call(q.astype(jnp.float32))
    products = errors(with_products)
    assert products[0] < 1.5 * errors(widened)[0] and products[1] < 1.5 * errors(widened)[1]
    short = real & ~long
    np.testing.assert_array_equal(with_products[short], widened[short])
    if cpu_kernels.bf16_dot():
        assert not np.array_equal(with_products[long], widened[long])  # a path of its own


def test_float32_is_float32_exact_to_rounding():
    """float32 sums and exp: within a few float32 roundings of float64, not bfloat16-close."""
    shapes = SHAPES[3]
    case = make_case(shapes, seed=22, poison=True)
    out, _, _ = cpu_attention.paged_attention(
        device(case.q, shapes), device(case.k, shapes), device(case.v, shapes), _pool(case.k_pages, shapes),
        _pool(case.v_pages, shapes), jnp.int32(LAYER), device_meta(case.meta), scale=shapes.head_dim ** -0.5)
    real = np.arange(NUM_TOKENS) < case.meta.cu_q_lens[case.meta.num_seqs]
    assert_close(np.asarray(out)[real], numpy_attention(case, shapes.num_q_heads)[real], 2e-6)


@pytest.mark.parametrize("shapes", [SHAPES[3], SHAPES[4]], ids=str)
@pytest.mark.parametrize("row,index", [(7, 0), (8, 13), (3, 0)])
def test_a_token_does_not_depend_on_the_step(row, index, shapes):
    """A token alone in a one-token step gives bitwise what it gives in the full step: a long
    decode, and tokens of prompt chunks (which the kernel runs together, sharing key blocks), with
    float32 and with bfloat16 products."""
    case = make_case(shapes, seed=23, poison=False)
    call = jax.jit(cpu_attention.paged_attention, static_argnames="scale")
    full, k_pages, v_pages = call(device(case.q, shapes), device(case.k, shapes), device(case.v, shapes),
                                  _pool(case.k_pages, shapes), _pool(case.v_pages, shapes), jnp.int32(LAYER),
                                  device_meta(case.meta), scale=0.125)
    t = int(case.meta.cu_q_lens[row]) + index
    ctx = int(case.meta.positions[t])
    meta = build_metadata([(ctx, 1)], [np.asarray(case.meta.page_table[row])], num_tokens=1, num_rows=1,
                          page_size=shapes.page_size, width=case.meta.page_table.shape[1])
    alone = call(device(case.q[t:t + 1], shapes), device(case.k[t:t + 1], shapes), device(case.v[t:t + 1], shapes),
                 k_pages, v_pages, jnp.int32(LAYER), device_meta(meta), scale=0.125)[0]
    np.testing.assert_array_equal(np.asarray(alone)[0], np.asarray(full)[t])


def _decode_case(shapes: Shapes):
    """The case's decode rows only, as a decode step of its own (one token each, then padding)."""
    case = make_case(shapes, seed=24, poison=False)
    rows = [i for i, (_, n) in enumerate(ROWS) if n == 1]
    tokens = [int(case.meta.cu_q_lens[i]) for i in rows]
    width = case.meta.page_table.shape[1]
    meta = build_metadata([ROWS[i] for i in rows], [np.asarray(case.meta.page_table[i]) for i in rows],
                          num_tokens=8, num_rows=8, page_size=shapes.page_size, width=width)
    pad = 8 - len(tokens)

    def step(x):
        return device(np.concatenate([x[tokens], np.zeros((pad, *x.shape[1:]), x.dtype)]), shapes)

    pools = _pool(case.k_pages, shapes), _pool(case.v_pages, shapes)
    return (step(case.q), step(case.k), step(case.v), *pools, jnp.int32(LAYER), device_meta(meta)), len(tokens)


@pytest.mark.parametrize("shapes", [SHAPES[3], SHAPES[4]], ids=str)
def test_dispatch_takes_it_off_a_mesh(shapes):
    """The reference hands a step (decode, or the full mixed case) to the kernel when the caller is
    off a mesh, with the reference's result; a mesh caller keeps the reference."""
    scale = shapes.head_dim ** -0.5

    def run(cpu_kernel):
        return jax.jit(lambda *a: paged_attention(*a, scale=scale, impl="reference", cpu_kernel=cpu_kernel))

    mixed = make_case(shapes, seed=25, poison=False)
    mixed_args = (device(mixed.q, shapes), device(mixed.k, shapes), device(mixed.v, shapes),
                  _pool(mixed.k_pages, shapes), _pool(mixed.v_pages, shapes), jnp.int32(LAYER), device_meta(mixed.meta))
    mixed_real = int(mixed.meta.cu_q_lens[mixed.meta.num_seqs])
    for args, real in (_decode_case(shapes), (mixed_args, mixed_real)):
        for cpu_kernel in (True, False):
            hlo = run(cpu_kernel).lower(*args).as_text()
            assert (cpu_attention.TARGET in hlo) == cpu_kernel
        got, ref = run(True)(*args), run(False)(*args)
        assert_close(np.asarray(got[0])[:real], np.asarray(ref[0].astype(jnp.float32), np.float64)[:real], shapes.tol)
        for pages, ref_pages in zip(got[1:], ref[1:]):
            np.testing.assert_array_equal(np.asarray(pages)[:, 1:], np.asarray(ref_pages)[:, 1:])
    q, k_pages = mixed_args[0], mixed_args[3]
    assert cpu_attention.applies(q, k_pages) and not cpu_attention.applies(q, k_pages.astype(jnp.float16))
