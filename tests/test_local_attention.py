"""Chunked (Llama 4) and sliding-window attention, `metadata.LocalMask`, in every paged-attention
implementation: the jnp reference, the CPU C++ kernel and the Pallas kernels (interpret mode; lowered
for CUDA), against a float64 numpy oracle that applies the masks to each token's whole history.

Each case is one step of rows that put the masks' edges where kernels cut their work: a prompt
crossing several chunks, a chunked prefill whose cached prefix ends mid-chunk and whose step crosses
a chunk boundary, decodes at the last token of a chunk and the first of the next, a long decode, a
one-token prompt. Chunk 12 and window 10 against page size 8 (neither a multiple) and 4. The page
table holds the hybrid cache's view of a local layer: every page wholly before the first key the
row's step sees is the null page, and the null page, those dropped pages and every slot no token
may read hold NaN (fp8: NaN codes), so a read whose value reaches an output fails.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import (cpu_attention, cpu_kernels, decode_attention, prefill_attention, ragged_attention,
                            reference)
from pallas_kernels.attention import paged_attention
from pallas_kernels.metadata import NULL_PAGE, LocalMask, deactivate, first_visible, slice_tokens
from pallas_kernels.mla import mla_attention
from pallas_kernels.mla_decode import mla_decode_attention
from test_kernels import (LAYER, NUM_LAYERS, Shapes, assert_close, build_metadata, device, device_meta,
                          lower_pallas_step_for_cuda)

# (cached before the step, tokens in the step) per row.
ROWS = ((0, 40),  # a prompt crossing three chunk boundaries in one step
        (18, 15),  # cached prefix ends mid-chunk; the step crosses the boundary at 24
        (23, 1),  # decode: the last token of chunk [12, 24)
        (24, 1),  # decode: the first token of chunk [24, 36)
        (150, 1),  # decode at a longer context: most of its pages are dropped
        (5, 12),  # a short prefix and a step crossing 12
        (0, 1),  # a one-token prompt
        (70, 3))  # a short chunk after a long prefix, at a chunk's end
NUM_TOKENS, NUM_ROWS = 80, 10  # 74 real tokens, then padding
# (chunk, window): chunked, windowed, both (the later start wins), a global layer through the mask
# code, and None: a model without local layers (static, the unmasked programs).
KINDS = [(12, 0), (0, 10), (12, 5), (0, 0), None]
LOCAL_KINDS = KINDS[:3]
SHAPES = [Shapes(page_size=8, head_dim=32, num_q_heads=4, num_kv_heads=2),
          Shapes(page_size=4, head_dim=16, num_q_heads=6, num_kv_heads=2, dtype="bfloat16")]
# Each shape's LocalMask kinds share one program (traced chunk and window). None, the unmasked
# programs that test_kernels checks on its cases, costs a compile more: the reference and the Pallas
# path leave it there (the CPU kernel, cheap to compile, takes it here too).
SHAPE_KINDS = [(shapes, kind) for shapes in SHAPES for kind in KINDS]
SHAPE_MASK_KINDS = [(shapes, kind) for shapes in SHAPES for kind in KINDS if kind is not None]
# The Pallas path as the GPU compiles it where there is one, in interpret mode elsewhere.
ON_GPU = jax.default_backend() == "gpu"
# What padding tokens write into the null page: poison too, finite (the reference's part B weighs
# padding keys by 0, which NaN would defeat), and large enough to show in any output it reached.
PADDING_POISON = 1e30


def kind_id(kind) -> str:
    return "none" if kind is None else f"chunk{kind[0]}-window{kind[1]}"


def param_id(x) -> str:
    return str(x) if isinstance(x, Shapes) else kind_id(x)


def numpy_first_visible(p: np.ndarray, chunk: int, window: int) -> np.ndarray:
    start = np.zeros_like(p)
    if chunk:
        start = np.maximum(start, p // chunk * chunk)
    if window:
        start = np.maximum(start, p - window + 1)
    return start


class LocalCase(NamedTuple):
    q: np.ndarray  # [T, Hq, D] float32, values exact in the case's dtype
    k: np.ndarray  # [T, Hkv, D]
    v: np.ndarray
    k_pages: np.ndarray  # [L, N, ps, Hkv, D] before the step: NaN wherever nothing may be read
    v_pages: np.ndarray
    meta: object  # AttentionMetadata of numpy arrays, `local` set (or None)
    k_history: list[np.ndarray]  # per row [ctx + n, Hkv, D]
    v_history: list[np.ndarray]
    dropped: int  # page-table entries turned into the null page


def make_case(shapes: Shapes, kind, *, seed: int, rows=ROWS, num_tokens=NUM_TOKENS, num_rows=NUM_ROWS) -> LocalCase:
    rng = np.random.default_rng(seed)
    ps, hkv, d = shapes.page_size, shapes.num_kv_heads, shapes.head_dim

    def rand(*shape):
        return np.array(jnp.asarray(rng.standard_normal(shape), shapes.dtype).astype(jnp.float32))

    sizes = [-(-(ctx + n) // ps) for ctx, n in rows]
    order = rng.permutation(np.arange(1, sum(sizes) + 3))  # 2 pages nobody owns
    pages = np.split(order[:sum(sizes)], np.cumsum(sizes)[:-1])
    meta = build_metadata(rows, pages, num_tokens=num_tokens, num_rows=num_rows, page_size=ps, width=max(sizes) + 1)
    pool_shape = (NUM_LAYERS, len(order) + 1, ps, hkv, d)
    k_pages, v_pages = np.full(pool_shape, np.nan, np.float32), np.full(pool_shape, np.nan, np.float32)
    k, v = rand(num_tokens, hkv, d), rand(num_tokens, hkv, d)
    k_history, v_history = [], []
    table = meta.page_table.copy()
    dropped = 0
    for i, (ctx, n) in enumerate(rows):
        kh, vh = rand(ctx + n, hkv, d), rand(ctx + n, hkv, d)
        first = 0 if kind is None else int(numpy_first_visible(np.array(ctx), *kind))  # the row's first token's
        held = np.arange(ctx)
        held = held[held // ps >= first // ps]  # pages wholly before `first` are gone: they stay NaN
        k_pages[LAYER, pages[i][held // ps], held % ps] = kh[held]
        v_pages[LAYER, pages[i][held // ps], held % ps] = vh[held]
        table[i, :first // ps] = NULL_PAGE
        dropped += first // ps
        k[meta.cu_q_lens[i]:meta.cu_q_lens[i + 1]] = kh[ctx:]
        v[meta.cu_q_lens[i]:meta.cu_q_lens[i + 1]] = vh[ctx:]
        k_history.append(kh)
        v_history.append(vh)
    padding = np.arange(num_tokens) >= meta.cu_q_lens[len(rows)]
    k[padding], v[padding] = PADDING_POISON, -PADDING_POISON
    local = None if kind is None else LocalMask(np.int32(kind[0]), np.int32(kind[1]))
    meta = meta._replace(page_table=table, local=local)
    q = rand(num_tokens, shapes.num_q_heads, d)
    return LocalCase(q, k, v, k_pages, v_pages, meta, k_history, v_history, dropped)


def oracle(case: LocalCase, kind, rows=ROWS, sinks: np.ndarray | None = None) -> np.ndarray:
    """float64 attention of each real token over its history's positions [first_visible(p), p]; with
    `sinks` (a logit per query head, gpt-oss) a sink column joined to every row and dropped."""
    t, hq, d = case.q.shape
    group = hq // case.k.shape[1]
    out = np.full((t, hq, d), np.nan)
    for i, (ctx, n) in enumerate(rows):
        span = slice(case.meta.cu_q_lens[i], case.meta.cu_q_lens[i + 1])
        keys = np.repeat(case.k_history[i].astype(np.float64), group, axis=1)
        values = np.repeat(case.v_history[i].astype(np.float64), group, axis=1)
        scores = np.einsum("nhd,mhd->hnm", case.q[span].astype(np.float64), keys) * d ** -0.5
        p = ctx + np.arange(n)[:, None]
        m = np.arange(ctx + n)[None, :]
        first = np.zeros_like(p) if kind is None else numpy_first_visible(p, *kind)
        scores = np.where(((m <= p) & (m >= first))[None], scores, -np.inf)
        sink = np.full((hq, n, 1), -np.inf) if sinks is None else np.broadcast_to(
            sinks.astype(np.float64)[:, None, None], (hq, n, 1))
        row_max = np.maximum(scores.max(axis=-1, keepdims=True), sink)
        w = np.exp(scores - row_max)
        out[span] = np.einsum("hnm,mhd->nhd", w / (w.sum(axis=-1, keepdims=True) + np.exp(sink - row_max)), values)
    return out


def real_tokens(meta) -> np.ndarray:
    return np.arange(len(meta.positions)) < meta.cu_q_lens[meta.num_seqs]


def case_args(case: LocalCase, shapes: Shapes, pool=None):
    pool = pool or (lambda x: device(x, shapes))
    return (device(case.q, shapes), device(case.k, shapes), device(case.v, shapes), pool(case.k_pages),
            pool(case.v_pages), jnp.int32(LAYER), device_meta(case.meta))


@functools.cache
def _step(impl: str, scale: float, cpu_kernel: bool = False):
    """One jitted step per implementation: LocalMask is traced, so every local kind shares a program."""
    return jax.jit(lambda *a: paged_attention(*a, scale=scale, impl=impl, cpu_kernel=cpu_kernel))


@functools.cache
def _jit(fn, **static):
    """`fn` with keyword arguments fixed, jitted once per combination (local kinds share the program)."""
    return jax.jit(functools.partial(fn, **static))


def test_first_visible_matches_the_definition():
    p = np.arange(0, 70, dtype=np.int32)
    for chunk, window in [(12, 0), (0, 10), (12, 5), (5, 12), (0, 0), (1, 0), (0, 1)]:
        got = jax.jit(first_visible)(LocalMask(jnp.int32(chunk), jnp.int32(window)), jnp.asarray(p))
        np.testing.assert_array_equal(np.asarray(got), numpy_first_visible(p, chunk, window))


def test_metadata_helpers_carry_the_mask():
    case = make_case(SHAPES[0], (12, 0), seed=0)
    meta = device_meta(case.meta)
    assert slice_tokens(meta, 8, 16).local == meta.local
    assert deactivate(meta, jnp.bool_(False)).local == meta.local


def test_the_cases_drop_pages():
    """The null-page contract is exercised: every local kind drops page-table entries, the global ones none."""
    for kind in KINDS:
        dropped = make_case(SHAPES[0], kind, seed=0).dropped
        assert (dropped > 20) if kind in LOCAL_KINDS else dropped == 0, (kind, dropped)


@pytest.mark.parametrize("shapes,kind", SHAPE_MASK_KINDS, ids=param_id)
def test_reference_matches_numpy(shapes, kind):
    """The jnp reference (part B and part A) on NaN-poisoned pools: the mask code zeroes the values of
    every key outside an item's visible range (test_kernels zeroes the NaN for the unmasked program,
    which weighs unread slots by 0)."""
    case = make_case(shapes, kind, seed=1)
    out, _, _ = _step("reference", shapes.head_dim ** -0.5)(*case_args(case, shapes))
    real = real_tokens(case.meta)
    assert_close(np.asarray(out)[real], oracle(case, kind)[real], shapes.tol)


@functools.cache
def _reference_with_blocks(block_tokens: int, query_block: int, scale: float):
    """The reference jitted once per block sizes (traced under the test's patches of both)."""
    return jax.jit(functools.partial(reference.ragged_paged_attention, scale=scale))


@pytest.mark.parametrize("block_tokens,query_block", [(8, 3)])
@pytest.mark.parametrize("kind", LOCAL_KINDS, ids=kind_id)
def test_reference_blocks_of_any_size(monkeypatch, kind, block_tokens, query_block):
    """Part A with key blocks of one page (by default 10 and 13 pages here) and query blocks of 3
    slots (items cross chunk boundaries and start mid-chunk)."""
    monkeypatch.setattr(reference, "_BLOCK_TOKENS", block_tokens)
    monkeypatch.setattr(reference, "query_block_size", lambda num_tokens, num_rows: query_block)
    shapes = SHAPES[0]
    case = make_case(shapes, kind, seed=2)
    out, _, _ = _reference_with_blocks(block_tokens, query_block, shapes.head_dim ** -0.5)(*case_args(case, shapes))
    real = real_tokens(case.meta)
    assert_close(np.asarray(out)[real], oracle(case, kind)[real], shapes.tol)


def test_reference_part_a_visits_only_visible_blocks():
    """Part A's ragged loop: each item's blocks run from the block holding the first position any of
    its queries sees, so a decode row of a chunked layer at a long context needs one or two blocks."""
    ps, chunk, ctx = 16, 64, 5000
    meta = device_meta(build_metadata([(ctx, 1), (ctx - 30, 40)], [np.arange(1, 321), np.arange(321, 641)],
                                      num_tokens=48, num_rows=2, page_size=ps, width=320))
    @jax.jit
    def bounds(meta):
        qb = reference.query_blocks(meta, 48, 8)
        return qb.start, *reference.item_key_blocks(qb, 128)

    for local, bound in ((LocalMask(jnp.int32(chunk), jnp.int32(0)), -(-chunk // 128) + 1),
                         (LocalMask(jnp.int32(0), jnp.int32(100)), -(-100 // 128) + 1), (None, -(-ctx // 128))):
        start, first, blocks = bounds(meta._replace(local=local))
        blocks = np.asarray(blocks)
        assert blocks[0] <= bound and blocks.max() <= bound and blocks[0] >= 1
        if local is not None:
            assert int(first[0]) * 128 <= int(start[0]) < (int(first[0]) + 1) * 128


@pytest.mark.parametrize("shapes,kind", SHAPE_KINDS, ids=param_id)
def test_cpu_kernel_matches_numpy(shapes, kind):
    """The C++ kernel starts each run's key loop at its first visible key: no NaN slot is ever read."""
    if not cpu_kernels.on_cpu():
        pytest.skip("no CPU kernels (no C++ compiler): the engine uses the reference instead")
    case = make_case(shapes, kind, seed=3)
    storage = reference.pool_storage_dtype(shapes.dtype, "reference")
    step = _step("reference", shapes.head_dim ** -0.5, cpu_kernel=True)
    args = case_args(case, shapes, lambda x: reference.to_storage(device(x, shapes), storage))
    target = cpu_attention.TARGET if kind is None else cpu_attention.TARGET_LOCAL
    assert f"custom_call @{target}(" in step.lower(*args).as_text()
    out, _, _ = step(*args)
    real = real_tokens(case.meta)
    assert_close(np.asarray(out)[real], oracle(case, kind)[real], shapes.tol)
    assert not np.asarray(out.astype(jnp.float32))[~real].any()


@pytest.mark.parametrize("shapes,kind", SHAPE_MASK_KINDS, ids=param_id)
def test_pallas_path_matches_numpy(shapes, kind):
    """Write + decode + prefill kernels with the default tiles (decode block 128: the long decode's
    block starts on dropped pages), through the dispatcher; compiled by Triton on a GPU."""
    case = make_case(shapes, kind, seed=4)
    out, _, _ = _step("pallas" if ON_GPU else "pallas_interpret", shapes.head_dim ** -0.5)(*case_args(case, shapes))
    real = real_tokens(case.meta)
    assert_close(np.asarray(out)[real], oracle(case, kind)[real], shapes.tol)
    assert not np.asarray(out.astype(jnp.float32))[~real].any()


def _pool_after_write(case: LocalCase) -> tuple[np.ndarray, np.ndarray]:
    real = real_tokens(case.meta)
    slots = case.meta.slot_mapping[real]
    ps = case.k_pages.shape[2]
    k_pages, v_pages = case.k_pages.copy(), case.v_pages.copy()
    k_pages[LAYER, slots // ps, slots % ps] = case.k[real]
    v_pages[LAYER, slots // ps, slots % ps] = case.v[real]
    return k_pages, v_pages


@pytest.mark.parametrize("kind", LOCAL_KINDS, ids=kind_id)
def test_pallas_kernels_with_small_tiles(kind):
    """Decode in key blocks of 8 over 3 splits, prefill in tiles of 4 tokens (tiles start mid-chunk
    and cross boundaries) and key blocks of 8: block rounding puts dropped pages in the first block."""
    shapes = SHAPES[0]
    case = make_case(shapes, kind, seed=5)
    k_pages, v_pages = (device(x, shapes) for x in _pool_after_write(case))
    args = (device(case.q, shapes), k_pages, v_pages, jnp.int32(LAYER), device_meta(case.meta))
    want = oracle(case, kind)
    scale = shapes.head_dim ** -0.5
    decoded, is_decode = _jit(decode_attention.decode_attention, scale=scale, block_k=8, num_splits=3,
                              interpret=True)(*args)
    prefilled, is_prefill = _jit(prefill_attention.prefill_attention, scale=scale, tile_rows=8, block_k=8,
                                 interpret=True)(*args)
    for out, covered in ((decoded, is_decode), (prefilled, is_prefill)):
        covered = np.asarray(covered)
        assert covered.any()
        assert_close(np.asarray(out)[covered], want[covered], shapes.tol)


def _record_key_blocks(monkeypatch, module) -> list:
    """Makes `module`'s kernel report (seq, first key) of every key block it loads (interpret mode
    runs debug callbacks), so tests count what the key loop visits."""
    seen = []
    load = module.load_key_block

    def recording(k_ref, v_ref, table_ref, layer, seq, kv_head, first_key, key_end, **kwargs):
        jax.debug.callback(lambda s, h, f: seen.append((int(s), int(h), int(f))), seq, kv_head, first_key)
        return load(k_ref, v_ref, table_ref, layer, seq, kv_head, first_key, key_end, **kwargs)

    monkeypatch.setattr(module, "load_key_block", recording)
    return seen


def test_decode_reads_at_most_a_chunk_at_long_context(monkeypatch):
    """A chunked layer's decode at context 2000 loads the blocks of its chunk only, whatever the split
    count, and the loop-bounds function says so for Llama 4's chunk at 100k context."""
    shapes, chunk, block_k = Shapes(page_size=8, head_dim=16, num_q_heads=2, num_kv_heads=1), 40, 16
    rows = ((1999, 1), (2023, 1), (7, 1))
    case = make_case(shapes, (chunk, 0), seed=6, rows=rows, num_tokens=4, num_rows=4)
    seen = _record_key_blocks(monkeypatch, decode_attention)
    k_pages, v_pages = (device(x, shapes) for x in _pool_after_write(case))
    decode = jax.jit(functools.partial(decode_attention.decode_attention, scale=0.25, block_k=block_k, num_splits=4,
                                       interpret=True))  # traced here, under the recording patch
    out, covered = decode(device(case.q, shapes), k_pages, v_pages, jnp.int32(LAYER), device_meta(case.meta))
    jax.effects_barrier()
    covered = np.asarray(covered)
    assert_close(np.asarray(out)[covered], oracle(case, (chunk, 0), rows)[covered], shapes.tol)
    for row, (ctx, _) in enumerate(rows):
        firsts = sorted(f for s, _, f in seen if s == row)
        start = ctx // chunk * chunk
        want = list(range(start // block_k * block_k, ctx + 1, block_k))
        assert firsts == want, (row, firsts, want)  # each visible block once, nothing before the chunk

    for kv_len, key_start in ((100_000, 98_304), (8_192, 0), (8_193, 8_192), (1, 0)):
        for splits in (1, 3, 32):
            bounds = [decode_attention.key_block_range(jnp.int32(kv_len), jnp.int32(key_start), jnp.int32(k),
                                                       block_k=128, num_splits=splits) for k in range(splits)]
            visited = [b for first, last in bounds for b in range(int(first), int(last))]
            assert visited == list(range(key_start // 128, -(-kv_len // 128)))
            assert len(visited) <= 8192 // 128 + 1


def test_prefill_starts_at_the_first_visible_block(monkeypatch):
    """A tile's key loop starts at the block of its first token's first visible key."""
    shapes, chunk, block_k = Shapes(page_size=8, head_dim=16, num_q_heads=2, num_kv_heads=1), 40, 16
    rows = ((1990, 20),)  # tiles of 8 tokens: 1990.., 1998.. (crosses 2000), 2006..
    case = make_case(shapes, (chunk, 0), seed=7, rows=rows, num_tokens=20, num_rows=1)
    seen = _record_key_blocks(monkeypatch, prefill_attention)
    k_pages, v_pages = (device(x, shapes) for x in _pool_after_write(case))
    prefill = jax.jit(functools.partial(prefill_attention.prefill_attention, scale=0.25, tile_rows=16,
                                        block_k=block_k, interpret=True))  # traced here, under the recording patch
    out, _ = prefill(device(case.q, shapes), k_pages, v_pages, jnp.int32(LAYER), device_meta(case.meta))
    jax.effects_barrier()
    assert_close(np.asarray(out), oracle(case, (chunk, 0), rows), shapes.tol)
    firsts = sorted(f for _, _, f in seen)
    tiles = [(1990, 1998), (1998, 2006), (2006, 2010)]
    want = sorted(b for lo, hi in tiles for b in range(lo // chunk * chunk // block_k * block_k, hi, block_k))
    assert firsts == want


def _fp8_case(kind):
    shapes = SHAPES[0]
    # Not seed 8: one of its step values, 336.00003 x k_scale, takes code 0x7a from XLA's float32 -> e4m3
    # conversion (rounded twice, through 336.0, a tie) and 0x7b from ml_dtypes (once, to nearest).
    case = make_case(shapes, kind, seed=9)
    kv_scale = np.random.default_rng(0).uniform(0.004, 0.02, size=(2, shapes.num_kv_heads)).astype(np.float32)

    def codes(x, scale):  # NaN slots stay NaN codes (0x7f): the poison
        return np.clip(x / scale[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)

    def dequant(x, scale):
        return codes(x, scale).astype(np.float64) * scale[:, None]

    oracle_case = case._replace(k_history=[dequant(h, kv_scale[0]) for h in case.k_history],
                                v_history=[dequant(h, kv_scale[1]) for h in case.v_history])
    k_bits, v_bits = codes(case.k_pages, kv_scale[0]).view(np.uint8), codes(case.v_pages, kv_scale[1]).view(np.uint8)
    assert (k_bits[LAYER, NULL_PAGE] == 0x7f).all()
    return case, kv_scale, k_bits, v_bits, oracle(oracle_case, kind)


@pytest.mark.parametrize("impl", ["reference", "cpu", "pallas"])
def test_fp8_pool_with_a_chunked_layer(impl):
    """An fp8 pool (kv scales) with a chunked layer; the null page and dropped pages hold NaN codes.
    The Pallas kernels compiled on a GPU (of compute capability >= 8.9), interpreted elsewhere."""
    if impl == "cpu" and not cpu_kernels.on_cpu():
        pytest.skip("no CPU kernels (no C++ compiler)")
    case, kv_scale, k_bits, v_bits, want = _fp8_case((12, 0))
    scale = SHAPES[0].head_dim ** -0.5
    fn = {"reference": _jit(reference.ragged_paged_attention, scale=scale),
          "cpu": _jit(cpu_attention.paged_attention, scale=scale),
          "pallas": _jit(ragged_attention.ragged_paged_attention, scale=scale, interpret=not ON_GPU)}[impl]
    if impl == "pallas":
        k_bits, v_bits = k_bits.view(ml_dtypes.float8_e4m3fn), v_bits.view(ml_dtypes.float8_e4m3fn)
    out, _, _ = fn(jnp.asarray(case.q), jnp.asarray(case.k), jnp.asarray(case.v), jnp.asarray(k_bits),
                   jnp.asarray(v_bits), jnp.int32(LAYER), device_meta(case.meta), kv_scale=jnp.asarray(kv_scale))
    real = real_tokens(case.meta)
    tol = 1e-4 if impl == "pallas" else 2e-5
    np.testing.assert_allclose(np.asarray(out, np.float64)[real], want[real], atol=tol, rtol=tol)


@pytest.mark.parametrize("pool_dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
def test_gpu_lowering_with_a_local_mask(pool_dtype):
    """The Pallas path with a LocalMask lowers for CUDA through Triton, bfloat16 and fp8 pools."""
    hlo = lower_pallas_step_for_cuda(pool_dtype, local=True)
    assert "tensor<3xi32>" in hlo  # the kernels' [layer, chunk, window] operand: the masked kernels


def test_mla_refuses_a_local_mask():
    """DeepSeek's MLA has no local layers: a LocalMask there is an error at trace time, not ignored."""
    t, h, r, dr, ps = 4, 2, 16, 16, 4
    meta = device_meta(build_metadata([(3, 1)], [np.array([1])], num_tokens=t, num_rows=2, page_size=ps, width=2))
    meta = meta._replace(local=LocalMask(jnp.int32(12), jnp.int32(0)))
    pages = jnp.zeros((1, 3, ps, 1, r)), jnp.zeros((1, 3, ps, 1, dr))
    with pytest.raises(ValueError, match="chunked or sliding-window"):
        mla_attention(jnp.zeros((t, h, 8)), jnp.zeros((t, h, dr)), jnp.zeros((t, r)), jnp.zeros((t, dr)),
                      jnp.zeros((r, h, 8)), jnp.zeros((r, h, 8)), *pages, jnp.int32(0), meta, scale=1.0,
                      impl="reference")
    with pytest.raises(ValueError, match="chunked or sliding-window"):
        mla_decode_attention(jnp.zeros((t, h, r)), jnp.zeros((t, h, dr)), *pages, jnp.int32(0), meta, scale=1.0,
                             interpret=True)
