"""The DeepSeek-V3 family (MLA + DeepSeek MoE) against HF transformers, through the real engine.

Tiny random DeepseekV3 and Kimi-K2.5-text checkpoints are saved to disk, loaded by our HF loader
and decoded greedily; tokens must equal HF's `generate` and logprobs (of the prompts' tokens too) agree
within 1e-3 (float32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepseek_models import hf_greedy, hf_model, save

NUM_TOKENS = 64
# The 40-token prompt is prefilled in two chunks (32-token budget).
PROMPTS = [[5, 77, 200, 13, 42], [258, 3, 3, 190, 64, 99, 120, 7, 250, 11, 31], list(range(60, 100))]


# deepseek-v3 runs in a pool too small for all three sequences at once: requests are preempted
# (by recompute) and resume from their latent pages. kimi-k2.5 decodes through the Pallas kernel
# (interpret mode).
@pytest.mark.parametrize("name,pages,impl", [("deepseek-v3", 12, "reference"), ("kimi-k2.5", 40, "pallas_interpret")])
def test_generate_matches_hf(name, pages, impl, tmp_path):
    from infire_jax import LLM, SamplingParams

    hf = hf_model(name)
    llm = LLM(model=save(name, hf, tmp_path), dtype="float32", max_num_seqs=4, max_num_batched_tokens=32,
              token_buckets=(4, 32), max_model_len=128, num_kv_pages=pages, attn_impl=impl)
    cfg = llm.engine.model_config
    assert cfg.architecture == "deepseek_v3" and cfg.mla.kv_lora_rank == 32
    assert llm.engine.runner.rc.attn_impl == impl
    pool = llm.engine.runner.cache
    rope = cfg.mla.qk_rope_head_dim
    assert pool.k_pages.shape[3:] == (1, 32) and pool.v_pages.shape[3:] == (1, rope)  # latent, rope key
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1,
                                                prompt_logprobs=2))
    for prompt, out in zip(PROMPTS, outs):
        want, want_lp = hf_greedy(hf, prompt, NUM_TOKENS)
        assert out.token_ids == want
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(out.logprobs, want)], want_lp, atol=1e-3, rtol=0)
        with torch.no_grad():  # prompt logprobs: HF's forward over the prompt
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1).numpy()
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        np.testing.assert_allclose([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:])],
                                   ref[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-3, rtol=0)
    assert (llm.engine.scheduler.num_preemptions > 0) == (pages == 12)


def test_latent_pages_move_between_engines(tmp_path):
    """Prefill/decode disaggregation on an MLA pool: the exported blocks are the latent and the rope
    key (576 values a token for DeepSeek-V3; 32 + 8 here), the receiver's prefix cache serves them,
    and decoding from imported pages equals decoding from a local prefill."""
    from infire_jax import Engine, EngineConfig, SamplingParams

    model = save("deepseek-v3", hf_model("deepseek-v3"), tmp_path)
    config = dict(model=model, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 32),
                  max_model_len=128, num_kv_pages=16)
    sender, receiver = Engine(EngineConfig(**config)), Engine(EngineConfig(**config))
    prompt = PROMPTS[2]  # 40 tokens: 2 full pages of 16 and a tail

    def run(engine):
        engine.add_request(prompt, SamplingParams(max_tokens=16, temperature=0, logprobs=1, ignore_eos=True))
        tokens, cached = [], None
        while engine.has_unfinished():
            for d in engine.step():
                tokens += d.token_ids
                cached = d.num_cached_tokens
        return tokens, cached

    want, cached = run(sender)
    assert cached == 0
    blocks = sender.export_prompt_kv(prompt)
    assert blocks.k.shape == (3, 2, 16, 1, 32) and blocks.v.shape == (3, 2, 16, 1, 8)
    assert receiver.import_prompt_kv(blocks) == 2
    got, cached = run(receiver)
    assert cached == 32 and got == want


# ---- the real configurations, built abstractly -----------------------------------------------------

@pytest.mark.parametrize("name,experts,heads", [("deepseek-v3", 256, 128), ("kimi-k2.5", 384, 64)])
def test_dummy_configs_construct_abstractly(name, experts, heads):
    """`dummy:` carries the published config; shapes only (no allocation of ~1T weights). The count
    agrees with HF's own text model built on the meta device (plus the router biases, HF buffers)."""
    import math

    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from infire_jax.loaders.dummy import CONFIGS, load_dummy
    from infire_jax.models.kv_entry import kv_entry
    from infire_jax.models.registry import abstract_model
    from infire_jax.runner.device_memory import kv_bytes_per_page

    cfg = load_dummy(name).config
    assert (cfg.num_experts, cfg.num_heads, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim) == (experts, heads, 512, 64)
    assert cfg.rope_scaling.kind == "yarn"
    model = abstract_model(cfg, jnp.bfloat16)
    params = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert all(isinstance(v.get_value(), jax.ShapeDtypeStruct) for v in params.values())  # nothing allocated
    dense = cfg.deepseek_moe.first_k_dense_replace
    assert params["moe_layers.w_gate_up"].shape == (61 - dense, experts, 7168, 2, 2048)
    assert params["dense_layers.w_gate_up"].shape == (dense, 7168, 2, 18432)
    ours = sum(math.prod(v.shape) for v in params.values())
    # The pool: 576 values per token and layer (latent 512 + rope key 64), in bfloat16.
    assert kv_entry(cfg).k_dim + kv_entry(cfg).v_dim == 576
    assert kv_bytes_per_page(cfg, 16, jnp.bfloat16) == 61 * 16 * 576 * 2

    raw = dict(CONFIGS[name])
    raw = dict(raw["text_config"]) if raw["model_type"] == "kimi_k25" else raw
    raw.pop("model_type")
    with torch.device("meta"):
        hf = DeepseekV3ForCausalLM(DeepseekV3Config(**raw))
    hf_params = sum(p.numel() for p in hf.parameters())
    assert ours == cfg.param_count() == hf_params + (61 - dense) * experts


