"""gpt-oss (models/gpt_oss.py) against HF transformers' GptOssForCausalLM, through the real engine.

A tiny random checkpoint (4 layers, windowed and full alternating with an 8-token window that
prompts and outputs cross, 8 experts top-4, the clamp at 1.0 so it cuts, random biases and sinks) is
loaded by our HF loader and decoded greedily with chunked prefill on the hybrid KV cache: tokens
must equal HF's `generate` and logprobs agree within 1e-3 (float32). Then: attention sinks in the
jnp reference against float64 numpy (float32 and fp8 pools, windowed and global layers); MXFP4 dequantization against transformers' own; the loader
reading MXFP4 experts as the float checkpoint; the config against transformers' GptOssConfig and the
published sizes (dummy:gpt-oss-20b / -120b); what is refused.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from deepseek_models import VOCAB, _save_tokenizer, hf_greedy
from test_kernels import Shapes, assert_close
from test_local_attention import case_args, make_case, oracle, real_tokens

from infire_jax.errors import UnsupportedModelError
from infire_jax.models.config import ModelConfig, gpt_oss_param_count
from infire_jax.models.hf_config import config_from_hf
from pallas_kernels.attention import paged_attention

WINDOW = 8
SHARPEN = 4.0  # the LM head scaled up, so greedy decoding has no near-ties between float32 engines
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=4, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"] * 2, swiglu_limit=1.0, initializer_range=0.3,
            max_position_embeddings=2048, bos_token_id=256, eos_token_id=257, pad_token_id=0,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
NUM_TOKENS = 48  # the prompts and outputs run well past the window, so both the window and the sinks count
PROMPTS = [[5, 77, 200, 13, 42], list(range(60, 100)), [258, 3, 3, 190, 64, 99, 120, 7, 250, 11, 31, 17, 90, 200]]
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 32), max_model_len=128,
              page_size=4, num_kv_pages=80)


def hf_model(**overrides):
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**{**TINY, **overrides})).to(torch.float32).eval()
    with torch.no_grad():  # HF zeroes the biases at init; random ones (and larger sinks) make each count
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.copy_(torch.randn_like(p) * (1.0 if name.endswith("sinks") else 0.3))
        model.lm_head.weight.mul_(SHARPEN)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the HF model, its saved float checkpoint)."""
    hf = hf_model()
    path = tmp_path_factory.mktemp("gpt_oss")
    hf.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    return hf, str(path)


@pytest.mark.parametrize("attn_impl", ["reference", "pallas_interpret"])
def test_generate_matches_hf(checkpoint, attn_impl):
    """Through the CPU path (the C++ attention kernel with sinks) and the GPU's Pallas kernels (in
    interpret mode)."""
    from infire_jax import LLM, SamplingParams

    hf, path = checkpoint
    llm = LLM(model=path, attn_impl=attn_impl, **ENGINE)
    cfg = llm.engine.model_config
    assert cfg.architecture == "gpt_oss" and cfg.local_attention == ((0, WINDOW), (0, 0)) * 2
    assert llm.engine.runner.rc.kv_groups.bounded  # the windowed layers keep a bounded number of pages
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1))
    for prompt, out in zip(PROMPTS, outs):
        want, want_lp = hf_greedy(hf, prompt, NUM_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == want
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(got.logprobs, want)], want_lp, atol=1e-3, rtol=0)
    llm.engine.close()


@pytest.mark.parametrize("kind", [(0, 10), None], ids=["window10", "global"])
def test_sinks_match_numpy(kind):
    """Prefill chunks after cached prefixes, decodes and a one-token prompt; sinks from below the scores
    to far above them (a row then gives the keys almost nothing). A windowed layer's pool is NaN where
    it may not read; a global one's unread slots are zeros (the unmasked program weighs them by 0)."""
    from test_local_attention import ROWS

    shapes = Shapes(page_size=8, head_dim=32, num_q_heads=4, num_kv_heads=2)
    case = make_case(shapes, kind, seed=3)
    args = case_args(case, shapes, None if kind else lambda x: jnp.asarray(np.nan_to_num(x)))
    sinks = np.array([-3.0, 0.5, 2.0, 30.0], np.float32)
    out, _, _ = jax.jit(lambda *a: paged_attention(*a, scale=shapes.head_dim ** -0.5, impl="reference",
                                                   cpu_kernel=True, sinks=jnp.asarray(sinks)))(*args)
    real = real_tokens(case.meta)
    want = oracle(case, kind, ROWS, sinks)
    assert_close(np.asarray(out)[real], want[real], 2e-5)
    plain, _, _ = paged_attention(*args, scale=shapes.head_dim ** -0.5, impl="reference")
    assert np.abs(np.asarray(plain)[real] - want[real]).max() > 1e-2  # the sinks matter here


