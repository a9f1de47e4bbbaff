"""The fp8 KV cache on the real default model: greedy agreement with a bfloat16 cache, twice the pages
in the same bytes and fewer preemptions, and fp8 pages through prefix caching, KV transfer and hot
standby. Two engines (bfloat16 and fp8 caches, same float32 model, same pool bytes) serve every test.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from infire_jax import LLM, Engine, EngineConfig, SamplingParams
from infire_jax.runner.device_memory import kv_bytes_per_page
from infire_jax.engine.args import KV_CACHE_DTYPE_CHOICES
from infire_jax.errors import ConfigError, InvalidRequestError
from infire_jax.runner.kv_scales import resolve_kv_cache_dtype
from pallas_kernels.kv_quant import FP8

from tests.conftest import SMALL_ENGINE
from test_bench_perplexity import short_text_perplexity
from test_kv_transfer import run

BF16_PAGE_BYTES = 30 * 16 * 3 * (64 + 64) * 2  # SmolLM2-135M: 30 layers, 3 kv heads of 64, page of 16
POOL_BYTES = 40 * BF16_PAGE_BYTES
# No decode bursts: the fp8 pool is the subject (bursts: test_decode_burst.py), and a burst of each
# decode-sized bucket is the largest program the two engines compile.
CONFIG = dict(SMALL_ENGINE, max_model_len=512, num_kv_pages=None, kv_cache_memory=POOL_BYTES, num_decode_steps=1)
PROMPTS = [
    "The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):", "List three primary colors:",
    "Explain photosynthesis in one sentence.", "The meaning of life is", "Translate 'good morning' to Spanish:",
    "Once upon a time, in a small village,", "What is 12 times 13?", "The best way to learn programming is",
    "import numpy as np\n", "Dear hiring manager,", "Q: Why is the sky blue?\nA:", "A recipe for pancakes:",
    "The history of the Roman Empire", "SELECT name FROM users WHERE", "My favorite book is",
    "Summarize the plot of Hamlet:", "The three laws of motion are", "How do vaccines work?",
]
NUM_TOKENS = 64


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    return (Engine(EngineConfig(**CONFIG, kv_cache_dtype="bfloat16")),
            Engine(EngineConfig(**CONFIG, kv_cache_dtype="fp8")))


def test_every_flag_choice_resolves():
    for name in KV_CACHE_DTYPE_CHOICES:
        resolve_kv_cache_dtype(name, "float32")
    assert resolve_kv_cache_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    assert resolve_kv_cache_dtype("fp8_e4m3", "float32") == FP8
    with pytest.raises(ConfigError, match="kv_cache_dtype 'int4'"):
        resolve_kv_cache_dtype("int4", "float32")


def test_same_bytes_hold_twice_the_pages(engines):
    bf16, fp8 = engines
    assert bf16.pool_sizing.num_pages == 40 and fp8.pool_sizing.num_pages == 80
    assert bf16.pool_sizing.page_bytes == BF16_PAGE_BYTES == 2 * fp8.pool_sizing.page_bytes
    assert kv_bytes_per_page(bf16.model_config, 16, FP8) == BF16_PAGE_BYTES // 2
    assert fp8.runner.kv_cache_bytes == bf16.runner.kv_cache_bytes  # 80 fp8 pages, 40 bfloat16 ones
    assert fp8.runner.cache.k_pages.shape[1] == 80 and fp8.runner.cache.k_pages.dtype == np.uint8


def test_bench_counts_a_byte_an_element_of_the_fp8_pool(engines):
    """`bench latency`'s KV bytes a decode step reads are the pool's: half the bfloat16 pool's for the
    same contexts."""
    from infire_jax.bench import latency, roofline

    peaks = roofline.DevicePeaks("cpu", "cpu", 1e10, 1e11, "float32", 1 << 20, 64)
    bf16, fp8 = (latency.measure(e, peaks, batch=1, input_len=16, output_len=6, iters=1, warmup=0, seed=0)
                 for e in engines)
    assert bf16["decode_kv_mb_per_step"] == pytest.approx(2 * fp8["decode_kv_mb_per_step"])
    assert bf16["decode_kv_mb_per_step"] == pytest.approx(BF16_PAGE_BYTES / 16 * (16 + 3) / 1e6, rel=0.1)


def test_perplexity_within_2_percent_of_the_bfloat16_cache(engines):
    """The quality issue's bound on fp8 KV (replacing greedy agreement): perplexity at most 2% above
    the bfloat16 cache's (+1.0% on this text; the pool of 40 / 80 pages preempts and resumes windows)."""
    bf16, fp8 = (short_text_perplexity(LLM(engine=e)) for e in engines)
    assert fp8 <= 1.02 * bf16, (fp8, bf16)


