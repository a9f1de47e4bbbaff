"""Llama 4 (models/llama4.py) against HF transformers, through the real engine.

Tiny random checkpoints of both published layouts (tests/llama4_models.py) are loaded by our HF
loader and decoded greedily: tokens must equal HF's `generate` over 48 tokens and logprobs agree
within 1e-3 (float32). Prompt and output cross several 16-token chunks, a NoPE layer's temperature
changes every 8 positions, and dense and MoE layers interleave. Then the same family kept int8 with
n-gram speculation, with an fp8 KV cache, and on 2 and 8 virtual devices; its configs' errors; the
published configs' shapes.
"""

from __future__ import annotations

import numpy as np
import pytest

from deepseek_models import hf_greedy
from llama4_models import TEXT_CONFIGS, fp8_kv, hf_model, quantize_like_int8, save, text_model

NUM_TOKENS = 48
# 5 + 40 + 18 prompt tokens: the first 32-token step ends 27 tokens into the second prompt, mid-chunk.
PROMPTS = [[5, 77, 200, 13, 42], list(range(60, 100)),
           [258, 3, 3, 190, 64, 99, 120, 7, 250, 11, 31, 17, 90, 200, 33, 21, 8, 140]]
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 32), max_model_len=128,
              num_kv_pages=40)
GREEDY = dict(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[object, str]]:
    """name -> (the HF model, its saved checkpoint)."""
    out = {}
    for name in TEXT_CONFIGS:
        hf = hf_model(name)
        out[name] = hf, save(hf, tmp_path_factory.mktemp(name))
    return out


def _assert_matches(outs, hf) -> None:
    for prompt, out in zip(PROMPTS, outs):
        want, want_lp = hf_greedy(text_model(hf), prompt, NUM_TOKENS)
        assert out.token_ids == want
        np.testing.assert_allclose([lp[t] for lp, t in zip(out.logprobs, want)], want_lp, atol=1e-3, rtol=0)


# The causal model runs the CPU attention kernel; the multimodal one the Pallas kernels (interpret mode).
@pytest.mark.parametrize("name,impl", [("causal", "reference"), ("multimodal", "pallas_interpret")])
def test_generate_matches_hf(name, impl, checkpoints, caplog):
    from infire_jax import LLM, SamplingParams

    hf, path = checkpoints[name]
    with caplog.at_level("WARNING", logger="infire_jax.loaders.llama4_hf"):
        llm = LLM(model=path, attn_impl=impl, **ENGINE)
    vision = [r for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(vision) == (name == "multimodal")  # said once, for the layout that has one
    cfg = llm.engine.model_config
    l4 = cfg.llama4
    assert cfg.architecture == "llama4" and llm.engine.runner.rc.attn_impl == impl
    assert l4.temperature_tuning and l4.floor_scale == 8 and not all(l4.rope_layers)
    assert {c for c, _ in cfg.local_attention} == {0, 16}  # chunked RoPE layers, global NoPE layers
    assert l4.stack_sizes == {"dense": cfg.num_layers - cfg.num_layers // 2, "moe": cfg.num_layers // 2}
    _assert_matches(llm.generate(PROMPTS, SamplingParams(**GREEDY)), hf)
    llm.engine.close()


def test_int8_weights_with_ngram_speculation_match_hf_on_the_same_int8_weights(checkpoints):
    """`weights_quantization="int8"` keeps every stack's layer weights int8 (the experts and shared
    expert too); HF given the same per-channel int8 weights is the reference. Speculating with
    n-grams (which these repetitive greedy texts accept) changes no greedy token."""
    from flax import nnx

    from infire_jax import LLM, SamplingParams

    _, path = checkpoints["causal"]
    want = hf_model("causal")
    quantize_like_int8(want)
    llm = LLM(model=path, weights_quantization="int8", **ENGINE,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    placed = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(llm.engine.runner.state)}
    for name in ("dense_layers.wqkv", "dense_layers.w_down", "moe_layers.wo", "moe_layers.w_gate_up",
                 "moe_layers.w_shared_gate_up", "moe_layers.w_shared_down"):
        assert placed[f"{name}.int8"].dtype == np.int8 and name not in placed
    _assert_matches(llm.generate(PROMPTS, SamplingParams(**GREEDY)), want)
    assert llm.engine.spec.stats.num_accepted_tokens > 0
    assert llm.engine.compiles_since_warmup == 0
    llm.engine.close()


def test_fp8_kv_cache_matches_hf_on_the_same_fp8_keys_and_values(checkpoints, monkeypatch):
    """An fp8 (e4m3) pool, its per-(layer, kv head) scales calibrated at build; HF attending to its
    keys and values rounded to e4m3 with those scales is the reference."""
    from infire_jax import LLM, SamplingParams

    _, path = checkpoints["causal"]
    llm = LLM(model=path, kv_cache_dtype="fp8", **ENGINE)
    assert llm.engine.runner.cache.k_pages.dtype == np.uint8
    want = hf_model("causal")
    fp8_kv(want, llm.engine.runner.kv_scales, monkeypatch)
    _assert_matches(llm.generate(PROMPTS, SamplingParams(**GREEDY)), want)
    llm.engine.close()