def test_sinks_with_an_fp8_pool():
    """An fp8 pool: the k scale folds into q, so the sinks join true scores (the oracle attends to the
    keys and values as their e4m3 codes times the scales)."""
    import ml_dtypes

    from pallas_kernels import reference
    from test_local_attention import LAYER, ROWS

    shapes, kind = Shapes(page_size=8, head_dim=32, num_q_heads=4, num_kv_heads=2), (0, 10)
    case = make_case(shapes, kind, seed=9)
    kv_scale = np.random.default_rng(0).uniform(0.004, 0.02, size=(2, 2)).astype(np.float32)

    def codes(x, scale):
        return np.clip(x / scale[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)

    exact = case._replace(k_history=[codes(h, kv_scale[0]).astype(np.float64) * kv_scale[0][:, None]
                                     for h in case.k_history],
                          v_history=[codes(h, kv_scale[1]).astype(np.float64) * kv_scale[1][:, None]
                                     for h in case.v_history])
    sinks = np.array([-3.0, 0.5, 2.0, 4.0], np.float32)
    out, _, _ = jax.jit(lambda *a: reference.ragged_paged_attention(
        *a, scale=shapes.head_dim ** -0.5, kv_scale=jnp.asarray(kv_scale), sinks=jnp.asarray(sinks)))(
        jnp.asarray(case.q), jnp.asarray(case.k), jnp.asarray(case.v),
        jnp.asarray(codes(case.k_pages, kv_scale[0]).view(np.uint8)),
        jnp.asarray(codes(case.v_pages, kv_scale[1]).view(np.uint8)), jnp.int32(LAYER), case_args(case, shapes)[-1])
    real = real_tokens(case.meta)
    np.testing.assert_allclose(np.asarray(out, np.float64)[real], oracle(exact, kind, ROWS, sinks)[real],
                               atol=2e-5, rtol=2e-5)


def _random_mxfp4(rng, shape) -> tuple[np.ndarray, np.ndarray]:
    """blocks [..., G, 16] of random bytes and scales [..., G] around 2^0 (127 +- 8)."""
    blocks = rng.integers(0, 256, (*shape, 16), dtype=np.uint8)
    return blocks, rng.integers(119, 136, shape, dtype=np.uint8)


def test_mxfp4_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from infire_jax.loaders.mxfp4 import dequantize_experts

    blocks, scales = _random_mxfp4(np.random.default_rng(0), (3, 10, 4))  # 3 experts, 10 rows, 128 inputs
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    got = dequantize_experts(blocks, scales)
    assert got.shape == (3, 128, 10)
    np.testing.assert_array_equal(got.astype(np.float32), want.numpy())


def test_loader_reads_mxfp4_experts_as_the_float_checkpoint(checkpoint):
    """The published layout (`*_blocks`, `*_scales`) gives the weights that transformers' dequantized
    tensors give in the float layout."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from infire_jax.loaders.gpt_oss_hf import gpt_oss_weights
    from infire_jax.loaders.hf import checkpoint_tensors, read_hf_config

    _, path = checkpoint
    cfg = read_hf_config(path)
    rng = np.random.default_rng(1)
    floats, packed = [], []
    for name, w in checkpoint_tensors(path):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [X, in, out]
            blocks, scales = _random_mxfp4(rng, (w.shape[0], w.shape[2], w.shape[1] // 32))
            floats.append((name, convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                            dtype=torch.float32).numpy()))
            packed += [(f"{name}_blocks", blocks), (f"{name}_scales", scales)]
        else:
            floats.append((name, w))
            packed.append((name, w))
    want, got = gpt_oss_weights(floats, cfg), gpt_oss_weights(packed, cfg)
    assert sorted(want) == sorted(got)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name], np.float32), want[name], err_msg=name)
    with pytest.raises(UnsupportedModelError, match="not both blocks and scales"):
        gpt_oss_weights([t for t in packed if not t[0].endswith("down_proj_scales")], cfg)


def save_as_mxfp4(path: str, out) -> str:
    """A copy of the float checkpoint at `path` in `out` with its experts as the published checkpoints
    store them: random MXFP4 blocks and scales of 2^-8 to 2^-4 (`*_blocks`, `*_scales`), and their
    quantization_config."""
    import json
    import shutil

    from safetensors.numpy import save_file

    from infire_jax.loaders.hf import checkpoint_tensors

    rng, tensors = np.random.default_rng(4), {}
    for name, w in checkpoint_tensors(path):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [X, in, out]
            blocks, _ = _random_mxfp4(rng, (w.shape[0], w.shape[2], w.shape[1] // 32))
            tensors[f"{name}_blocks"] = blocks
            tensors[f"{name}_scales"] = rng.integers(119, 124, blocks.shape[:-1], dtype=np.uint8)
        else:
            tensors[name] = np.ascontiguousarray(w)
    save_file(tensors, str(out / "model.safetensors"))
    for f in os.listdir(path):
        if f.startswith("tokenizer"):
            shutil.copy(os.path.join(path, f), out / f)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(checkpoint, tmp_path_factory):
    """The tiny checkpoint with its experts in MXFP4 (`save_as_mxfp4`)."""
    return save_as_mxfp4(checkpoint[1], tmp_path_factory.mktemp("gpt_oss_mxfp4"))


@pytest.mark.parametrize("grouped", ["tiled", "pallas"])
def test_kept_mxfp4_experts_equal_the_dequantized_ones_and_hf(mxfp4_checkpoint, grouped, monkeypatch):
    """weights_quantization="checkpoint" keeps the experts as MXFP4 (a byte per two weights and per
    block of 32) and serves what the experts dequantized at load serve: the same tokens and logprobs;
    and HF's model of the same directory (transformers dequantizes MXFP4 on a CPU), within 1e-3.
    `grouped`: the experts by the loop over row tiles (the CPU's) or by the GPU's grouped Pallas
    kernels reading the MXFP4 or plain stacks in place (in interpret mode here)."""
    from transformers import GptOssForCausalLM

    from infire_jax import LLM, SamplingParams

    monkeypatch.setenv("INFIRE_JAX_MOE_GROUPED", grouped)
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    results = []
    for quant in (None, "checkpoint"):
        llm = LLM(model=mxfp4_checkpoint, weights_quantization=quant, **ENGINE)
        results.append([o.outputs[0] for o in llm.generate(PROMPTS, params)])
        experts = llm.engine.runner.state["layers"]["w_gate_up"]
        if quant:
            assert experts["fp4"].get_value().dtype == jnp.uint8 and experts["scale"].get_value().dtype == jnp.uint8
            assert experts["fp4"].get_value().shape[-3:] == (TINY["hidden_size"] // 2, 2, TINY["intermediate_size"])
        llm.engine.close()
    for plain, kept in zip(*results):
        assert kept.token_ids == plain.token_ids
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(kept.logprobs, kept.token_ids)],
                                   [lp[t].logprob for lp, t in zip(plain.logprobs, plain.token_ids)], atol=1e-4, rtol=0)
    hf = GptOssForCausalLM.from_pretrained(mxfp4_checkpoint).to(torch.float32).eval()
    for prompt, kept in zip(PROMPTS, results[1]):
        want, want_lp = hf_greedy(hf, prompt, NUM_TOKENS)
        assert kept.token_ids == want
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(kept.logprobs, want)], want_lp, atol=1e-3, rtol=0)


def test_dummy_kept_mxfp4_experts_are_drawn_with_a_float_dummys_spread():
    """A `dummy:` gpt-oss with weights_quantization="checkpoint" (`bench latency` on a GPU) draws its
    experts as MXFP4 parts: random bytes and a scale of 2^-7, so they dequantize with about the 0.02
    spread of a float dummy's weights."""
    from transformers import GptOssConfig

    from infire_jax.loaders.gpt_oss_quant import is_gpt_oss
    from infire_jax.models.gpt_oss import KEPT_EXPERTS
    from infire_jax.models.registry import build_state
    from infire_jax.quant import mxfp4
    from infire_jax.quant.grouped import GroupedLayout, dequantize

    assert is_gpt_oss("dummy:gpt-oss-120b") and not is_gpt_oss("dummy:llama-3.1-8b")
    cfg = config_from_hf(GptOssConfig(**TINY).to_dict())
    layouts = {t: GroupedLayout("mxfp4", mxfp4.BLOCK, jnp.uint8) for t in KEPT_EXPERTS}
    _, state = build_state(cfg, None, jnp.float32, quantized=layouts)
    parts = {k: v.get_value() for k, v in state["layers"]["w_down"].items()}
    assert parts["fp4"].dtype == jnp.uint8 and bool(jnp.all(parts["scale"] == 120))
    assert len(np.unique(np.asarray(parts["fp4"]))) > 200
    w = dequantize(parts, "w_down", jnp.float32)
    assert w.shape == (TINY["num_hidden_layers"], TINY["num_local_experts"], TINY["intermediate_size"],
                       TINY["hidden_size"])
    assert float(jnp.std(w)) == pytest.approx(0.023, rel=0.1)


# ---- 8 virtual devices: tp, ep and pp meshes equal one device -------------------------------------------

def test_eagle3_drafts_for_gpt_oss_on_its_hybrid_kv_cache(checkpoint, tmp_path):
    """An EAGLE-3 head (as SpecForge's and NVIDIA's for gpt-oss-120b: a Llama layer over three layers' outputs,
    here aux ids 0, 1, 3: a windowed layer's, a full layer's and the last one's; its RoPE YaRN-scaled as NVIDIA's
    heads carry it, from 64 positions, which the sequences pass) over the model on the hybrid KV cache (the head's KV on the full layers' pages): greedy tokens equal HF's,
    drafts over the two tokens most frequent in HF's continuations are accepted and rejected, each proposal's
    first draft is the float64 reference head's on HF's states; every page comes back and nothing compiles after
    warmup."""
    from test_eagle3 import assert_first_drafts_are_the_references, head_over_frequent_tokens, hf_states, \
        record_proposals

    from infire_jax import LLM, SamplingParams

    hf, path = checkpoint
    want = [hf_greedy(hf, p, NUM_TOKENS)[0] for p in PROMPTS]
    spec, tensors, config = head_over_frequent_tokens(
        want, tmp_path, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=96, vocab_size=VOCAB, rope_theta=150000.0, max_position_embeddings=2048,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 64,
                      "beta_fast": 32.0, "beta_slow": 1.0},
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 3]})
    llm = LLM(model=path, **ENGINE, speculative_config=spec)
    e = llm.engine
    try:
        assert e.runner.rc.aux_layers == (1, 2, 4) and e.runner.rc.kv_groups.bounded
        records = record_proposals(e)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == want
        assert 0 < e.spec.stats.num_accepted_tokens < e.spec.stats.num_draft_tokens
        embed = hf.model.embed_tokens.weight.detach().numpy()
        assert_first_drafts_are_the_references(records, [p + w for p, w in zip(PROMPTS, want)], tensors, config,
                                               embed, lambda seq: hf_states(hf, seq, (1, 2, 4)))
        assert e.compiles_since_warmup == 0 and e.kv.num_free_pages == e.kv.num_usable_pages
    finally:
        e.close()


