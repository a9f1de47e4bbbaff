"""MiniMax-M2 (models/glm4_moe.py with its q/k norms over all heads) against HF transformers'
MiniMaxM2ForCausalLM, through the real engine.

A tiny random checkpoint (3 layers, every one a MoE of 8 experts, top-2 by the sigmoid scores plus
random score-correction biases; q and k RMS-normed over all their heads with random weights; 8 of the
16 head dimensions rotated) is loaded by our HF loader and decoded greedily with chunked prefill: tokens
equal HF's `generate`, logprobs agree within 1e-3 (float32). Then ep 8 and tp 2 x ep 4 against one device,
the published config's parameter count against transformers' own model, and what is refused.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from deepseek_models import VOCAB, _save_tokenizer, hf_greedy

from infire_jax.errors import UnsupportedModelError
from infire_jax.models.hf_config import config_from_hf

SHARPEN = 4.0  # the LM head scaled up, so greedy decoding has no near-ties between float32 engines
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=8,
            num_key_value_heads=2, head_dim=16, rotary_dim=8, num_local_experts=8, num_experts_per_tok=2,
            rope_theta=5_000_000.0, max_position_embeddings=2048, bos_token_id=256, eos_token_id=257,
            pad_token_id=0, initializer_range=0.3)
NUM_TOKENS = 32
PROMPTS = [[5, 77, 200, 13, 42], list(range(60, 100)), [258, 3, 3, 190, 64, 99, 120, 7, 250, 11, 31, 17, 90, 200]]
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 32), max_model_len=128,
              page_size=4, num_kv_pages=160)


def hf_model():
    """The tiny random MiniMax-M2 in float32, its LM head sharpened."""
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    torch.manual_seed(0)
    hf = MiniMaxM2ForCausalLM(MiniMaxM2Config(**TINY)).to(torch.float32).eval()
    with torch.no_grad():  # HF starts the score-correction bias at 0 and the norms at 1; random ones count
        for name, p in [*hf.named_parameters(), *hf.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn_like(p) * 0.3)
            elif "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
        hf.lm_head.weight.mul_(SHARPEN)
    return hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = hf_model()
    path = tmp_path_factory.mktemp("minimax_m2")
    hf.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    return hf, str(path)


def test_generate_matches_hf(checkpoint):
    from infire_jax import LLM, SamplingParams

    hf, path = checkpoint
    llm = LLM(model=path, **ENGINE)
    try:
        cfg = llm.engine.model_config
        assert cfg.architecture == "minimax_m2" and cfg.glm4.qk_norm_whole and cfg.glm4.rotary_dim == 8
        assert not cfg.attention_bias and cfg.deepseek_moe.first_k_dense_replace == 0
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1))
        for prompt, out in zip(PROMPTS, outs):
            want, want_lp = hf_greedy(hf, prompt, NUM_TOKENS)
            got = out.outputs[0]
            assert got.token_ids == want
            np.testing.assert_allclose([lp[t].logprob for lp, t in zip(got.logprobs, want)], want_lp, atol=1e-3, rtol=0)
    finally:
        llm.engine.close()


def test_meshes_match_one_device(checkpoint, tmp_path):
    """ep 8 (one expert a device, attention whole on each) and tp 2 x ep 4 (the heads, with the q/k norms
    over all of them, split 2 ways: their mean squares summed over tp) in one process with 8 virtual
    devices: one device's greedy tokens, logprobs within float32 rounding. tp 4, beyond the 2 kv heads
    (which would count a repeated head twice in the k norm), is refused by name."""
    from test_sharding import ROOT, _assert_each_device_holds_its_shard, _results, _run_worker

    _, path = checkpoint
    runs = [{"model": path, "mesh": os.path.join(ROOT, "sharding", "configs", f"{m}.yaml"), "tag": m}
            for m in ("1", "8-ep8", "8-tp2-ep4", "4")]
    engine = {**{k: v for k, v in ENGINE.items() if k != "dtype"}, "token_buckets": [32], "num_decode_steps": 1}
    job = {"runs": runs, "prompts": PROMPTS, "max_tokens": 16, "engine": engine}
    results = {r["tag"]: r for r in _results(_run_worker(job, 8, tmp_path, "minimax"))}
    refused = results.pop("4")
    assert not refused["fits"] and "tp=4 exceeds minimax_m2's 2 kv heads" in refused["error"], refused
    single = results.pop("1")
    for tag, r in results.items():
        assert r["fits"] and r["tokens"] == single["tokens"], (tag, r.get("error"))
        np.testing.assert_allclose(r["logprobs"], single["logprobs"], atol=1e-4, rtol=0)
        _assert_each_device_holds_its_shard(r)
    ep, tp = ({k: v["spec"] for k, v in r["params"].items()} for r in (results["8-ep8"], results["8-tp2-ep4"]))
    assert ep["moe_layers.w_down"][1] == "ep" and ep["moe_layers.q_norm"] == [None, None]
    assert tp["moe_layers.q_norm"] == tp["moe_layers.k_norm"] == [None, "tp"] and tp["moe_layers.w_down"][1] == "ep"


def test_published_config_counts_transformers_parameters():
    """`dummy:minimax-m2` (the published config): the model the engine builds (abstractly) and its memory
    plan count the parameters of transformers' MiniMaxM2ForCausalLM (on the meta device, the router's
    score-correction bias included): 228.7B."""
    import math

    from flax import nnx
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    from infire_jax.loaders.dummy import CONFIGS
    from infire_jax.memplan.model import from_model_config
    from infire_jax.models.registry import abstract_model

    hf = CONFIGS["minimax-m2"]
    cfg = config_from_hf(hf)
    ours_only = ("model_type", "qk_norm_type", "scoring_func", "use_routing_bias", "use_qk_norm")
    with torch.device("meta"):
        model = MiniMaxM2ForCausalLM(MiniMaxM2Config(**{k: v for k, v in hf.items() if k not in ours_only}))
    count = sum(p.numel() for p in model.parameters()) + sum(b.numel() for n, b in model.named_buffers()
                                                             if n.endswith("e_score_correction_bias"))
    built = sum(np.prod(v.shape) for _, v in nnx.to_flat_state(nnx.state(abstract_model(cfg, jnp.bfloat16))))
    assert cfg.param_count() == built == count == 228_689_764_864
    assert sum(math.prod(t.shape) for t in from_model_config(cfg, "bfloat16").tensors) == built


@pytest.mark.parametrize("field,value,match", [
    ("qk_norm_type", "per_head", "qk_norm_type"), ("scoring_func", "softmax", "scoring_func"),
    ("shared_intermediate_size", 512, "shared_intermediate_size"), ("attn_type_list", [1, 0, 1], "attn_type_list"),
    ("rotary_dim", 9, "rotary_dim"), ("routed_scaling_factor", 2.5, "routed_scaling_factor"),
    ("some_new_field", 1, "not a field")])
def test_config_refuses_what_it_cannot_honour(field, value, match):
    with pytest.raises(UnsupportedModelError, match=match):
        config_from_hf({**TINY, "model_type": "minimax_m2", field: value})
