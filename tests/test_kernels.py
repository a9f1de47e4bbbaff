"""The Pallas attention kernels, in interpret mode on CPU, against an independent float64 numpy
oracle and against `pallas_kernels.reference`; and a whole model forward on the Pallas path.

Poisoning: pool slots a step must not read hold NaN (the other layer, unused pages, the tail of
every sequence's last page, unused page-table entries' null page), and interpret mode starts every
kernel output as NaN, so a forbidden read or an output element that no program writes fails.
The oracle never looks at the pages: it attends over each sequence's full key/value history.
"""

from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from h100 import LOWERS_TRITON_HERE, compiled_kernels, gpu_lowered, launches, lowers_triton_here

from infire_jax.models.config import ModelConfig
from infire_jax.models.registry import build_state
from pallas_kernels import benchmark, reference
from pallas_kernels.attention import IMPLS, decode_only_steps, paged_attention, plan_step, resolve_impl
from pallas_kernels.decode_attention import choose_num_splits, decode_attention
from pallas_kernels.kv_write import write_kv_pages
from pallas_kernels.metadata import NULL_PAGE, AttentionMetadata, LocalMask
from pallas_kernels.prefill_attention import (BLOCK_K, TILE_ROWS, block_q_of, for_head_dim, max_work_items,
                                              prefill_attention, work_items)

# (tokens cached before the step, tokens in the step), one row per sequence: prefill chunks with and
# without a cached prefix, decodes over short and long contexts, a one-token prompt. No length is a
# multiple of a page or block size.
ROWS = ((0, 9), (13, 1), (37, 1), (5, 12), (0, 1), (70, 3), (2, 1), (150, 1), (100, 20))
NUM_TOKENS = 56  # 49 real tokens, then padding
NUM_ROWS = 11  # 9 real rows, then padding rows
NUM_LAYERS, LAYER = 2, 1
F32_TOL, BF16_TOL = 2e-5, 2e-2


@dataclasses.dataclass(frozen=True)
class Shapes:
    page_size: int
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    dtype: str = "float32"

    @property
    def tol(self) -> float:
        return F32_TOL if self.dtype == "float32" else BF16_TOL

    def __str__(self) -> str:
        return (f"ps{self.page_size}-d{self.head_dim}-gqa{self.num_q_heads // self.num_kv_heads}"
                f"-kv{self.num_kv_heads}-{self.dtype}")


SHAPES = [
    Shapes(page_size=16, head_dim=128, num_q_heads=8, num_kv_heads=1),
    Shapes(page_size=8, head_dim=64, num_q_heads=8, num_kv_heads=2),
    Shapes(page_size=5, head_dim=64, num_q_heads=2, num_kv_heads=2),  # MHA, page size not a power of two
    Shapes(page_size=4, head_dim=64, num_q_heads=9, num_kv_heads=3),  # SmolLM2's grouping
    Shapes(page_size=16, head_dim=128, num_q_heads=16, num_kv_heads=4, dtype="bfloat16"),
]


class Case(NamedTuple):
    q: np.ndarray  # [T, Hq, D] float32 holding values exact in the case's dtype
    k: np.ndarray  # [T, Hkv, D]
    v: np.ndarray
    k_pages: np.ndarray  # [L, N, ps, Hkv, D] before the step
    v_pages: np.ndarray
    meta: AttentionMetadata  # numpy arrays
    k_history: list[np.ndarray]  # per row, [ctx + n, Hkv, D]: every key of the sequence after the step
    v_history: list[np.ndarray]