def test_meshes_match_one_device(tmp_path):
    """The tiny model with an expert width of 64 (two MXFP4 blocks) in MXFP4, its experts dequantized at load
    (float) and kept, in one process with 8 virtual devices. tp 2: the heads with their sinks and q/k/v
    biases, the o bias added once after the reduction, the experts' widths with their gate/up biases (kept:
    w_down's blocks one a device), the down bias once. ep 8, and tp 8 over the experts (8-tp8-ep, the 2 kv
    heads repeated): a whole expert a device with its biases (kept: blocks and scales together); on ep 8 also
    by the GPU's grouped kernels (interpret mode) reading each device's kept experts in place. Pipelines of 2
    stages, each a windowed and a full layer. Each gives one device's greedy tokens, and its logprobs within
    float32 rounding (the reductions' order; 7e-5 seen, 1.2e-4 with the suite's LLVM -O0); tp 8 over the
    experts' widths would split w_down's 2 blocks of 32 and is refused naming it."""
    from test_sharding import ROOT, _assert_each_device_holds_its_shard, _results, _run_worker

    path = tmp_path / "float"
    hf_model(intermediate_size=64).save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    (tmp_path / "mxfp4").mkdir()
    model = save_as_mxfp4(str(path), tmp_path / "mxfp4")
    meshes = {"float": ["1", "2", "8-ep8", "2-pp2"], "kept": ["1", "2", "8-ep8", "8-tp8-ep", "2-pp2", "8"],
              "kernels": ["8-ep8"]}
    runs = [{"model": model, "mesh": os.path.join(ROOT, "sharding", "configs", f"{m}.yaml"), "tag": kind,
             "weights_quantization": None if kind == "float" else "checkpoint",
             "env": {"INFIRE_JAX_MOE_GROUPED": "pallas"} if kind == "kernels" else {}}
            for kind in meshes for m in meshes[kind]]
    # one bucket, one decode step a launch: the layout on the mesh is what is checked (bursts: test_sharding's)
    engine = {**{k: v for k, v in ENGINE.items() if k != "dtype"}, "token_buckets": [32], "num_decode_steps": 1}
    job = {"runs": runs, "prompts": PROMPTS, "max_tokens": 16, "engine": engine}
    results = {(r["tag"], os.path.basename(r["mesh"])[:-5]): r for r in _results(_run_worker(job, 8, tmp_path, "oss"))}
    refused = results.pop(("kept", "8"))
    assert not refused["fits"] and "layers.w_down: its 2 mxfp4 groups of 32 inputs cannot be split 8 ways over tp" \
        in refused["error"], refused
    for (kind, mesh), r in results.items():
        single = results["float" if kind == "float" else "kept", "1"]
        assert r["fits"] and r["tokens"] == single["tokens"], (kind, mesh, r.get("error"))
        np.testing.assert_allclose(r["logprobs"], single["logprobs"], atol=2e-4, rtol=0)
        if mesh == "1":
            continue
        _assert_each_device_holds_its_shard(r)
        specs = {k: v["spec"] for k, v in r["params"].items()}
        assert specs["layers.bo"][1] is None  # whole on every device, added once after wo's reduction
        experts = ["layers.w_down"] if kind == "float" else [f"layers.w_down.{p}" for p in ("fp4", "scale")]
        if mesh == "2":
            assert specs["layers.sinks"] == [None, "tp"] and specs["layers.bqkv"][1] == "tp"
            assert specs["layers.b_gate_up"] == [None, None, None, "tp"] and specs["layers.b_down"] == [None] * 3
            assert all(specs[e] == [None, None, "tp", None] for e in experts), specs  # w_down's inputs: F
        if mesh == "8-ep8":
            assert specs["layers.b_down"][1] == specs["layers.b_gate_up"][1] == "ep"
            assert all(specs[e] == [None, "ep", None, None] for e in experts), specs
        if mesh == "8-tp8-ep":
            assert specs["layers.sinks"] == [None, "tp"] and specs["layers.b_down"] == [None, "tp", None]
            assert all(specs[e] == [None, "tp", None, None] for e in experts), specs
        if mesh == "2-pp2":
            assert specs["layers.sinks"] == ["pp", None] and r["kv_groups"] is not None
        if kind == "kernels":
            assert r["kernels"].count("quant_matmul") == 2, r["kernels"]  # gate/up and down, in place
        if kind == "kept":
            _assert_the_plan_counts_each_devices_bytes(r, model)


