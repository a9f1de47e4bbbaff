"""The DeepSeek-V3 family (MLA + DeepSeek MoE) against HF transformers, through the real engine.

Tiny random DeepseekV3 and Kimi-K2.5-text checkpoints are saved to disk, loaded by our HF loader
and decoded greedily; tokens must equal HF's `generate` and logprobs agree within 1e-3 (float32).
"""

from __future__ import annotations

import numpy as np
import pytest

from deepseek_models import hf_model, save

NUM_TOKENS = 64
# The 40-token prompt is prefilled in two chunks (32-token budget).
PROMPTS = [[5, 77, 200, 13, 42], [258, 3, 3, 190, 64, 99, 120, 7, 250, 11, 31], list(range(60, 100))]


def _hf_greedy(hf, prompt: list[int]) -> tuple[list[int], list[float]]:
    import torch

    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    want = ref.sequences[0, len(prompt):].tolist()
    return want, [torch.log_softmax(step[0].double(), -1)[tok].item() for step, tok in zip(ref.logits, want)]


@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2.5"])
def test_generate_matches_hf(name, tmp_path):
    from infire_jax import LLM, SamplingParams

    hf = hf_model(name)
    llm = LLM(model=save(name, hf, tmp_path), dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
              token_buckets=(4, 32), max_model_len=128, num_kv_pages=40)
    cfg = llm.engine.model_config
    assert cfg.architecture == "deepseek_v3" and cfg.mla.kv_lora_rank == 32
    pool = llm.engine.runner.cache
    assert pool.k_pages.shape[3:] == (1, 32) and pool.v_pages.shape[3:] == (1, 8)  # latent, rope key
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1))
    for prompt, out in zip(PROMPTS, outs):
        want, want_lp = _hf_greedy(hf, prompt)
        assert out.token_ids == want
        np.testing.assert_allclose([lp[t] for lp, t in zip(out.logprobs, want)], want_lp, atol=1e-3, rtol=0)
