"""Parity with HF transformers (float32): greedy tokens and chosen-token logprobs.

The real model is the embedded SmolLM2 GGUF, which HF loads from the same file; tiny random
Llama-3 (rope_scaling llama3), Qwen2 (qkv bias) and Qwen3 (q/k norm) models are written as HF
directories by transformers itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infire_jax import LLM, SamplingParams

PROMPTS = [
    "The history of the Roman Empire begins with",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Ingredients for a simple bread: flour, water,",
    "Q: What is the boiling point of water at sea level?\nA:",
]


def hf_reference(model, prompt_ids: list[int], tokens: list[int]) -> tuple[list[int], list[float]]:
    """HF's greedy choice after the prompt and after each prefix of `tokens`, and the log-probability
    it gives each of `tokens`, from one forward over the prompt and `tokens` (teacher forcing): HF's
    own greedy decoding produces exactly `tokens` when every choice is the next token (by induction
    over the steps), and a forward of ~100 tokens costs a fraction of 64 decode steps."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + tokens[:-1]])).logits[0, len(prompt_ids) - 1:]
    lp = torch.log_softmax(logits.double(), dim=-1)
    return logits.argmax(-1).tolist(), lp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def assert_parity(llm: LLM, hf_model, prompts_ids: list[list[int]], n: int) -> None:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts_ids, params)
    for ids, out in zip(prompts_ids, outs):
        assert len(out.token_ids) == n
        ref_tokens, ref_lps = hf_reference(hf_model, ids, out.token_ids)
        assert out.token_ids == ref_tokens
        ours = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]
        np.testing.assert_allclose(ours, ref_lps, atol=1e-3, rtol=0)


def test_smollm2_matches_hf(smol_llm, hf_smol):
    prompts = [smol_llm.tokenizer.encode(p) for p in PROMPTS]
    chat = smol_llm.tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about rivers."}])
    prompts.append(smol_llm.tokenizer.encode(chat, add_special_tokens=False))
    assert_parity(smol_llm, hf_smol, prompts, 64)


def test_smollm2_chat_answer(smol_llm):
    out = smol_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(max_tokens=32, temperature=0))[0]
    assert "Paris" in out.text
    assert out.outputs[0].finish_reason == "stop"


def _tiny_hf_dir(tmp_path_factory, family: str, tokenizer) -> str:
    """A small random model of the family, written by transformers with our tokenizer beside it."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  initializer_range=0.3, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if family == "llama3":
        cfg = LlamaConfig(**common, rope_theta=500000.0, rms_norm_eps=1e-5, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    elif family == "qwen2":
        cfg = Qwen2Config(**common, rope_theta=1000000.0, rms_norm_eps=1e-6)
    else:
        cfg = Qwen3Config(**common, head_dim=32, rope_theta=1000000.0, rms_norm_eps=1e-6)
    torch.manual_seed({"llama3": 0, "qwen2": 1, "qwen3": 2}[family])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp(family)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save(str(path))
    return str(path), model


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_tiny_random_hf_dirs_match_hf(family, tmp_path_factory, smol_llm):
    path, hf_model = _tiny_hf_dir(tmp_path_factory, family, smol_llm.tokenizer)
    # 4 sequences of 512 tokens: 128 pages of 16 (the CPU's default pool, 1 GiB, is 40,000 of this model's)
    llm = LLM(model=path, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512,
              num_kv_pages=129)
    expect = {"llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[family]
    assert llm.engine.model_config.architecture == expect
    if family == "llama3":
        assert llm.engine.model_config.rope_scaling.kind == "llama3"
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    # A long prompt crosses several pages and is prefilled in chunks (64-token budget).
    prompts.append(llm.tokenizer.encode(" ".join(PROMPTS * 4)))
    assert_parity(llm, hf_model, prompts, 64)