def _assert_the_plan_counts_each_devices_bytes(r: dict, model: str) -> None:
    """Each device's bytes of each weight (a kept one's fp4 and scale parts together: 4.25 bits) are
    `infire-jax plan`'s for the model on that mesh, which allocates nothing."""
    from infire_jax.memplan.plan import tensor_bytes
    from infire_jax.memplan.source import plan_source
    from sharding.mesh import MeshConfig

    mc = MeshConfig.from_yaml(r["mesh"])
    planned = plan_source(model, "float32")(mc)
    placed: dict[str, list[int]] = {}
    for name, p in r["params"].items():
        weight = name.removeprefix("layers.").removesuffix(".fp4").removesuffix(".scale")
        placed[weight] = [a + b for a, b in zip(placed.get(weight, [0] * mc.num_devices), p["per_device"])]
    assert placed == {t.name: [tensor_bytes(t, planned, mc, "float32")] * mc.num_devices for t in planned.tensors}


def test_config_matches_transformers_defaults():
    """transformers' GptOssConfig defaults are the published 120b; our parser reads them as dummy:gpt-oss-120b."""
    from transformers import GptOssConfig

    from infire_jax.loaders.dummy import CONFIGS

    ours = config_from_hf(CONFIGS["gpt-oss-120b"])
    theirs = config_from_hf(GptOssConfig().to_dict())
    skip = {"eos_token_ids"}  # the published config names its eos; transformers' default has none
    assert {k: v for k, v in ours.to_dict().items() if k not in skip} == \
           {k: v for k, v in theirs.to_dict().items() if k not in skip}
    assert ModelConfig.from_dict(ours.to_dict()) == ours  # as native checkpoints keep it