def test_greedy_tokens_follow_the_bfloat16_cache(engines):
    """e4m3 keeps 3 mantissa bits (bfloat16: 7), so a near-tie flips sooner than with bfloat16 (which
    agrees with a float32 cache on 19 of these 20 prompts): on the default model the first difference
    comes after a median of ~12 tokens, and the issue's 'most prompts equal for 64 tokens' does not
    hold (docs/PERFORMANCE.md). The bounds catch broken scales or kernels, which differ at once."""
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    want, got = (LLM(engine=e).generate(PROMPTS, params) for e in engines)
    agreed, diffs = [], []
    for w, g in zip(want, got):
        w, g = w.outputs[0], g.outputs[0]
        same = next((i for i, (a, b) in enumerate(zip(w.token_ids, g.token_ids)) if a != b), NUM_TOKENS)
        agreed.append(same)
        diffs += [abs(w.logprobs[i][t].logprob - g.logprobs[i][t].logprob) for i, t in enumerate(w.token_ids[:same])]
    full = sum(a == NUM_TOKENS for a in agreed)
    print(f"\nfp8 vs bfloat16 KV cache, {len(PROMPTS)} prompts x {NUM_TOKENS} greedy tokens: {full} agree on all; "
          f"first difference at {sorted(agreed)}; logprob difference on the agreed prefixes: median "
          f"{np.median(diffs):.4f}, 90th percentile {np.percentile(diffs, 90):.4f}, largest {max(diffs):.4f}")
    assert sum(a >= 4 for a in agreed) >= 12
    assert np.median(agreed) >= 8
    assert np.median(diffs) < 5e-2


def test_fewer_preemptions_in_the_same_bytes(engines):
    """Eight rows of 120 tokens need 64 pages: the bfloat16 pool (39 usable) preempts, fp8 (79) need not."""
    prompts = [f"Story {i}: " + "the quick brown fox jumps over the lazy dog " * 4 for i in range(8)]
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    counts = []
    for engine in engines:
        before = engine.scheduler.num_preemptions
        LLM(engine=engine).generate(prompts, params)
        counts.append(engine.scheduler.num_preemptions - before)
    print(f"\npreemptions, 8 rows x 120 tokens in {POOL_BYTES} bytes of pool: bfloat16 {counts[0]}, fp8 {counts[1]}")
    assert counts[0] > 0 and counts[1] < counts[0], counts


def _run(engine: Engine, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens and the prefix-cache hit of one request (test_kv_transfer's `run`)."""
    tokens, _, cached = run(engine, prompt, max_tokens=16)
    return tokens, cached


PROMPT = [1] + [100 + (7 * i) % 3000 for i in range(70)]  # 4 full pages and a tail


def test_prefix_cache_transfer_and_standby_keep_fp8_pages(engines):
    """A prefix-cache hit gives the tokens of the uncached run; the pages exported (fp8 bits) and
    imported into the same engine after it left the device and came back (pool zeroed, scales
    restored) serve the prompt with the same tokens again."""
    bf16, fp8 = engines
    fp8.kv.drop_cached()
    want, cached = _run(fp8, PROMPT)
    assert cached == 0
    assert _run(fp8, PROMPT) == (want, 64)

    blocks = fp8.export_prompt_kv(PROMPT)
    assert blocks.num_blocks == 4 and blocks.k.dtype == FP8 and blocks.layout.dtype == "float8_e4m3fn"
    assert blocks.nbytes == 2 * 30 * 4 * 16 * 3 * 64  # one byte a value
    scales = fp8.runner.kv_scales.copy()
    fp8.demote()
    fp8.promote()
    np.testing.assert_array_equal(fp8.runner.kv_scales, scales)
    np.testing.assert_array_equal(np.asarray(fp8.runner.cache.kv_scales), scales)
    assert fp8.import_prompt_kv(blocks) == 4
    assert _run(fp8, PROMPT) == (want, 64)
    fp8.kv.drop_cached()
    assert _run(fp8, PROMPT) == (want, 0)  # and with the standby's empty pool, a prefill of its own

    with pytest.raises(InvalidRequestError, match="dtype is 'float8_e4m3fn' in the transfer and 'bfloat16' here"):
        bf16.import_prompt_kv(blocks)
    other = dataclasses.replace(blocks, layout=dataclasses.replace(blocks.layout, kv_scales="0" * 16))
    with pytest.raises(InvalidRequestError, match="kv_scales"):
        fp8.import_prompt_kv(other)

