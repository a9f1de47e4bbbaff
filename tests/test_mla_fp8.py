"""An fp8 latent pool (MLA, DeepSeek-V3 family): the jnp reference (both forms) and the Pallas decode
kernel (interpret mode) against test_mla_attention's float64 expanded oracle over the values
ml_dtypes dequantizes, and a tiny DeepSeek-V3 engine with an fp8 cache against a bfloat16 one.

One scale per layer for the latent and one for the rotary key (the pool's single "kv head").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepseek_models import hf_model, save
from pallas_kernels.kv_quant import FP8
from pallas_kernels.mla import mla_attention
from test_kernels import LAYER, NUM_LAYERS, NUM_TOKENS, device_meta
from test_mla_attention import SCALE, expanded_float64, make_case

KV_SCALE = np.array([[0.02], [0.015]], np.float32)  # [latent, rotary key]: N(0, 1) values stay below 448


def _codes(x: np.ndarray, scale: float) -> np.ndarray:
    return np.clip(x.astype(np.float32) / np.float32(scale), -448, 448).astype(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("form,impl", [("absorbed", "reference"), ("expanded", "reference"),
                                       ("absorbed", "pallas_interpret")])
def test_fp8_latent_pool_matches_float64_over_dequantized_values(form, impl):
    """Pages of fp8 codes, the step's latents quantized at write: every path equals attention over
    the dequantized history up to float32 rounding, and the written codes are ml_dtypes' own."""
    case = make_case(5, seed=5)
    c_scale, r_scale = KV_SCALE[:, 0]
    history = [(_codes(c, c_scale).astype(np.float64) * c_scale, _codes(k, r_scale).astype(np.float64) * r_scale)
               for c, k in case.history]
    want = expanded_float64(case._replace(history=history))
    scales = np.ones((NUM_LAYERS, 2, 1), np.float32)
    scales[LAYER] = KV_SCALE
    meta = device_meta(case.meta)._replace(kv_scales=jnp.asarray(scales))
    pages = [jnp.asarray(_codes(case.latent_pages, c_scale)), jnp.asarray(_codes(case.rope_pages, r_scale))]
    assert pages[0].dtype == FP8
    fn = jax.jit(lambda *a: mla_attention(*a, scale=SCALE, impl=impl, form=form))
    out, latent_pages, rope_pages = fn(*(jnp.asarray(x) for x in case[:6]), *pages, jnp.int32(LAYER), meta)
    real = np.arange(NUM_TOKENS) < case.meta.cu_q_lens[case.meta.num_seqs]
    err = np.max(np.abs(np.asarray(out, np.float64)[real] - want[real])) / np.max(np.abs(want[real]))
    assert err < 2e-5, err
    slots = case.meta.slot_mapping[real]
    ps = latent_pages.shape[2]
    written = np.asarray(latent_pages)[LAYER, slots // ps, slots % ps, 0]
    np.testing.assert_array_equal(written.view(np.uint8), _codes(case.latent[real], c_scale).view(np.uint8))
    written = np.asarray(rope_pages)[LAYER, slots // ps, slots % ps, 0]
    np.testing.assert_array_equal(written.view(np.uint8), _codes(case.k_pe[real], r_scale).view(np.uint8))


PROMPTS = [[5, 77, 200, 13, 42], [258, 3, 3, 190, 64, 99, 120, 7, 250, 11, 31], list(range(60, 100)),
           [9, 8, 7, 6, 5, 4, 3, 2, 1], list(range(200, 230))]
NUM_TOKENS_GENERATED = 32
BF16_PAGE_BYTES = 3 * 16 * (32 + 8) * 2  # 3 layers, page of 16, latent 32 + rope key 8, bfloat16


def test_deepseek_engine_with_fp8_latents_follows_the_bfloat16_cache(tmp_path):
    """The same pool bytes hold twice the pages; greedy tokens follow a bfloat16 cache. The tiny
    random model's top token has ~2% probability, so near-ties flip: fp8 moves logprobs by ~0.03
    (bfloat16 against float32: ~0.001) and the first difference comes after 4-12 tokens (bfloat16
    against float32: 20 or more). Broken scales differ at once."""
    from infire_jax import LLM, Engine, EngineConfig, SamplingParams

    model = save("deepseek-v3", hf_model("deepseek-v3"), tmp_path)
    # no decode bursts: the cache's fp8 latents are the subject, and a burst is the engines' largest program
    config = dict(model=model, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 32),
                  max_model_len=128, kv_cache_memory=20 * BF16_PAGE_BYTES, num_decode_steps=1)
    bf16, fp8 = (Engine(EngineConfig(**config, kv_cache_dtype=d)) for d in ("bfloat16", "fp8"))
    assert bf16.pool_sizing.num_pages == 20 and fp8.pool_sizing.num_pages == 40
    assert fp8.runner.kv_cache_bytes == bf16.runner.kv_cache_bytes
    scales = fp8.runner.kv_scales
    assert scales.shape == (3, 2, 1) and (scales > 1e-4).all()  # calibrated: one latent and one rope scale a layer
    params = SamplingParams(max_tokens=NUM_TOKENS_GENERATED, temperature=0, ignore_eos=True, logprobs=1)
    want, got = (LLM(engine=e).generate(PROMPTS, params) for e in (bf16, fp8))
    agreed, diffs = [], []
    for w, g in zip(want, got):
        same = next((i for i, (a, b) in enumerate(zip(w.token_ids, g.token_ids)) if a != b), NUM_TOKENS_GENERATED)
        agreed.append(same)
        diffs += [abs(w.logprobs[i][t].logprob - g.logprobs[i][t].logprob) for i, t in enumerate(w.token_ids[:same])]
    print(f"\nDeepSeek-V3 tiny, fp8 vs bfloat16 latent cache, {len(PROMPTS)} prompts x {NUM_TOKENS_GENERATED} "
          f"greedy tokens: first difference at {sorted(agreed)} ({sum(agreed)} tokens agree before it); "
          f"logprob difference there: median {np.median(diffs):.4f}, largest {max(diffs):.4f}")
    assert min(agreed) >= 3 and np.median(agreed) >= 5
    assert np.median(diffs) < 0.1
