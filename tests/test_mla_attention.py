"""MLA attention in the absorbed form (W_uk folded into q, W_uv after attention over the latent
pages), the jnp reference and the Pallas decode kernel (interpret mode), against the expanded form
in float64 numpy: per-head keys [c W_uk, k_pe] and values c W_uv built from each sequence's whole
latent history, which never looks at the pages.

The batch is test_kernels' mix (prefill chunks with and without cached prefixes, decodes over short
and long contexts, padding). Pool slots the step must not read hold stale random values.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from h100 import compiled_kernels, launches

from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.mla import mla_attention
from pallas_kernels.mla_decode import mla_decode_attention
from test_kernels import LAYER, NUM_LAYERS, NUM_ROWS, NUM_TOKENS, ROWS, build_metadata, device_meta

R, DR, DN, DV = 32, 16, 16, 12
SCALE = 0.17


class MLACase(NamedTuple):
    q_nope: np.ndarray  # [T, H, Dn]
    q_pe: np.ndarray  # [T, H, Dr]
    latent: np.ndarray  # [T, R], this step's
    k_pe: np.ndarray  # [T, Dr]
    w_uk: np.ndarray  # [H, Dn, R]
    w_uv: np.ndarray  # [H, R, Dv]
    latent_pages: np.ndarray  # [L, N, ps, 1, R]
    rope_pages: np.ndarray  # [L, N, ps, 1, Dr]
    meta: AttentionMetadata
    history: list[tuple[np.ndarray, np.ndarray]]  # per row: every latent and rope key after the step


def make_case(page_size: int, seed: int, h: int = 4) -> MLACase:
    rng = np.random.default_rng(seed)
    num_pages = [-(-(ctx + n) // page_size) for ctx, n in ROWS]
    order = rng.permutation(np.arange(1, sum(num_pages) + 4))
    starts = np.cumsum([0] + num_pages)
    pages = [order[starts[i]:starts[i + 1]] for i in range(len(ROWS))]
    meta = build_metadata(ROWS, pages, num_tokens=NUM_TOKENS, num_rows=NUM_ROWS, page_size=page_size,
                          width=max(num_pages) + 2)
    n_pool = len(order) + 1
    latent_pages = rng.standard_normal((NUM_LAYERS, n_pool, page_size, 1, R)).astype(np.float32)
    rope_pages = rng.standard_normal((NUM_LAYERS, n_pool, page_size, 1, DR)).astype(np.float32)
    latent = rng.standard_normal((NUM_TOKENS, R)).astype(np.float32)
    k_pe = rng.standard_normal((NUM_TOKENS, DR)).astype(np.float32)
    history = []
    for i, (ctx, n) in enumerate(ROWS):
        c, kr = rng.standard_normal((ctx + n, R)), rng.standard_normal((ctx + n, DR))
        c, kr = c.astype(np.float32), kr.astype(np.float32)
        pos = np.arange(ctx)
        latent_pages[LAYER, pages[i][pos // page_size], pos % page_size, 0] = c[:ctx]
        rope_pages[LAYER, pages[i][pos // page_size], pos % page_size, 0] = kr[:ctx]
        latent[meta.cu_q_lens[i]:meta.cu_q_lens[i + 1]] = c[ctx:]
        k_pe[meta.cu_q_lens[i]:meta.cu_q_lens[i + 1]] = kr[ctx:]
        history.append((c, kr))
    w = [(rng.standard_normal(s) / np.sqrt(R)).astype(np.float32) for s in ((h, DN, R), (h, R, DV))]
    q_nope = rng.standard_normal((NUM_TOKENS, h, DN)).astype(np.float32)
    q_pe = rng.standard_normal((NUM_TOKENS, h, DR)).astype(np.float32)
    return MLACase(q_nope, q_pe, latent, k_pe, *w, latent_pages, rope_pages, meta, history)


def expanded_float64(case: MLACase) -> np.ndarray:
    """Per-head keys and values expanded from the latents, causal attention over each sequence."""
    h = case.w_uk.shape[0]
    out = np.full((NUM_TOKENS, h, DV), np.nan)
    w_uk, w_uv = case.w_uk.astype(np.float64), case.w_uv.astype(np.float64)
    for i, (ctx, n) in enumerate(ROWS):
        rows = slice(case.meta.cu_q_lens[i], case.meta.cu_q_lens[i + 1])
        c, kr = (x.astype(np.float64) for x in case.history[i])
        keys = np.concatenate([np.einsum("mr,hdr->mhd", c, w_uk), np.repeat(kr[:, None], h, axis=1)], axis=-1)
        values = np.einsum("mr,hrv->mhv", c, w_uv)
        q = np.concatenate([case.q_nope[rows], case.q_pe[rows]], axis=-1).astype(np.float64)
        scores = np.einsum("nhd,mhd->hnm", q, keys) * SCALE
        causal = np.arange(ctx + n)[None, :] <= (ctx + np.arange(n))[:, None]
        scores = np.where(causal[None], scores, -np.inf)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[rows] = np.einsum("hnm,mhv->nhv", p / p.sum(axis=-1, keepdims=True), values)
    return out


def run(case: MLACase, form: str = "absorbed", impl: str = "reference"):
    fn = jax.jit(lambda *a: mla_attention(*a, scale=SCALE, impl=impl, form=form))
    return fn(*(jnp.asarray(x) for x in case[:8]), jnp.int32(LAYER), device_meta(case.meta))


@pytest.mark.parametrize("form,impl", [("absorbed", "reference"), ("expanded", "reference"),
                                       ("absorbed", "pallas_interpret")])
@pytest.mark.parametrize("page_size", [16, 5])
def test_step_matches_expanded_float64(page_size, form, impl):
    """Both forms of the jnp path (absorbed throughout, or the step's tokens expanded), and the
    Pallas path (decode rows through the kernel, prompt chunks through the reference)."""
    case = make_case(page_size, seed=page_size)
    out, latent_pages, rope_pages = run(case, form, impl)
    real = np.arange(NUM_TOKENS) < case.meta.cu_q_lens[case.meta.num_seqs]
    want = expanded_float64(case)
    err = np.max(np.abs(np.asarray(out, np.float64)[real] - want[real])) / np.max(np.abs(want[real]))
    assert err < 2e-5, err
    assert np.isfinite(np.asarray(out)).all()
    # The step's latents and rope keys landed in their slots of LAYER, and nothing else changed.
    slots = case.meta.slot_mapping[real]
    want_latent, want_rope = case.latent_pages.copy(), case.rope_pages.copy()
    want_latent[LAYER, slots // page_size, slots % page_size, 0] = case.latent[real]
    want_rope[LAYER, slots // page_size, slots % page_size, 0] = case.k_pe[real]
    keep = np.ones(want_latent.shape[:3], bool)
    keep[:, 0] = False  # the null page takes padding writes
    np.testing.assert_array_equal(np.asarray(latent_pages)[keep], want_latent[keep])
    np.testing.assert_array_equal(np.asarray(rope_pages)[keep], want_rope[keep])


@pytest.mark.parametrize("page_size,heads,splits", [(16, 4, None), (5, 20, 3)])
def test_pallas_decode_kernel_matches_float64(page_size, heads, splits):
    """Interpret mode on CPU: decode rows only (the others are 0 and not covered); 20 heads are two
    head blocks, 3 splits exercise the flash-decoding combine."""
    case = make_case(page_size, seed=heads, h=heads)
    _, latent_pages, rope_pages = run(case)  # the pages after this step's write
    q_lat = jnp.einsum("thd,hdr->thr", case.q_nope, case.w_uk)
    out_lat, covered = jax.jit(lambda *a: mla_decode_attention(*a, scale=SCALE, num_splits=splits, interpret=True))(
        q_lat, jnp.asarray(case.q_pe), latent_pages, rope_pages, jnp.int32(LAYER), device_meta(case.meta))
    covered = np.asarray(covered)
    decodes = np.zeros(NUM_TOKENS, bool)
    for i, (_, n) in enumerate(ROWS):
        decodes[case.meta.cu_q_lens[i]:case.meta.cu_q_lens[i + 1]] = n == 1
    np.testing.assert_array_equal(covered, decodes)
    out = np.einsum("thr,hrv->thv", np.asarray(out_lat, np.float64), case.w_uv.astype(np.float64))
    want = expanded_float64(case)
    err = np.max(np.abs(out[covered] - want[covered])) / np.max(np.abs(want[covered]))
    assert err < 2e-5, err
    assert not np.asarray(out_lat)[~covered].any()


@pytest.mark.parametrize("pool_dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
def test_pallas_decode_kernel_compiles_for_an_h100(pool_dtype):
    """DeepSeek-V3's shapes on one of 8 GPUs (16 heads, a 512-wide latent, 64 rope dims, 64 rows): the
    kernel compiles to sm_90a machine code here (tests/h100.py), bfloat16 and fp8 pools."""
    t, s, h, r, dr, ps = 64, 16, 16, 512, 64, 64
    sd, i32 = jax.ShapeDtypeStruct, jnp.int32
    meta = AttentionMetadata(sd((t,), i32), sd((t,), i32), sd((t,), i32), sd((s, 64), i32), sd((s,), i32),
                             sd((s + 1,), i32), sd((), i32))
    scale = sd((2, 1), jnp.float32) if pool_dtype == jnp.float8_e4m3fn else None
    fn = jax.jit(lambda *a: mla_decode_attention(*a[:6], scale=0.1, kv_scale=a[6] if len(a) > 6 else None))
    args = (sd((t, h, r), jnp.bfloat16), sd((t, h, dr), jnp.bfloat16), sd((2, 1024, ps, 1, r), pool_dtype),
            sd((2, 1024, ps, 1, dr), pool_dtype), sd((), i32), meta) + ((scale,) if scale is not None else ())
    kernels = compiled_kernels(fn, *args)
    assert launches(kernels, "paged_mla_decode"), kernels