def build_metadata(rows, pages, *, num_tokens: int, num_rows: int, page_size: int, width: int) -> AttentionMetadata:
    """Step metadata the way `infire_jax.runner.batch` fills it: padding tokens -> row S and the null page."""
    positions = np.zeros(num_tokens, np.int32)
    slots = (np.arange(num_tokens) % page_size + NULL_PAGE * page_size).astype(np.int32)
    seq_ids = np.full(num_tokens, num_rows, np.int32)
    table = np.full((num_rows, width), NULL_PAGE, np.int32)
    kv_lens = np.zeros(num_rows, np.int32)
    cu = np.zeros(num_rows + 1, np.int32)
    off = 0
    for i, ((ctx, n), row_pages) in enumerate(zip(rows, pages)):
        pos = np.arange(ctx, ctx + n)
        positions[off:off + n] = pos
        slots[off:off + n] = np.asarray(row_pages)[pos // page_size] * page_size + pos % page_size
        seq_ids[off:off + n] = i
        table[i, :len(row_pages)] = row_pages
        kv_lens[i] = ctx + n
        off += n
        cu[i + 1] = off
    cu[len(rows) + 1:] = off
    return AttentionMetadata(positions, slots, seq_ids, table, kv_lens, cu, np.int32(len(rows)))


def make_case(shapes: Shapes, *, seed: int, poison: bool, rows=ROWS, num_tokens: int = NUM_TOKENS,
              num_rows: int = NUM_ROWS) -> Case:
    """Random histories, cached prefixes placed on randomly ordered pages; untouched slots NaN or stale.
    `rows` (ROWS by default): (cached, new) tokens of each sequence, in a step of `num_tokens` tokens and
    `num_rows` rows (then padding)."""
    rng = np.random.default_rng(seed)
    ps, hkv, d = shapes.page_size, shapes.num_kv_heads, shapes.head_dim

    def rand(*shape):
        return np.array(jnp.asarray(rng.standard_normal(shape), shapes.dtype).astype(jnp.float32))

    num_pages = [-(-(ctx + n) // ps) for ctx, n in rows]
    order = rng.permutation(np.arange(1, sum(num_pages) + 4))  # 3 pages nobody owns
    starts = np.cumsum([0] + num_pages)
    pages = [order[starts[i]:starts[i + 1]] for i in range(len(rows))]
    meta = build_metadata(rows, pages, num_tokens=num_tokens, num_rows=num_rows, page_size=ps,
                          width=max(num_pages) + 2)

    pool_shape = (NUM_LAYERS, len(order) + 1, ps, hkv, d)
    k_pages = np.full(pool_shape, np.nan, np.float32) if poison else rand(*pool_shape)
    v_pages = np.full(pool_shape, np.nan, np.float32) if poison else rand(*pool_shape)
    k, v = rand(num_tokens, hkv, d), rand(num_tokens, hkv, d)
    k_history, v_history = [], []
    for i, (ctx, n) in enumerate(rows):
        kh, vh = rand(ctx + n, hkv, d), rand(ctx + n, hkv, d)
        pos = np.arange(ctx)
        k_pages[LAYER, pages[i][pos // ps], pos % ps] = kh[:ctx]
        v_pages[LAYER, pages[i][pos // ps], pos % ps] = vh[:ctx]
        k[meta.cu_q_lens[i]:meta.cu_q_lens[i + 1]] = kh[ctx:]
        v[meta.cu_q_lens[i]:meta.cu_q_lens[i + 1]] = vh[ctx:]
        k_history.append(kh)
        v_history.append(vh)
    q = rand(num_tokens, shapes.num_q_heads, d)
    return Case(q, k, v, k_pages, v_pages, meta, k_history, v_history)


def numpy_attention(case: Case, num_q_heads: int) -> np.ndarray:
    """float64 causal attention of each real token over its sequence's history; padding rows NaN."""
    t, _, d = case.q.shape
    group = num_q_heads // case.k.shape[1]
    out = np.full((t, num_q_heads, d), np.nan)
    for i, kh in enumerate(case.k_history):
        n = int(case.meta.cu_q_lens[i + 1] - case.meta.cu_q_lens[i])
        ctx = len(kh) - n
        rows = slice(case.meta.cu_q_lens[i], case.meta.cu_q_lens[i + 1])
        keys = np.repeat(case.k_history[i].astype(np.float64), group, axis=1)  # q head h reads kv head h // G
        values = np.repeat(case.v_history[i].astype(np.float64), group, axis=1)
        scores = np.einsum("nhd,mhd->hnm", case.q[rows].astype(np.float64), keys) * d ** -0.5
        causal = np.arange(ctx + n)[None, :] <= (ctx + np.arange(n))[:, None]
        scores = np.where(causal[None], scores, -np.inf)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[rows] = np.einsum("hnm,mhd->nhd", p / p.sum(axis=-1, keepdims=True), values)
    return out


def pool_after_write(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """The pool with this step's real tokens stored at their slots of LAYER."""
    real = np.arange(NUM_TOKENS) < case.meta.cu_q_lens[case.meta.num_seqs]
    slots = case.meta.slot_mapping[real]
    ps = case.k_pages.shape[2]
    k_pages, v_pages = case.k_pages.copy(), case.v_pages.copy()
    k_pages[LAYER, slots // ps, slots % ps] = case.k[real]
    v_pages[LAYER, slots // ps, slots % ps] = case.v[real]
    return k_pages, v_pages


def module_reference(case: Case, shapes: Shapes) -> np.ndarray:
    """`pallas_kernels.reference` on the case, NaN slots zeroed: it weighs them by 0, which NaN would defeat."""
    out, _, _ = reference.ragged_paged_attention(
        device(case.q, shapes), device(case.k, shapes), device(case.v, shapes),
        device(np.nan_to_num(case.k_pages), shapes), device(np.nan_to_num(case.v_pages), shapes), jnp.int32(LAYER),
        device_meta(case.meta), scale=shapes.head_dim ** -0.5)
    return np.asarray(out.astype(jnp.float32), np.float64)


def device(case_array: np.ndarray, shapes: Shapes) -> jax.Array:
    return jnp.asarray(case_array, shapes.dtype)


def device_meta(meta: AttentionMetadata) -> AttentionMetadata:
    return jax.tree.map(jnp.asarray, meta)


def row_tokens(meta: AttentionMetadata, predicate) -> np.ndarray:
    """Mask of the real tokens whose row's step length satisfies `predicate`."""
    cu = np.asarray(meta.cu_q_lens)
    mask = np.zeros(len(meta.positions), bool)
    for i in range(int(meta.num_seqs)):
        mask[cu[i]:cu[i + 1]] = predicate(int(cu[i + 1] - cu[i]))
    return mask


def assert_close(actual, expected, tol: float) -> None:
    actual = np.asarray(jnp.asarray(actual).astype(jnp.float32), np.float64)
    assert np.isfinite(actual).all(), "non-finite outputs: a poisoned slot was read or an output left unwritten"
    err = np.max(np.abs(actual - expected)) / np.max(np.abs(expected))
    assert err < tol, f"relative error {err:.3g} >= {tol}"


def assert_written(pages: np.ndarray, expected: np.ndarray, new: np.ndarray, meta: AttentionMetadata) -> None:
    """`pages` is the pool after a write of `new` (one of k, v) at `meta.slot_mapping` into LAYER.

    Only what a scatter guarantees on every backend: several padding tokens aim at one null-page slot,
    and a GPU scatter with duplicate indices is not atomic per row, so such a slot may hold a mix of
    their rows, each element taken from one of them. Every other slot must equal `expected` exactly
    (the real tokens' rows at their slots, everything else untouched).
    """
    ps = pages.shape[2]
    padding = np.arange(NUM_TOKENS) >= meta.cu_q_lens[meta.num_seqs]
    shared = np.zeros(pages.shape[:3], bool)  # [L, N, ps]: the slots padding tokens aim at
    slots = meta.slot_mapping[padding]
    assert (slots // ps == NULL_PAGE).all(), "padding tokens must aim at the null page"
    shared[LAYER, slots // ps, slots % ps] = True
    np.testing.assert_array_equal(pages[~shared], expected[~shared])
    for offset in np.unique(slots % ps):
        rows = new[padding & (meta.slot_mapping == NULL_PAGE * ps + offset)]  # [aimed, Hkv, D]
        held = pages[LAYER, NULL_PAGE, offset]
        from_some_row = (held[None] == rows).any(axis=0)
        assert from_some_row.all(), (f"null-page slot {offset}: {np.count_nonzero(~from_some_row)} elements "
                                     "match none of the padding rows aimed at it")


@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_kv_write_touches_exactly_the_target_slots(shapes):
    case = make_case(shapes, seed=1, poison=True)
    meta = device_meta(case.meta)
    got = write_kv_pages(device(case.k_pages, shapes), device(case.v_pages, shapes), jnp.int32(LAYER),
                         device(case.k, shapes), device(case.v, shapes), meta.slot_mapping, interpret=True)
    ref = reference.write_kv(device(case.k_pages, shapes), device(case.v_pages, shapes), jnp.int32(LAYER),
                             device(case.k, shapes), device(case.v, shapes), meta.slot_mapping)
    for pages, ref_pages, expected, new in zip(got, ref, pool_after_write(case), (case.k, case.v)):
        for result in (pages, ref_pages):
            assert_written(np.asarray(result.astype(jnp.float32)), expected, new, case.meta)
        # Outside the null page, the kernel and the reference store the same bits.
        np.testing.assert_array_equal(np.asarray(pages.astype(jnp.float32))[:, 1:],
                                      np.asarray(ref_pages.astype(jnp.float32))[:, 1:])


@pytest.mark.parametrize("shapes,block_k,num_splits", [
    (SHAPES[0], 16, 3), (SHAPES[1], 8, 5), (SHAPES[2], 32, None), (SHAPES[3], 16, 1), (SHAPES[4], 16, 4),
], ids=str)
def test_decode_attention_matches_numpy(shapes, block_k, num_splits):
    case = make_case(shapes, seed=2, poison=True)
    k_pages, v_pages = pool_after_write(case)
    out, covered = decode_attention(device(case.q, shapes), device(k_pages, shapes), device(v_pages, shapes),
                                    jnp.int32(LAYER), device_meta(case.meta), scale=shapes.head_dim ** -0.5,
                                    block_k=block_k, num_splits=num_splits, interpret=True)
    decodes = row_tokens(case.meta, lambda n: n == 1)
    np.testing.assert_array_equal(np.asarray(covered), decodes)
    assert_close(np.asarray(out)[decodes], numpy_attention(case, shapes.num_q_heads)[decodes], shapes.tol)
    assert_close(np.asarray(out)[decodes], module_reference(case, shapes)[decodes], shapes.tol)
    assert not np.asarray(out)[~decodes].any()


@pytest.mark.parametrize("shapes,tile_rows,block_k", [
    (SHAPES[0], 16, 16), (SHAPES[1], 16, 8), (SHAPES[2], 32, 32), (SHAPES[3], 16, 16), (SHAPES[4], 64, 16),
], ids=str)
def test_prefill_attention_matches_numpy(shapes, tile_rows, block_k):
    case = make_case(shapes, seed=3, poison=True)
    k_pages, v_pages = pool_after_write(case)
    out, covered = prefill_attention(device(case.q, shapes), device(k_pages, shapes), device(v_pages, shapes),
                                     jnp.int32(LAYER), device_meta(case.meta), scale=shapes.head_dim ** -0.5,
                                     tile_rows=tile_rows, block_k=block_k, interpret=True)
    chunks = row_tokens(case.meta, lambda n: n >= 2)
    np.testing.assert_array_equal(np.asarray(covered), chunks)
    assert_close(np.asarray(out)[chunks], numpy_attention(case, shapes.num_q_heads)[chunks], shapes.tol)
    assert_close(np.asarray(out)[chunks], module_reference(case, shapes)[chunks], shapes.tol)
    assert not np.asarray(out)[~chunks].any()


def test_prefill_work_items_cover_every_chunk_token_once():
    """The device-built item table: each chunk token in exactly one item row, items within the bound."""
    case = make_case(SHAPES[1], seed=4, poison=False)
    block_q = 4
    items = work_items(device_meta(case.meta), NUM_TOKENS, block_q)
    table = np.asarray(items.table)
    assert table.shape[0] == max_work_items(NUM_TOKENS, NUM_ROWS, block_q)
    chunks = row_tokens(case.meta, lambda n: n >= 2)
    np.testing.assert_array_equal(np.asarray(items.covered), chunks)
    seen = np.zeros(NUM_TOKENS, int)
    for seq, q_start, num_q, first_pos in table:
        seen[q_start:q_start + num_q] += 1
        if num_q:
            assert case.meta.seq_ids[q_start] == seq and case.meta.positions[q_start] == first_pos
    np.testing.assert_array_equal(seen, chunks.astype(int))
    token_item, token_row = np.asarray(items.token_item), np.asarray(items.token_row)
    for t in np.flatnonzero(chunks):
        assert table[token_item[t], 1] + token_row[t] == t


@pytest.mark.parametrize("shapes", SHAPES[:3], ids=str)
def test_work_items_planned_before_the_layer_loop_are_the_ones_used(shapes):
    """A layer loop builds the prefill kernel's work items once (`plan_step`, models' decoder stacks):
    the kernel then gives bit for bit its output without them, and does read the planned ones (items
    planned for a step with no row give no output). Not for the reference, nor inside a decode-only
    program."""
    case = make_case(shapes, seed=3, poison=True)
    k_pages, v_pages = pool_after_write(case)
    meta = device_meta(case.meta)
    group = shapes.num_q_heads // shapes.num_kv_heads
    planned = plan_step(meta, "pallas_interpret", NUM_TOKENS, group)
    assert plan_step(meta, "reference", NUM_TOKENS, group) is meta
    with decode_only_steps():
        assert plan_step(meta, "pallas", NUM_TOKENS, group) is meta
    args = (device(case.q, shapes), device(k_pages, shapes), device(v_pages, shapes), jnp.int32(LAYER))
    run = jax.jit(lambda m: prefill_attention(*args, m, scale=shapes.head_dim ** -0.5, interpret=True)[0])
    want = np.asarray(run(meta))
    assert want.any()
    np.testing.assert_array_equal(np.asarray(run(planned)), want)
    empty = plan_step(meta._replace(num_seqs=jnp.int32(0)), "pallas", NUM_TOKENS, group).prefill_items
    assert not np.asarray(run(meta._replace(prefill_items=empty))).any()


@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_pallas_path_matches_numpy_with_poisoned_pool(shapes):
    """Write + decode + prefill with the default tiles, through the dispatcher."""
    case = make_case(shapes, seed=5, poison=True)
    out, k_pages, v_pages = paged_attention(
        device(case.q, shapes), device(case.k, shapes), device(case.v, shapes), device(case.k_pages, shapes),
        device(case.v_pages, shapes), jnp.int32(LAYER), device_meta(case.meta), scale=shapes.head_dim ** -0.5,
        impl="pallas_interpret")
    real = np.arange(NUM_TOKENS) < case.meta.cu_q_lens[case.meta.num_seqs]
    assert_close(np.asarray(out)[real], numpy_attention(case, shapes.num_q_heads)[real], shapes.tol)
    assert_close(np.asarray(out)[real], module_reference(case, shapes)[real], shapes.tol)
    assert not np.asarray(out)[~real].any()
    for pages, expected in zip((k_pages, v_pages), pool_after_write(case)):
        np.testing.assert_array_equal(np.asarray(pages.astype(jnp.float32))[:, 1:], expected[:, 1:])


def test_wide_heads_take_smaller_tiles():
    """A 512-wide head (Gemma 4's full layers) halves a program's query rows and keys, so its tiles keep
    the bytes of a 256-wide one's (an H100's shared memory); the items planned for it are the ones the
    kernel uses, and the dispatcher's output is numpy's."""
    assert [for_head_dim(TILE_ROWS, d) for d in (64, 256, 512)] == [TILE_ROWS, TILE_ROWS, TILE_ROWS // 2]
    assert for_head_dim(BLOCK_K, 512) == BLOCK_K // 2
    shapes = Shapes(page_size=8, head_dim=512, num_q_heads=8, num_kv_heads=2)
    case = make_case(shapes, seed=5, poison=True)
    planned = plan_step(device_meta(case.meta), "pallas_interpret", NUM_TOKENS, 4, head_dim=512)
    assert planned.prefill_items.block_q == block_q_of(4, TILE_ROWS // 2)
    out, _, _ = paged_attention(
        device(case.q, shapes), device(case.k, shapes), device(case.v, shapes), device(case.k_pages, shapes),
        device(case.v_pages, shapes), jnp.int32(LAYER), planned, scale=shapes.head_dim ** -0.5,
        impl="pallas_interpret")
    real = np.arange(NUM_TOKENS) < case.meta.cu_q_lens[case.meta.num_seqs]
    assert_close(np.asarray(out)[real], numpy_attention(case, shapes.num_q_heads)[real], shapes.tol)


@pytest.mark.parametrize("shapes", [SHAPES[1], SHAPES[4]], ids=str)
def test_pallas_path_matches_module_reference(shapes):
    """Stale (finite) slots instead of NaN: the reference masks scores but multiplies stale values by 0."""
    case = make_case(shapes, seed=6, poison=False)
    args = (device(case.q, shapes), device(case.k, shapes), device(case.v, shapes), device(case.k_pages, shapes),
            device(case.v_pages, shapes), jnp.int32(LAYER), device_meta(case.meta))
    scale = shapes.head_dim ** -0.5
    out, k_pages, v_pages = paged_attention(*args, scale=scale, impl="pallas_interpret")
    ref_out, ref_k, ref_v = paged_attention(*args, scale=scale, impl="reference")
    real = np.arange(NUM_TOKENS) < case.meta.cu_q_lens[case.meta.num_seqs]
    assert_close(np.asarray(out)[real], np.asarray(ref_out.astype(jnp.float32), np.float64)[real], shapes.tol)
    assert_close(np.asarray(out)[real], numpy_attention(case, shapes.num_q_heads)[real], shapes.tol)
    for pages, ref_pages in ((k_pages, ref_k), (v_pages, ref_v)):
        np.testing.assert_array_equal(np.asarray(pages.astype(jnp.float32))[:, 1:],
                                      np.asarray(ref_pages.astype(jnp.float32))[:, 1:])


def pallas_kernel_names(jaxpr) -> list[str]:
    names = [e.params["name"] for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    for e in jaxpr.eqns:
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            names += pallas_kernel_names(sub)
    return names


def test_decode_only_steps_launch_the_decode_kernel_alone():
    """Single-token rows and padding, traced under `decode_only_steps` (a decode burst): the KV write
    and the decode kernel only, and bit for bit the outputs and pools of the mixed path."""
    shapes = SHAPES[1]
    rng = np.random.default_rng(4)
    ps, d, hkv = shapes.page_size, shapes.head_dim, shapes.num_kv_heads
    rows = ((13, 1), (37, 1), (0, 1), (150, 1))
    sizes = [-(-(ctx + n) // ps) for ctx, n in rows]
    pages = np.split(NULL_PAGE + 1 + rng.permutation(sum(sizes)), np.cumsum(sizes)[:-1])
    meta = device_meta(build_metadata(rows, pages, num_tokens=6, num_rows=5, page_size=ps, width=max(sizes)))

    def rand(*shape):
        return device(rng.standard_normal(shape), shapes)

    pool = rand(NUM_LAYERS, 1 + sum(sizes), ps, hkv, d)
    args = (rand(6, shapes.num_q_heads, d), rand(6, hkv, d), rand(6, hkv, d), pool, pool + 1, jnp.int32(LAYER), meta)

    def step(*a):
        return paged_attention(*a, scale=d ** -0.5, impl="pallas_interpret")

    mixed = step(*args)
    assert pallas_kernel_names(jax.make_jaxpr(step)(*args).jaxpr) == [
        "write_kv_pages", "paged_decode_attention", "paged_prefill_attention"]
    with decode_only_steps():
        alone = step(*args)
        assert pallas_kernel_names(jax.make_jaxpr(step)(*args).jaxpr) == ["write_kv_pages", "paged_decode_attention"]
    assert np.asarray(mixed[0].astype(jnp.float32))[:4].any()
    for got, want in zip(alone, mixed):
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


def round_to_tf32(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to TF32's 10 mantissa bits (what a TF32 tensor core multiplies)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


@pytest.mark.parametrize("block", [1, 4, 7, NUM_TOKENS])
def test_reference_query_blocks_of_any_size(monkeypatch, block):
    """Part A's per-row query blocks: each real token in one slot of its row's item, within the bound,
    and the same attention as the oracle from one token per item to the whole step in one."""
    shapes = SHAPES[3]
    case = make_case(shapes, seed=11, poison=True)
    qb = reference.query_blocks(device_meta(case.meta), NUM_TOKENS, block)
    token, item, slot = np.asarray(qb.token), np.asarray(qb.token_item), np.asarray(qb.token_slot)
    assert token.shape == ((NUM_TOKENS + NUM_ROWS * (block - 1)) // block, block)
    real = np.arange(NUM_TOKENS) < case.meta.cu_q_lens[case.meta.num_seqs]
    np.testing.assert_array_equal(token[item[real], slot[real]], np.flatnonzero(real))
    np.testing.assert_array_equal(np.asarray(qb.row)[item[real]], case.meta.seq_ids[real])
    monkeypatch.setattr(reference, "query_block_size", lambda num_tokens, num_rows: block)
    assert_close(module_reference(case, shapes)[real], numpy_attention(case, shapes.num_q_heads)[real], shapes.tol)


@pytest.mark.parametrize("block_tokens", [4, 24])
@pytest.mark.parametrize("shapes", [SHAPES[2], SHAPES[3]], ids=str)
def test_reference_ragged_key_blocks(monkeypatch, shapes, block_tokens):
    """Part A's ragged blocks with small blocks: rows need from 0 to 38 blocks, one iteration holds
    several blocks of one row and a row's blocks span iterations; the oracle's result either way."""
    monkeypatch.setattr(reference, "_BLOCK_TOKENS", block_tokens)
    case = make_case(shapes, seed=12, poison=True)
    real = np.arange(NUM_TOKENS) < case.meta.cu_q_lens[case.meta.num_seqs]
    assert_close(module_reference(case, shapes)[real], numpy_attention(case, shapes.num_q_heads)[real], shapes.tol)


def test_reference_attention_float32_is_full_precision():
    """The reference multiplies float32 in float32, not TF32, on whatever backend runs the tests.

    XLA's default float32 dot on a GPU is TF32, which put the reference 3-6e-4 off the oracle on an
    H100. head_dim 128 and full 24-bit mantissas: the second half checks, on any backend, that merely
    rounding these inputs to TF32 moves the exact result far outside the tolerance.
    """
    shapes, tol = SHAPES[0], 1e-5
    assert shapes.head_dim == 128 and shapes.dtype == "float32"
    case = make_case(shapes, seed=10, poison=False)
    real = np.arange(NUM_TOKENS) < case.meta.cu_q_lens[case.meta.num_seqs]
    oracle = numpy_attention(case, shapes.num_q_heads)[real]
    assert_close(module_reference(case, shapes)[real], oracle, tol)

    tf32_case = case._replace(q=round_to_tf32(case.q), k_history=[round_to_tf32(x) for x in case.k_history],
                              v_history=[round_to_tf32(x) for x in case.v_history])
    tf32 = numpy_attention(tf32_case, shapes.num_q_heads)[real]
    tf32_err = np.max(np.abs(tf32 - oracle)) / np.max(np.abs(oracle))
    assert tf32_err > 10 * tol, f"inputs too insensitive to TF32 rounding: {tf32_err:.3g}"


def test_all_padding_one_token_step_touches_only_the_null_page():
    """The engine's warmup step: T = S = 1 and no sequence; the token writes into the null page."""
    meta = build_metadata((), [], num_tokens=1, num_rows=1, page_size=8, width=4)
    pool = jnp.full((NUM_LAYERS, 4, 8, 2, 64), jnp.nan)
    q, kv = jnp.ones((1, 8, 64)), jnp.ones((1, 2, 64))
    out, k_pages, _ = paged_attention(q, kv, kv, pool, pool, jnp.int32(LAYER), device_meta(meta), scale=0.125,
                                      impl="pallas_interpret")
    assert not np.asarray(out).any()
    assert np.isnan(np.asarray(k_pages)[:, 1:]).all()
    np.testing.assert_array_equal(np.asarray(k_pages)[LAYER, NULL_PAGE, 0], np.ones((2, 64)))


def test_model_forward_on_pallas_path_matches_reference():
    """Two engine-like steps of a tiny random Llama: prefill chunks, then decodes mixed with a chunk.

    float32 throughout, with every XLA dot at full precision (on a GPU the default is TF32, whose
    rounding of the projections would swamp the attention differences this test bounds).
    """
    cfg = ModelConfig(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=8, num_kv_heads=2, head_dim=32)
    model = nnx.merge(*build_state(cfg, None, jnp.float32, seed=0))  # random `dummy:`-style weights
    wqkv = model.layers.wqkv  # [L, E, Hkv, G + 2, D]: scale q and k (not v) for sharper attention
    wqkv[...] = wqkv[...].at[..., :-1, :].multiply(20)
    ps, width, num_pages, num_tokens, num_rows = 8, 6, 16, 32, 4
    pages = [[3, 7, 1], [12, 5, 9, 2], [14, 6]]
    steps = [((0, 11), (0, 17)),  # two prompts' first chunks
             ((11, 1), (17, 9), (0, 6))]  # a decode, the second prompt's next chunk, a new prompt
    tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, (len(steps), num_tokens))
    results = {}
    for impl in ("reference", "pallas_interpret"):
        kv = (jnp.zeros((cfg.num_layers, num_pages, ps, cfg.num_kv_heads, cfg.head_dim)),) * 2
        results[impl] = []
        for rows, step_tokens in zip(steps, tokens):
            meta = build_metadata(rows, pages[:len(rows)], num_tokens=num_tokens, num_rows=num_rows, page_size=ps,
                                  width=width)
            last = np.where(np.arange(num_rows) < len(rows), np.maximum(meta.cu_q_lens[1:] - 1, 0), 0)
            with jax.default_matmul_precision("highest"):
                logits, kv = model(jnp.asarray(step_tokens), kv, device_meta(meta), jnp.asarray(last),
                                   attn_impl=impl)
            results[impl].append((np.asarray(logits)[:len(rows)], kv))
    for (ref_logits, ref_kv), (logits, kv) in zip(results["reference"], results["pallas_interpret"]):
        assert_close(logits, ref_logits.astype(np.float64), 1e-4)
        for pages_got, pages_ref in zip(kv, ref_kv):
            np.testing.assert_allclose(np.asarray(pages_got)[:, 1:], np.asarray(pages_ref)[:, 1:], rtol=1e-4,
                                       atol=1e-5)


def test_resolve_impl():
    assert resolve_impl("auto") == ("pallas" if jax.default_backend() == "gpu" else "reference")
    for name in IMPLS[1:]:
        assert resolve_impl(name) == name
    with pytest.raises(ValueError, match="unknown attention implementation"):
        resolve_impl("flash")


def test_a_cpu_pinned_call_takes_the_cpu_kernels_on_a_gpu_machine(monkeypatch):
    """Kernel choices follow `jax.default_device`, not only the default backend: under a CPU pin on
    a GPU machine (simulated here), a call takes the CPU path, so CPU-kernel tests run there too."""
    from infire_jax.models import palette_kernels, quant_kernels
    from pallas_kernels import cpu_kernels, placement

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.delenv("INFIRE_JAX_QUANT_MATMUL", raising=False)
    assert placement.platform() == "gpu" and resolve_impl("auto") == "pallas" and not cpu_kernels.on_cpu()
    assert palette_kernels.palette_kernel_here() == palette_kernels.TILES and quant_kernels.dense_impl() == "pallas"
    with jax.default_device(jax.devices("cpu")[0]):
        assert placement.platform() == "cpu" and resolve_impl("auto") == "reference"
        assert cpu_kernels.on_cpu() == cpu_kernels.available()
        assert palette_kernels.palette_kernel_here() != palette_kernels.TILES
        assert quant_kernels.dense_impl() == ("cpu" if cpu_kernels.available() else "xla")


def test_head_dim_the_kernels_cannot_tile_is_refused():
    case = make_case(Shapes(page_size=8, head_dim=64, num_q_heads=4, num_kv_heads=2), seed=8, poison=False)
    q = jnp.zeros((NUM_TOKENS, 4, 48))
    kv = jnp.zeros((NUM_TOKENS, 2, 48))
    pool = jnp.zeros((NUM_LAYERS, 4, 8, 2, 48))
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        paged_attention(q, kv, kv, pool, pool, jnp.int32(0), device_meta(case.meta), scale=1.0,
                        impl="pallas_interpret")


def test_num_splits_fill_the_gpu_without_empty_splits():
    assert choose_num_splits(num_rows=1, num_kv_heads=8, max_blocks=64) == 32
    assert choose_num_splits(num_rows=1, num_kv_heads=8, max_blocks=8) == 8
    assert choose_num_splits(num_rows=64, num_kv_heads=8, max_blocks=64) == 1
    assert choose_num_splits(num_rows=16, num_kv_heads=8, max_blocks=64) == 3


def lower_pallas_step_for_cuda(pool_dtype=jnp.bfloat16, *, local: bool = False) -> str:
    """The whole Pallas path (KV write and both attention kernels) lowered for CUDA, as StableHLO
    text, and compiled for an H100 (tests/h100.py); an fp8 pool takes its per-(layer, kv head) scales
    in the metadata, a local layer its LocalMask (traced chunk and window). Skips where the jaxlib
    cannot lower Triton kernels without a GPU.

    jaxlib <= 0.10.2 emits the Triton IR into the HLO without compiling it, so this runs on CPU too;
    later jaxlibs compile to PTX while lowering, which needs a GPU.
    """
    if not LOWERS_TRITON_HERE:
        pytest.skip(lowers_triton_here.kwargs["reason"])
    t, s, hq, hkv, d, ps = 64, 16, 32, 8, 128, 16
    sd, i32, bf16 = jax.ShapeDtypeStruct, jnp.int32, jnp.bfloat16
    scales = sd((2, 2, hkv), jnp.float32) if jnp.dtype(pool_dtype) == jnp.float8_e4m3fn else None
    mask = LocalMask(sd((), i32), sd((), i32)) if local else None
    meta = AttentionMetadata(sd((t,), i32), sd((t,), i32), sd((t,), i32), sd((s, 256), i32), sd((s,), i32),
                             sd((s + 1,), i32), sd((), i32), scales, mask)
    pool = sd((2, 1024, ps, hkv, d), pool_dtype)

    def step(q, k, v, k_pages, v_pages, layer, meta):
        return paged_attention(q, k, v, k_pages, v_pages, layer, meta, scale=d ** -0.5, impl="pallas")

    jitted = jax.jit(step, donate_argnums=(3, 4))
    args = (sd((t, hq, d), bf16), sd((t, hkv, d), bf16), sd((t, hkv, d), bf16), pool, pool, sd((), i32), meta)
    lowered = gpu_lowered(jitted, *args)  # lowered once: its text, then compiled from it
    hlo = lowered.as_text()
    names = ("write_kv_pages", "paged_decode_attention", "paged_prefill_attention")
    for name in names:
        assert f'name = "{name}"' in hlo
    kernels = compiled_kernels(lowered)  # and they compile to sm_90a machine code
    assert all(launches(kernels, name) for name in names), kernels
    return hlo


def test_gpu_lowering_emits_three_triton_kernels():
    """Lowers the whole Pallas path for CUDA through Pallas' Triton rules."""
    hlo = lower_pallas_step_for_cuda()
    # The KV write updates both pools in place: its outputs alias its pool operands (4 and 5).
    aliases = re.findall(r"output_operand_alias<output_tuple_indices = \[(\d)\], operand_index = (\d)", hlo)
    assert sorted(aliases) == [("0", "4"), ("1", "5")]


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="runs the compiled kernels, needs a GPU")
def test_compiled_kernels_on_gpu_match_numpy_and_reference():
    shapes = Shapes(page_size=16, head_dim=128, num_q_heads=32, num_kv_heads=8, dtype="bfloat16")
    case = make_case(shapes, seed=9, poison=False)
    args = (device(case.q, shapes), device(case.k, shapes), device(case.v, shapes), device(case.k_pages, shapes),
            device(case.v_pages, shapes), jnp.int32(LAYER), device_meta(case.meta))
    out, k_pages, _ = jax.jit(lambda *a: paged_attention(*a, scale=shapes.head_dim ** -0.5, impl="pallas"))(*args)
    ref_out, ref_k, _ = paged_attention(*args, scale=shapes.head_dim ** -0.5, impl="reference")
    real = np.arange(NUM_TOKENS) < case.meta.cu_q_lens[case.meta.num_seqs]
    assert_close(np.asarray(out.astype(jnp.float32))[real], numpy_attention(case, shapes.num_q_heads)[real],
                 shapes.tol)
    assert_close(np.asarray(out.astype(jnp.float32))[real], np.asarray(ref_out.astype(jnp.float32))[real],
                 shapes.tol)
    np.testing.assert_array_equal(np.asarray(k_pages)[:, 1:], np.asarray(ref_k)[:, 1:])


def test_benchmark_covers_the_llama_8b_grid():
    cases = {case.name: case for case in benchmark.bench_cases()}
    for batch in (1, 64, 256):
        for context in (1024, 2048, 4096):
            case = cases.pop(f"decode_b{batch}_ctx{context}")
            assert case.kind == "decode" and case.num_tokens == batch
            assert all(ctx + n == context for ctx, n in case.rows)
    prefill = cases.pop("prefill_2048")
    assert prefill.kind == "prefill" and prefill.rows == ((0, 2048),)
    assert not cases
    shapes = benchmark.LLAMA_3_1_8B
    assert (shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim, shapes.page_size, shapes.dtype) == (
        32, 8, 128, 16, "bfloat16")


def test_benchmark_traffic_model():
    shapes = benchmark.LLAMA_3_1_8B
    decode = benchmark.BenchCase("d", ((1023, 1),) * 2)
    row_bytes = 8 * 128 * 2  # one token's keys of all kv heads, bfloat16
    q_bytes = 32 * 128 * 2
    assert benchmark.attention_traffic(decode, shapes) == (2 * 2 * 1024 * row_bytes + 2 * 2 * q_bytes,
                                                           4 * 2 * 1024 * 32 * 128)
    assert benchmark.write_traffic(decode, shapes) == (2 * 2 * 2 * row_bytes + 2 * 4, 0)
    prefill = benchmark.BenchCase("p", ((0, 4),))
    assert benchmark.attention_traffic(prefill, shapes).flops == 4 * (1 + 2 + 3 + 4) * 32 * 128


def test_benchmark_refuses_to_run_without_gpu():
    with pytest.raises(SystemExit, match="needs a GPU"):
        benchmark.require_gpu("cpu")
    benchmark.require_gpu("gpu")


@pytest.mark.parametrize("case", [benchmark.BenchCase("decode_small", ((20, 1), (44, 1), (7, 1))),
                                  benchmark.BenchCase("prefill_small", ((0, 24),))], ids=lambda c: c.name)
def test_benchmark_case_runs_in_interpret_mode(case):
    """The benchmark's plumbing (metadata, donated pool chain, timings, error check) on tiny shapes."""
    shapes = benchmark.ModelShapes(num_q_heads=4, num_kv_heads=2, head_dim=32, page_size=8, dtype="float32")
    meta, num_pages = benchmark.step_metadata(case, shapes.page_size, np.random.default_rng(0))
    assert num_pages == 1 + sum(-(-(ctx + n) // shapes.page_size) for ctx, n in case.rows)
    assert sorted(np.unique(meta.slot_mapping // shapes.page_size)) == sorted(
        np.unique(meta.page_table[meta.seq_ids, meta.positions // shapes.page_size]))
    results = benchmark.run_case(case, shapes, iters=1, repeats=1, hbm_bytes_per_s=1e9, interpret=True)
    assert [e["kernel"] for e in results] == ["write_kv", f"{case.kind}_attention", "pallas", "reference"]
    for entry in results:
        assert "error" not in entry, entry.get("error")
        assert entry["seconds"] > 0
        assert entry["hbm_fraction"] == pytest.approx(entry["bytes"] / entry["seconds"] / 1e9)
        assert entry["pallas_vs_reference_rel_err"] < F32_TOL
