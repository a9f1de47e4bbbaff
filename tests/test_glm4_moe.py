"""GLM-4.5 (models/glm4_moe.py) against HF transformers' Glm4MoeForCausalLM, through the real engine.

Tiny random checkpoints (4 layers, the first dense; 8 experts in 2 groups of which 1 is kept, top-2,
one shared expert; q/k/v biases; half of each head rotated; with and without GLM-4.5's q/k norms;
random score-correction biases and norms, a routed scaling of 2.5; a multi-token-prediction layer in
the checkpoint, which is skipped) are loaded by our HF loader and decoded greedily with chunked prefill:
tokens equal HF's `generate`, logprobs agree within 1e-3 (float32). Then a tp/ep mesh against one
device, the published configs' parameter counts against transformers' own model, and what is refused.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from deepseek_models import VOCAB, _save_tokenizer, hf_greedy

from infire_jax.errors import ConfigError, UnsupportedModelError
from infire_jax.models.hf_config import config_from_hf

SHARPEN = 4.0  # the LM head scaled up, so greedy decoding has no near-ties between float32 engines
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5,
            attention_bias=True, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
            topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            rope_theta=1_000_000.0, max_position_embeddings=2048, bos_token_id=256, eos_token_id=257,
            pad_token_id=0, initializer_range=0.3, num_nextn_predict_layers=1)
NUM_TOKENS = 32
PROMPTS = [[5, 77, 200, 13, 42], list(range(60, 100)), [258, 3, 3, 190, 64, 99, 120, 7, 250, 11, 31, 17, 90, 200]]
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 32), max_model_len=128,
              page_size=4, num_kv_pages=160)


def hf_model(**overrides):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**{**TINY, **overrides})).to(torch.float32).eval()
    with torch.no_grad():  # HF zeroes biases and starts norms at 1; random ones make each count
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("bias", "e_score_correction_bias")):
                p.copy_(torch.randn_like(p) * 0.3)
            elif "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
        model.lm_head.weight.mul_(SHARPEN)
    return model


def _save(model, path) -> str:
    """The checkpoint as published: with a multi-token-prediction layer after the last (random tensors
    under `model.layers.{n}.`, which transformers skips too)."""
    from safetensors.numpy import load_file, save_file

    model.save_pretrained(path, safe_serialization=True)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    n = model.config.num_hidden_layers
    extra = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): v for k, v in tensors.items()
             if k.startswith(f"model.layers.{n - 1}.")}
    extra[f"model.layers.{n}.eh_proj.weight"] = np.ones((64, 128), np.float32)
    save_file({**tensors, **extra}, file)
    _save_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module", params=[False, True], ids=["air", "qk-norm"])
def checkpoint(request, tmp_path_factory):
    hf = hf_model(use_qk_norm=request.param)
    return hf, _save(hf, tmp_path_factory.mktemp("glm4"))


def test_generate_matches_hf(checkpoint):
    from infire_jax import LLM, SamplingParams

    hf, path = checkpoint
    llm = LLM(model=path, **ENGINE)
    try:
        cfg = llm.engine.model_config
        assert cfg.architecture == "glm4_moe" and cfg.glm4.rotary_dim == 8 and cfg.qk_norm == hf.config.use_qk_norm
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1))
        for prompt, out in zip(PROMPTS, outs):
            want, want_lp = hf_greedy(hf, prompt, NUM_TOKENS)
            got = out.outputs[0]
            assert got.token_ids == want
            np.testing.assert_allclose([lp[t].logprob for lp, t in zip(got.logprobs, want)], want_lp, atol=1e-3, rtol=0)
    finally:
        llm.engine.close()


def test_meshes_match_one_device(checkpoint, tmp_path):
    """tp 2 (heads with their biases and q/k norms, the dense and shared MLPs' widths, each expert's
    width) and tp 2 x ep 4 (2 whole experts a device), in one process with 8 virtual devices: one
    device's greedy tokens, logprobs within float32 rounding of the reductions' order; pp is refused
    naming the architecture."""
    from test_sharding import ROOT, _assert_each_device_holds_its_shard, _results, _run_worker

    _, path = checkpoint
    meshes = ["1", "2", "8-tp2-ep4", "2-pp2"]
    runs = [{"model": path, "mesh": os.path.join(ROOT, "sharding", "configs", f"{m}.yaml"), "tag": m} for m in meshes]
    engine = {**{k: v for k, v in ENGINE.items() if k != "dtype"}, "token_buckets": [32], "num_decode_steps": 1}
    job = {"runs": runs, "prompts": PROMPTS, "max_tokens": 16, "engine": engine}
    results = {r["tag"]: r for r in _results(_run_worker(job, 8, tmp_path, "glm4"))}
    refused = results.pop("2-pp2")
    assert not refused["fits"] and "pipeline parallelism is not supported for glm4_moe" in refused["error"]
    single = results["1"]
    for mesh, r in results.items():
        assert r["fits"] and r["tokens"] == single["tokens"], (mesh, r.get("error"))
        np.testing.assert_allclose(r["logprobs"], single["logprobs"], atol=1e-4, rtol=0)
        if mesh == "1":
            continue
        _assert_each_device_holds_its_shard(r)
        specs = {k: v["spec"] for k, v in r["params"].items()}
        if mesh == "2":
            assert specs["moe_layers.bqkv"][1] == "tp" and specs["dense_layers.w_down"] == [None, "tp", None]
            assert specs["moe_layers.w_shared_down"] == [None, "tp", None]
        else:
            assert specs["moe_layers.w_down"][1] == "ep" and specs["moe_layers.router_bias"] == [None, None]
            assert specs["moe_layers.wqkv"][2] == "tp"


def test_fp8_at_load_equals_its_float_twin(tmp_path, monkeypatch):
    """`weights_quantization="fp8"` (e4m3, a float32 scale per output channel; wo's per head): both stacks'
    attention and MLPs, the routed and the shared experts are held as their fp8 parts alone, and the engine
    gives the tokens and logprobs of the float engine on a twin checkpoint whose projections are the
    format's decoded values (tests/quant_twins.py); also through the GPU's kernels (interpret mode), which
    read the parts in place (the dense quantized matmul, the grouped one for the experts)."""
    from infire_jax import SamplingParams
    from quant_twins import assert_kept_and_follows_twin, quantize_twin, twin_outputs

    hf = hf_model()
    path = _save(hf, tmp_path / "float")
    quantize_twin(hf, "fp8", lambda name: TINY["head_dim"])
    engine = dict(ENGINE, token_buckets=(32,))
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    want = twin_outputs(_save(hf, tmp_path / "twin"), engine, PROMPTS, params)
    kept = [f"dense_layers.{w}" for w in ("wqkv", "wo", "w_gate_up", "w_down")] + [
        f"moe_layers.{w}" for w in ("wqkv", "wo", "w_gate_up", "w_down", "w_shared_gate_up", "w_shared_down")]
    quantized = dict(engine, weights_quantization="fp8")
    assert_kept_and_follows_twin(path, quantized, kept, "fp8", PROMPTS, params, want, 1e-5)
    monkeypatch.setenv("INFIRE_JAX_QUANT_MATMUL", "pallas")
    monkeypatch.setenv("INFIRE_JAX_MOE_GROUPED", "pallas")
    assert_kept_and_follows_twin(path, quantized, kept, "fp8", PROMPTS, params, want, 1e-4)


@pytest.mark.parametrize("name", ["glm-4.5-air", "glm-4.5"])
def test_published_configs_count_transformers_parameters(name):
    """`dummy:glm-4.5-air` and `dummy:glm-4.5` (the published configs): the model the engine builds
    (abstractly) and its memory plan count the parameters of transformers' Glm4MoeForCausalLM (on the
    meta device, the router's score-correction bias included), 106.85B for Air."""
    import math

    from flax import nnx
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from infire_jax.loaders.dummy import CONFIGS
    from infire_jax.memplan.model import from_model_config
    from infire_jax.models.registry import abstract_model

    cfg = config_from_hf(CONFIGS[name])
    with torch.device("meta"):
        hf = Glm4MoeForCausalLM(Glm4MoeConfig(**{k: v for k, v in CONFIGS[name].items() if k != "model_type"}))
    count = sum(p.numel() for p in hf.parameters()) + sum(b.numel() for n, b in hf.named_buffers()
                                                          if n.endswith("e_score_correction_bias"))
    built = sum(np.prod(v.shape) for _, v in nnx.to_flat_state(nnx.state(abstract_model(cfg, jnp.bfloat16))))
    assert cfg.param_count() == built == count
    assert sum(math.prod(t.shape) for t in from_model_config(cfg, "bfloat16").tensors) == built
    if name == "glm-4.5-air":
        assert count == 106_852_251_264 and cfg.glm4.rotary_dim == 64


@pytest.mark.parametrize("field,value,match", [
    ("partial_rotary_factor", 1.5, "partial_rotary_factor"), ("hidden_act", "gelu", "hidden_act"),
    ("n_group", 3, "n_group"), ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "rope_scaling"),
    ("some_new_field", 1, "not a field")])
def test_config_refuses_what_it_cannot_honour(field, value, match):
    with pytest.raises(UnsupportedModelError, match=match):
        config_from_hf({**TINY, "model_type": "glm4_moe", field: value})


def test_refuses_lora(checkpoint):
    from infire_jax import LLM

    _, path = checkpoint
    with pytest.raises(ConfigError, match="not on glm4_moe"):
        LLM(model=path, **ENGINE, enable_lora=True)