@pytest.mark.parametrize("name,layers,experts,total,active", [
    ("gpt-oss-20b", 24, 32, 20.91e9, 3.61e9), ("gpt-oss-120b", 36, 128, 116.83e9, 5.13e9)])
def test_published_configs(name, layers, experts, total, active):
    """Shapes of the model the engine builds (abstractly) and the published parameter counts
    (OpenAI's model card: 20.9B total / 3.6B active, 116.8B / 5.1B)."""
    from flax import nnx

    from infire_jax.loaders.dummy import CONFIGS, with_layers
    from infire_jax.memplan.model import from_model_config
    from infire_jax.models.registry import abstract_model

    cfg = config_from_hf(CONFIGS[name])
    assert (cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size) == (layers, experts, 4, 2880)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (64, 8, 64, 201088)
    assert cfg.local_attention == ((0, 128), (0, 0)) * (layers // 2)
    model = abstract_model(cfg, jnp.bfloat16)
    assert model.layers.w_gate_up.shape == (layers, experts, 2880, 2, 2880)
    assert model.layers.sinks.shape == (layers, 64)
    built = sum(np.prod(v.shape) for _, v in nnx.to_flat_state(nnx.state(model)))
    assert built == cfg.param_count()
    assert sum(math.prod(t.shape) for t in from_model_config(cfg, "bfloat16").tensors) == built  # the memory plan's
    assert abs(cfg.param_count() / total - 1) < 2e-3
    assert abs(gpt_oss_param_count(cfg, active=True) / active - 1) < 2e-3
    few = config_from_hf(with_layers(CONFIGS[name], f"{name},layers=3"))  # `dummy:gpt-oss-20b,layers=3`
    assert few.local_attention == ((0, 128), (0, 0), (0, 128))


@pytest.mark.parametrize("field,value,match", [
    ("hidden_act", "gelu", "hidden_act"), ("layer_types", ["sliding_attention"], "layer_types"),
    ("rope_parameters", {"rope_type": "llama3", "factor": 8.0}, "rope_type"),
    ("quantization_config", {"quant_method": "fp8"}, "mxfp4"), ("some_new_field", 1, "not a field")])
def test_config_refuses_what_it_cannot_honour(field, value, match):
    with pytest.raises(UnsupportedModelError, match=match):
        config_from_hf({**TINY, "model_type": "gpt_oss", field: value})