# ---- 8 virtual devices: expert and tensor parallel equal one device ---------------------------------

def test_ep_and_tp_meshes_match_one_device(tmp_path):
    import json
    import os

    from test_sharding import ROOT, _results, _run_worker

    model = save("deepseek-v3", hf_model("deepseek-v3"), tmp_path / "model")
    meshes = [os.path.join(ROOT, "sharding", "configs", f) for f in ("1.yaml", "8.yaml", "8-ep8.yaml", "8-tp2-ep4.yaml",
                                                                   "8-pp8.yaml")]
    # One bucket, one decode step a launch: what is checked here is the model's layout on the mesh; decode
    # bursts and the small bucket on meshes are test_sharding's (each is another program every engine compiles).
    # The steps are the same: the scheduler chunks by the 32-token budget, not by the buckets.
    engine = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, token_buckets=[32], num_kv_pages=40,
                  num_decode_steps=1)
    job = {"runs": [{"model": model, "mesh": m} for m in meshes], "prompts": ["Hello, MLA", "x" * 40, "abc"],
           "max_tokens": 12, "engine": engine}
    results = {os.path.basename(r["mesh"]): r for r in _results(_run_worker(job, 8, tmp_path, "ds8"))}
    assert "pipeline parallelism is not supported" in results.pop("8-pp8.yaml")["error"]
    single = results.pop("1.yaml")
    assert set(results) == {"8.yaml", "8-ep8.yaml", "8-tp2-ep4.yaml"}
    for name, r in results.items():
        assert r["fits"] and r["tokens"] == single["tokens"], (name, json.dumps(r)[:500])
        np.testing.assert_allclose(r["logprobs"], single["logprobs"], atol=1e-4)
        specs = {k: v["spec"] for k, v in r["params"].items()}
        if name != "8-ep8.yaml":  # tp splits heads and MLP widths
            assert "tp" in specs["moe_layers.wq_b"] and "tp" in specs["dense_layers.w_gate_up"]
        if name != "8.yaml":  # ep splits the experts
            assert "ep" in specs["moe_layers.w_gate_up"]


# ---- configs this model does not implement are refused, naming the field ----------------------------

@pytest.mark.parametrize("field,value", [("scoring_func", "softmax"), ("n_group", 3), ("topk_group", 5),
                                         ("q_lora_rank", None), ("first_k_dense_replace", 4),
                                         ("num_experts_per_tok", 7), ("hidden_act", "gelu")])
def test_bad_configs_name_the_field(field, value):
    from deepseek_models import TEXT_CONFIGS

    from infire_jax.errors import UnsupportedModelError
    from infire_jax.models.hf_config import config_from_hf

    raw = dict(TEXT_CONFIGS["deepseek-v3"], model_type="deepseek_v3")
    config_from_hf(raw)  # the unmodified config is accepted
    with pytest.raises(UnsupportedModelError, match=field):
        config_from_hf({**raw, field: value})


# ---- routing: the same experts and weights as HF's router ---------------------------------------------

@pytest.mark.parametrize("name", ["deepseek-v3", "kimi-k2.5"])
def test_grouped_routing_matches_hf_router(name):
    """Many tokens through HF's DeepseekV3TopkRouter and ours: the same expert sets, the same weights."""
    import jax.numpy as jnp
    import torch

    from deepseek_models import TEXT_CONFIGS
    from infire_jax.models.hf_config import config_from_hf
    from infire_jax.models.deepseek_moe import route_grouped, router_logits

    hf = hf_model(name)
    gate = hf.model.layers[1].mlp.gate
    cfg = config_from_hf(dict(TEXT_CONFIGS[name], model_type="deepseek_v3"))
    x = torch.randn(512, cfg.hidden_size, generator=torch.Generator().manual_seed(1)) * 2
    with torch.no_grad():
        _, want_w, want_idx = gate(x)
    lp = {"router": jnp.asarray(gate.weight.detach().numpy().T)}
    r = route_grouped(router_logits(lp, jnp.asarray(x.numpy())), jnp.asarray(gate.e_score_correction_bias.numpy()), cfg)
    order = np.argsort(want_idx.numpy(), axis=1)  # HF's top-k is unsorted
    got_order = np.argsort(np.asarray(r.experts), axis=1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(r.experts), got_order, 1),
                                  np.take_along_axis(want_idx.numpy(), order, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(r.weights), got_order, 1),
                               np.take_along_axis(want_w.numpy(), order, 1), rtol=1e-6, atol=1e-6)


# ---- checkpoints of the placed weights keep the float32 router bias of a bfloat16 model ------------------

@pytest.mark.parametrize("fmt", ["safetensors", "orbax"])
def test_bfloat16_checkpoint_restores_with_its_float32_bias(fmt, tmp_path, monkeypatch):
    import jax.numpy as jnp
    from flax import nnx

    from infire_jax.loaders.load import load_placed

    monkeypatch.setenv("INFIRE_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("INFIRE_JAX_NO_CHECKPOINT", raising=False)
    monkeypatch.setenv("INFIRE_JAX_CHECKPOINT_FORMAT", fmt)
    model = save("deepseek-v3", hf_model("deepseek-v3"), tmp_path / "model")
    built = load_placed(model, jnp.bfloat16, None)
    restored = load_placed(model, jnp.bfloat16, None)
    assert built.built_because is not None and restored.built_because is None
    flat = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(restored.state)}
    assert flat["moe_layers.router_bias"].dtype == jnp.float32 and flat["moe_layers.wq_b"].dtype == jnp.bfloat16
    want = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(built.state)}
    for name, value in flat.items():
        np.testing.assert_array_equal(np.asarray(value.astype(jnp.float32)), np.asarray(want[name].astype(jnp.float32)))
