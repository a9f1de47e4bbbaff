"""Llama 4 (models/llama4.py) against HF transformers, through the real engine.

Tiny random checkpoints of both published layouts (tests/llama4_models.py) are loaded by our HF
loader and decoded greedily: tokens must equal HF's `generate` over 48 tokens and logprobs agree
within 1e-3 (float32). Prompt and output cross several 16-token chunks, a NoPE layer's temperature
changes every 8 positions, and dense and MoE layers interleave. Then the same family kept int8 with
n-gram speculation, with a draft model and with an EAGLE-3 head (its aux hidden states against HF's),
with an fp8 KV cache, demoted to host memory and promoted back (hot standby), and
on 2 and 8 virtual devices; its configs' errors; the published configs' shapes.
"""

from __future__ import annotations

import numpy as np
import pytest

from deepseek_models import hf_greedy
from llama4_models import TEXT_CONFIGS, fp8_kv, hf_model, quantize_like_int4, quantize_like_int8, save, text_model

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


def _assert_matches(outs, hf, atol: float = 1e-3) -> None:
    for prompt, out in zip(PROMPTS, outs):
        want, want_lp = hf_greedy(text_model(hf), prompt, NUM_TOKENS)
        assert out.token_ids == want
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(out.logprobs, want)], want_lp, atol=atol, rtol=0)


# The causal model runs the CPU attention kernel and moe.py's loop over row tiles; the multimodal one
# the GPU's kernels in interpret mode: Pallas attention and the grouped matmul reading the experts in place.
@pytest.mark.parametrize("name,impl", [("causal", "reference"), ("multimodal", "pallas_interpret")])
def test_generate_matches_hf(name, impl, checkpoints, caplog, monkeypatch):
    from infire_jax import LLM, SamplingParams

    hf, path = checkpoints[name]
    if impl == "pallas_interpret":
        monkeypatch.setenv("INFIRE_JAX_MOE_GROUPED", "pallas")
    with caplog.at_level("INFO", logger="infire_jax.loaders.llama4_hf"):
        llm = LLM(model=path, attn_impl=impl, **ENGINE)
    vision = [r for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(vision) == (name == "multimodal")  # said once, for the layout that has one
    cfg = llm.engine.model_config
    l4 = cfg.llama4
    assert cfg.architecture == "llama4" and llm.engine.runner.rc.attn_impl == impl
    assert llm.engine.runner.rc.kv_groups.bounded  # on the hybrid KV cache
    assert l4.temperature_tuning and l4.floor_scale == 8 and not all(l4.rope_layers)
    assert {c for c, _ in cfg.local_attention} == {0, 16}  # chunked RoPE layers, global NoPE layers
    assert l4.stack_sizes == {"dense": cfg.num_layers - cfg.num_layers // 2, "moe": cfg.num_layers // 2}
    _assert_matches(llm.generate(PROMPTS, SamplingParams(**GREEDY)), hf)
    llm.engine.close()


def test_hybrid_kv_cache_matches_every_page_kept(checkpoints):
    """The causal model on the hybrid KV cache (its four chunked RoPE layers keep only their current
    chunk's pages, its NoPE layer every page) decodes the same greedy tokens and logprobs as with
    every page kept in one group (`hybrid_kv_cache=False`); the prompts and 48 tokens cross several
    16-token chunks. A 40-token prompt decoded alone holds at most its chunk's pages in each chunked group."""
    from infire_jax import LLM, SamplingParams
    from infire_jax.core.hybrid_kv_cache import HybridKVCacheManager
    from infire_jax.core.kv_cache import NULL_PAGE

    path = checkpoints["causal"][1]
    engine_args = dict(ENGINE, page_size=4, num_kv_pages=160)
    hybrid, kept = LLM(model=path, **engine_args), LLM(model=path, hybrid_kv_cache=False, **engine_args)
    groups = hybrid.engine.runner.rc.kv_groups
    assert isinstance(hybrid.engine.kv, HybridKVCacheManager) and kept.engine.runner.rc.kv_groups is None
    assert sorted(g.kind for g in groups.groups) == ["chunk 16"] * (groups.num_groups - 1) + ["global"]
    assert [layer for g in groups.groups if g.kind == "global" for layer in g.layers] == [2]  # the NoPE layer
    params = SamplingParams(**GREEDY)
    for a, b in zip(hybrid.generate(PROMPTS, params), kept.generate(PROMPTS, params)):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids)],
                                   [lp[t].logprob for lp, t in zip(b.logprobs, b.token_ids)], atol=1e-5, rtol=0)
    engine = hybrid.engine
    rid, _ = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True))
    req = engine._requests[rid][0]
    most = [0] * groups.num_groups
    while engine.has_unfinished():
        engine.step()
        if req.group_pages and req.num_computed_tokens > 40:  # decoding, in bursts
            most = [max(m, sum(p != NULL_PAGE for p in pages)) for m, pages in zip(most, req.group_pages)]
    bound = groups.groups[-1].max_blocks(10_000, 4, engine.runner.rc.decode_steps)
    assert most[0] >= (40 + NUM_TOKENS - 1) // 4 and 0 < max(most[1:]) <= bound < 40 // 4
    assert engine.kv.num_free_pages == engine.kv.num_usable_pages
    hybrid.engine.close()
    kept.engine.close()


def test_int8_weights_with_ngram_speculation_match_hf_on_the_same_int8_weights(checkpoints):
    """`weights_quantization="int8"` keeps every stack's layer weights int8 (the experts and shared
    expert too); HF given the same per-channel int8 weights is the reference. Speculating with
    n-grams (which these repetitive greedy texts accept) changes no greedy token; a constrained
    request keeps to its grammar."""
    import re

    from flax import nnx

    from infire_jax import LLM, SamplingParams, StructuredOutputs

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
    pattern = "(chunk|nope)-[0-9]{2}"  # structured output, speculating within the grammar
    out = llm.generate(["Which layer kind, and how many?"], SamplingParams(
        max_tokens=16, temperature=0, structured_outputs=StructuredOutputs(regex=pattern)))[0].outputs[0]
    assert re.fullmatch(pattern, out.text) and out.finish_reason == "stop"
    assert llm.engine.compiles_since_warmup == 0
    llm.engine.close()


def _tiny_llama_draft(path) -> str:
    """A 2-layer random Llama with the Llama 4 checkpoints' vocabulary and tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from deepseek_models import VOCAB, _save_tokenizer

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    return str(path)


@pytest.mark.parametrize("draft", ["itself", "llama"])
def test_draft_model_beside_the_hybrid_kv_cache_is_token_identical(draft, checkpoints, tmp_path):
    """A draft model on the hybrid KV cache's global group's pages (the chunked groups' tables dropped
    from what it sees): the causal model drafting for itself (its chunked layers masked on the global
    table; nearly every proposal accepted, so the draft's KV is where it reads it) and a random tiny
    Llama with its vocabulary (nearly none). Greedy tokens equal HF's (those of decoding without a
    draft: test_generate_matches_hf), past several chunks; every page comes back, nothing recompiles."""
    from infire_jax import LLM, SamplingParams
    from infire_jax.core.hybrid_kv_cache import HybridKVCacheManager

    hf, path = checkpoints["causal"]
    spec = {"method": "draft_model", "model": path if draft == "itself" else _tiny_llama_draft(tmp_path / "draft"),
            "num_speculative_tokens": 3}
    llm = LLM(model=path, **ENGINE, speculative_config=spec)
    e = llm.engine
    assert isinstance(e.kv, HybridKVCacheManager) and e.runner.rc.kv_groups.num_groups > 1
    _assert_matches(llm.generate(PROMPTS, SamplingParams(**GREEDY)), hf)
    s = e.spec.stats
    assert s.num_drafts > 0
    if draft == "itself":
        assert s.num_accepted_tokens >= 0.9 * s.num_draft_tokens
    else:
        assert s.num_accepted_tokens <= 0.3 * s.num_draft_tokens
    assert e.kv.num_free_pages == e.kv.num_usable_pages and e.compiles_since_warmup == 0
    e.close()


def test_aux_hidden_states_equal_hf_hidden_states(checkpoints):
    """EAGLE-3's features from the super-layer scan: HF `hidden_states` indices 0 (the embedding), 2 (a
    MoE layer's output), 3 (the NoPE layer's) and 5 (the dense layer left over: the last layer's output,
    before the final norm), for the three prompts in one step across 16-token chunks, within 1e-4
    (float32); the logits and the pool are the plain forward's. Bad indices and a mesh are refused."""
    import jax.numpy as jnp
    from flax import nnx
    from test_eagle3 import assert_aux_states, hf_states

    from infire_jax.loaders.load import load_model
    from infire_jax.models.registry import build_state

    hf, path = checkpoints["causal"]
    loaded = load_model(path)
    cfg = loaded.config
    model = nnx.merge(*build_state(cfg, loaded.weights, jnp.float32))
    layers = (0, 2, 3, 5)
    assert_aux_states(model, cfg, PROMPTS, layers, lambda ids: hf_states(hf, ids, layers), num_tokens=64,
                      num_rows=4, width=5, bad_layers=(3, 2))


def _eagle3_head(hf, path) -> tuple[dict, list[list[int]], dict, dict]:
    """An EAGLE-3 head for the causal model written at `path`, aux ids 1, 2, 4 (a MoE layer's, the NoPE layer's
    and the last layer's outputs), drafting over the two tokens most frequent in HF's greedy continuations of
    PROMPTS: (its speculative_config, those continuations, its tensors, its config)."""
    from test_eagle3 import head_over_frequent_tokens

    from deepseek_models import VOCAB

    want = [hf_greedy(hf, p, NUM_TOKENS)[0] for p in PROMPTS]
    spec, tensors, config = head_over_frequent_tokens(
        want, path, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        vocab_size=VOCAB, rope_theta=10000.0, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 4]})
    return spec, want, tensors, config


def test_eagle3_on_the_hybrid_kv_cache_is_token_identical(checkpoints, tmp_path):
    """An EAGLE-3 head over the causal model on the hybrid KV cache (its KV on the global group's pages):
    aux ids 1, 2, 4 (a MoE layer's, the NoPE layer's and the last layer's outputs). Greedy tokens equal
    HF's past several chunks; drafts (over the two tokens most frequent in HF's continuations) are accepted and
    rejected; each proposal's first draft is the float64 reference head's (tests/eagle3_reference.py) on
    HF's states; every page comes back, nothing compiles after warmup."""
    from test_eagle3 import assert_first_drafts_are_the_references, hf_states, record_proposals

    from infire_jax import LLM, SamplingParams
    from infire_jax.core.hybrid_kv_cache import HybridKVCacheManager

    hf, path = checkpoints["causal"]
    spec, want, tensors, config = _eagle3_head(hf, tmp_path)
    llm = LLM(model=path, **ENGINE, speculative_config=spec)
    e = llm.engine
    assert isinstance(e.kv, HybridKVCacheManager) and e.runner.rc.kv_groups.num_groups > 1
    assert e.runner.rc.aux_layers == (2, 3, 5)
    records = record_proposals(e)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want
    s = e.spec.stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens
    embed = hf.model.embed_tokens.weight.detach().numpy()
    assert_first_drafts_are_the_references(records, [p + w for p, w in zip(PROMPTS, want)], tensors, config, embed,
                                           lambda seq: hf_states(hf, seq, (2, 3, 5)))
    assert e.compiles_since_warmup == 0 and e.kv.num_free_pages == e.kv.num_usable_pages
    e.close()


def test_fp8_kv_cache_matches_hf_on_the_same_fp8_keys_and_values(checkpoints, monkeypatch):
    """An fp8 (e4m3) pool, its per-(layer, kv head) scales calibrated at build; HF attending to its
    keys and values rounded to e4m3 with those scales is the reference. The tokens must be HF's, the
    logprobs within 0.05: a key one ulp from an e4m3 rounding midpoint rounds either way, one step of
    3 mantissa bits, and torch's keys and XLA's differ by ulps. Measured: one calibrated scale one
    ulp apart (the CPU attention kernel's sum order against XLA's) moved HF's own logprobs by 0.026.
    Unrounded keys change every token (logprobs off by 1.3 to 2.2), and so does a scale taken from
    another layer, another kv head, or the values' for the keys (each measured against this reference)."""
    from infire_jax import LLM, SamplingParams

    _, path = checkpoints["causal"]
    llm = LLM(model=path, kv_cache_dtype="fp8", **ENGINE)
    assert llm.engine.runner.cache.k_pages.dtype == np.uint8
    want = hf_model("causal")
    fp8_kv(want, llm.engine.runner.kv_scales, monkeypatch)
    _assert_matches(llm.generate(PROMPTS, SamplingParams(**GREEDY)), want, atol=0.05)
    llm.engine.close()


def test_hot_standby_demotes_and_promotes_the_hybrid_cache(checkpoints):
    """Hot standby (residency.py) with two models on the hybrid KV cache (the causal checkpoint under
    two names), one on the device at a time: each swap demotes one (its pool and prefix cache
    dropped) and promotes the other, and the model that comes back answers exactly as before:
    greedy tokens and logprobs across several chunks, from an empty prefix cache, nothing
    compiled, no page held in any group."""
    from infire_jax import LLM, EngineConfig, SamplingParams
    from infire_jax.core.hybrid_kv_cache import HybridKVCacheManager
    from infire_jax.engine.residency import start_engines

    path = checkpoints["causal"][1]
    config = EngineConfig(model=path, **dict(ENGINE, page_size=4, num_kv_pages=160))
    engines, residency = start_engines([("a", config), ("b", config)], max_resident=1)
    params = SamplingParams(**dict(GREEDY, max_tokens=24))

    def answer(name: str) -> list[tuple[list[int], list[float], int]]:
        assert residency.acquire(name, timeout=60)
        try:
            outs = LLM(engine=engines[name]).generate(PROMPTS, params)
        finally:
            residency.release(name)
        return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
                 o.num_cached_tokens) for o in outs]

    before = answer("a")
    assert all(cached == 0 for _, _, cached in before)
    answer("b")  # "a" goes to host memory
    assert not engines["a"].resident and engines["b"].resident
    assert answer("a") == before  # back on the device: equal tokens and logprobs, no stale prefix hit
    assert residency.stats["a"].promotions == residency.stats["b"].promotions == 1
    for engine in engines.values():
        assert isinstance(engine.kv, HybridKVCacheManager) and engine.compiles_since_warmup == 0
        assert engine.kv.num_free_pages == engine.kv.num_usable_pages and not any(engine.kv.pages_in_use())
        engine.close()


def test_fleet_over_http_moves_every_groups_pages(checkpoints):
    """The causal checkpoint as a prefill and a decode worker behind a router, in this process
    (`disaggregate_over_http`): a prompt's full pages before its last token cross Mooncake in every group
    (pages of 4, chunks of 16: the 40-token prompt's 36 tokens, over two chunk boundaries), the decode
    worker takes them as its prefix hit, and its greedy answer is HF's (tokens, logprobs within 1e-3)."""
    from infire_jax import Engine, EngineConfig
    from server_utils import disaggregate_over_http

    hf, path = checkpoints["causal"]
    config = EngineConfig(model=path, **dict(ENGINE, page_size=4, num_kv_pages=160))
    want = [hf_greedy(text_model(hf), p, 12) for p in PROMPTS]
    prefill, decode = Engine(config), Engine(config)
    disaggregate_over_http(prefill, decode, PROMPTS, want, max_tokens=12, atol=1e-3)
    prefill.close()
    decode.close()


# ---- 2 and 8 virtual devices: tensor, expert and pipeline parallel equal one device ----------------------------

def test_tp_ep_and_pp_meshes_match_one_device(checkpoints, tmp_path):
    """The multimodal model (top-2 routing) in a process with 8 virtual devices: on 2 (tp 2) and on 8
    (tp 8, its 2 kv heads repeated, the experts split over the same axis; tp 2 x ep 4), and on
    pipelines of 2 stages (alone, and with tp 4 in each) it gives one device's tokens. A stage holds
    whole super-layers: its three go 1 and 2, the first stage's padded with a zero (identity)
    super-layer, and each stage reads its own layers' RoPE / NoPE and chunked / global rows. The
    causal model's dense layer after its last MoE layer, and 8 stages for 3 super-layers, are refused. The causal
    model with an EAGLE-3 head on tp 2 x ep 4 (the super-layer scans' states out of the shard_map whole, the head
    replicated) gives HF's tokens and one device's proposals, accepted and rejected."""
    import json
    import os

    from test_sharding import ROOT, _results, _run_worker

    def mesh(name):
        return os.path.join(ROOT, "sharding", "configs", name)

    meshes = ["1.yaml", "2.yaml", "8-tp8-ep.yaml", "8-tp2-ep4.yaml", "2-pp2.yaml", "8-tp4-pp2.yaml", "8-pp8.yaml"]
    # One bucket, one decode step a launch: what is checked here is the model's layout on the mesh; decode
    # bursts and the small bucket on meshes are test_sharding's (each is another program every engine compiles).
    # The steps are the same: the scheduler chunks by the 32-token budget, not by the buckets. Text alone: images
    # on meshes are test_vision_mesh's (each engine would compile the tower's tile buckets).
    engine = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, token_buckets=[32], num_kv_pages=40,
                  num_decode_steps=1, limit_mm_per_prompt={"image": 0})
    runs = [{"model": checkpoints["multimodal"][1], "mesh": mesh(m)} for m in meshes]
    runs.append({"model": checkpoints["causal"][1], "mesh": mesh("2-pp2.yaml"), "tag": "tail"})
    job = {"runs": runs, "prompts": ["Hello, Llama 4", "x" * 40, "the chunks of a long prompt cross"], "max_tokens": 24,
           "engine": engine}
    spec, eagle3_tokens, _, _ = _eagle3_head(checkpoints["causal"][0], tmp_path)
    eagle3_job = {"runs": [{"model": checkpoints["causal"][1], "mesh": mesh(m), "tag": f"eagle3-{m}",
                            "speculative_config": spec} for m in ("1.yaml", "8-tp2-ep4.yaml")],
                  "prompts": PROMPTS, "max_tokens": NUM_TOKENS, "engine": dict(engine, max_model_len=256)}
    results = {r["tag"] or os.path.basename(r["mesh"]): r for r in _results(_run_worker(job, 8, tmp_path, "llama4"))}
    eagle3 = {r["tag"]: r for r in _results(_run_worker(eagle3_job, 8, tmp_path, "llama4-eagle3"))}
    one, sharded = eagle3["eagle3-1.yaml"], eagle3["eagle3-8-tp2-ep4.yaml"]
    assert sharded["fits"] and one["fits"], sharded.get("error")
    assert sharded["tokens"] == one["tokens"] == eagle3_tokens
    assert sharded["spec"]["proposals"] == one["spec"]["proposals"]
    assert 0 < sharded["spec"]["accepted"] < sharded["spec"]["drafted"] and sharded["spec"]["compiles"] == 0
    assert "3 Llama 4 super-layers (2 layers each: dense then MoE) cannot fill 8 pipeline stages" in \
        results.pop("8-pp8.yaml")["error"]
    assert "the 1 dense layer(s) after the last MoE layer of 5 cannot be placed" in results.pop("tail")["error"]
    single = results.pop("1.yaml")
    assert set(results) == {"2.yaml", "8-tp8-ep.yaml", "8-tp2-ep4.yaml", "2-pp2.yaml", "8-tp4-pp2.yaml"}
    for mesh, r in results.items():
        assert r["fits"] and r["tokens"] == single["tokens"], (mesh, json.dumps(r)[:500])
        np.testing.assert_allclose(r["logprobs"], single["logprobs"], atol=1e-4)
        specs = {k: v["spec"] for k, v in r["params"].items()}
        if "tp" in mesh or mesh == "2.yaml":  # tp splits the heads and the dense and shared MLPs' widths
            assert "tp" in specs["moe_layers.wqkv"] and "tp" in specs["dense_layers.w_gate_up"]
            assert "tp" in specs["moe_layers.w_shared_gate_up"]
        # ep (or tp) the routed experts; pp every stack's layers, 2 super-layer slots a stage
        assert specs["moe_layers.w_gate_up"][1] == {"8-tp8-ep.yaml": "tp", "8-tp2-ep4.yaml": "ep"}.get(mesh)
        if "pp2" in mesh:
            assert specs["dense_layers.wqkv"][0] == specs["moe_layers.w_gate_up"][0] == "pp"
            assert r["params"]["moe_layers.router"]["global"] == 4 * 64 * 8 * 4  # 4 slots of [64, 8] float32
            assert r["kv_groups"] is not None  # the hybrid cache, laid out per stage


def test_pipeline_stages_hold_whole_super_layers():
    """A plan's stages of the Llama 4 family: 3 super-layers of 2 over 2 stages go 1 and 2, each
    stack spread over its own slots (the padding zero), the RoPE flags and chunked kinds spread as
    the layers are, so each stage's scan reads its own rows; what cannot be split is refused."""
    import re

    import jax

    from infire_jax.models.hf_config import config_from_hf
    from sharding.mesh import MeshConfig, MeshConfigError
    from sharding.plan import ShardPlan

    cfg = config_from_hf(_raw(num_hidden_layers=6, no_rope_layers=[1, 0, 1, 1, 0, 1]))
    pp2 = MeshConfig.parse({"mesh": {"pp": 2}, "rules": {"layers": "pp"}}, "pp2")
    plan = ShardPlan.create(cfg, pp2, [jax.devices()[0]] * 2)
    assert plan.stage_layers == (2, 4) and plan.padded_layers == 4
    assert plan.stacks == (("dense_layers", (1, 2)), ("moe_layers", (1, 2)))
    placed = plan.effective_config(cfg)
    assert placed.num_layers == 8 and placed.llama4.stack_sizes == {"dense": 4, "moe": 4}
    assert placed.llama4.rope_layers == (True, False, False, False) + (True, True, False, True)  # padding: as the last
    assert [c for c, _ in placed.local_attention] == [16, 0, 0, 0, 16, 16, 0, 16]
    dense, moe = np.arange(1.0, 4.0)[:, None], np.arange(1.0, 4.0)[:, None] * 10  # 3 layers of each, in order
    out = plan.prepare_weights({"dense_layers.attn_norm": dense, "moe_layers.attn_norm": moe, "embed": dense})
    np.testing.assert_array_equal(out["dense_layers.attn_norm"][:, 0], [1, 0, 2, 3])
    np.testing.assert_array_equal(out["moe_layers.attn_norm"][:, 0], [10, 0, 20, 30])
    np.testing.assert_array_equal(plan.layer_slot_mask("moe_layers"), [1, 0, 1, 1])
    assert plan.layer_slot_mask("embed") is None
    for layers, mesh, says in ((5, pp2, "the 1 dense layer(s) after the last MoE layer of 5 cannot be placed"),
                               (2, pp2, "1 Llama 4 super-layers (2 layers each: dense then MoE) cannot fill 2")):
        with pytest.raises(MeshConfigError, match=re.escape(says)):
            ShardPlan.create(config_from_hf(_raw(num_hidden_layers=layers)), mesh, [jax.devices()[0]] * 2)


# ---- configs: every field read, or refused naming it ------------------------------------------------------------

def _hf_text(name: str) -> dict:
    """A dummy's published text config as transformers 5 takes it (a boolean temperature tuning, rope aside)."""
    from infire_jax.loaders.dummy import CONFIGS

    text = {k: v for k, v in CONFIGS[name]["text_config"].items() if k not in ("model_type", "rope_scaling")}
    return {**text, "attn_temperature_tuning": bool(text["attn_temperature_tuning"])}


def _raw(**changes) -> dict:
    raw = dict(TEXT_CONFIGS["causal"], model_type="llama4_text", num_hidden_layers=4)
    raw.pop("rope_parameters")
    return {**raw, **changes}


def test_config_fields_follow_transformers():
    """Derived fields as Llama4TextConfig derives them: NoPE every `no_rope_layer_interval`-th layer,
    chunked RoPE layers, MoE layers every `interleave_moe_layer_step`-th; `layer_types` and
    `moe_layers` honoured; no chunk size means every layer global; Scout's `attn_temperature_tuning: 4`
    is on; Scout's llama3 rope with equal band factors gives transformers' frequencies."""
    import torch
    from transformers import Llama4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from infire_jax.loaders.dummy import CONFIGS
    from infire_jax.models.hf_config import config_from_hf
    from infire_jax.models.layers import rope_inv_freq

    raw = _raw(no_rope_layers=None, no_rope_layer_interval=2, moe_layers=None)
    cfg = config_from_hf(raw)
    hf = Llama4TextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    assert cfg.llama4.rope_layers == tuple(bool(r) for r in hf.no_rope_layers) == (True, False, True, False)
    assert cfg.local_attention == tuple((16, 0) if t == "chunked_attention" else (0, 0) for t in hf.layer_types)
    assert [i for i in range(4) if cfg.llama4.is_moe_layer(i)] == hf.moe_layers == [1, 3]
    assert config_from_hf({**raw, "layer_types": ["full_attention"] * 4}).local_attention == ((0, 0),) * 4
    assert not config_from_hf({**raw, "attention_chunk_size": None}).has_local_attention
    assert config_from_hf({**raw, "interleave_moe_layer_step": 1, "moe_layers": [0, 1, 2, 3, 9]}).llama4.moe_step == 1
    scout = config_from_hf(CONFIGS["llama-4-scout"])
    assert scout.llama4.temperature_tuning and scout.llama4.qk_l2_norm
    hf_scout = Llama4TextConfig(**_hf_text("llama-4-scout"),
                                rope_parameters={**CONFIGS["llama-4-scout"]["text_config"]["rope_scaling"],
                                                 "rope_theta": 500000.0})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_scout, torch.device("cpu"))
    np.testing.assert_allclose(rope_inv_freq(scout), want.numpy(), rtol=1e-6)


@pytest.mark.parametrize("field,value", [
    ("moe_layers", [0, 2]),  # not every interleave_moe_layer_step-th layer
    ("interleave_moe_layer_step", 0),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
    ("rope_scaling", {"rope_type": "llama3"}),  # no factor
    ("no_rope_layers", [1, 0, 1]),  # shorter than the layers
    ("layer_types", ["chunked_attention", "sliding_attention", "full_attention", "full_attention"]),
    ("hidden_act", "gelu"),
    ("attention_bias", True),
    ("attn_temperature_tuning", "yes"),
    ("floor_scale", 0),
    ("use_qk_norm", "sometimes"),
    ("attention_chunk_size", 0),
    ("sliding_window", 4096),  # a field Llama 4 does not have
])
def test_bad_config_fields_are_named(field, value):
    from infire_jax.errors import UnsupportedModelError
    from infire_jax.models.hf_config import config_from_hf

    config_from_hf(_raw())  # the unmodified config is accepted
    with pytest.raises(UnsupportedModelError, match=field):
        config_from_hf(_raw(**{field: value}))


def test_multimodal_wrapper_fields_are_checked():
    from infire_jax.errors import UnsupportedModelError
    from infire_jax.models.hf_config import config_from_hf

    wrapper = {"model_type": "llama4", "text_config": _raw(), "vision_config": {}, "image_token_index": 200092}
    assert config_from_hf(wrapper).architecture == "llama4"
    for bad, field in (({"video_config": {}}, "video_config"), ({"text_config": None}, "text_config"),
                       ({"text_config": _raw(layer_types=["chunked_attention"] * 4, attention_chunk_size=None)},
                        "layer_types")):
        with pytest.raises(UnsupportedModelError, match=field):
            config_from_hf({**wrapper, **bad})


# ---- the published configurations, built abstractly ---------------------------------------------------------------

@pytest.mark.parametrize("name,experts,moe_layers", [("llama-4-scout", 16, 48), ("llama-4-maverick", 128, 24)])
def test_dummy_configs_have_the_published_shapes(name, experts, moe_layers):
    """`dummy:` carries the published text config; shapes only (no allocation of 100-400B weights).
    The count equals HF's own text model built on the meta device, and the memory plan's tensors
    hold exactly those weights (and a pipeline splits whole super-layers, as the engine does)."""
    import math
    import os

    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    from infire_jax.loaders.dummy import load_dummy
    from infire_jax.loaders.gguf_quant import dummy_layouts
    from infire_jax.memplan.model import from_model_config, placed_config
    from infire_jax.models.registry import abstract_model
    from sharding.mesh import CONFIG_DIR, MeshConfig

    cfg = load_dummy(name).config
    assert (cfg.num_layers, cfg.num_experts, cfg.vocab_size, cfg.num_kv_heads, cfg.head_dim) == (48, experts, 202048,
                                                                                                8, 128)
    assert sum(c == 8192 for c, _ in cfg.local_attention) == 36 and cfg.llama4.stack_sizes["moe"] == moe_layers
    params = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(abstract_model(cfg, jnp.bfloat16),
                                                                               nnx.Param))}
    assert all(isinstance(v.get_value(), jax.ShapeDtypeStruct) for v in params.values())  # nothing allocated
    assert params["moe_layers.w_gate_up"].shape == (moe_layers, experts, 5120, 2, 8192)
    assert params["moe_layers.w_shared_down"].shape == (moe_layers, 8192, 5120)
    assert ("dense_layers.w_gate_up" in params) == (moe_layers < 48)
    ours = sum(math.prod(v.shape) for v in params.values())
    with torch.device("meta"):
        hf = Llama4ForCausalLM(Llama4TextConfig(**_hf_text(name)))
    assert ours == cfg.param_count() == sum(p.numel() for p in hf.parameters())
    plan = from_model_config(cfg, "bfloat16")
    assert sum(math.prod(t.shape) for t in plan.tensors) == ours
    # `weights_quantization="int4"` draws a dummy's layer weights as int4 parts, groups of 128 inputs
    int4 = abstract_model(cfg, jnp.bfloat16, dummy_layouts(cfg, "int4"))
    parts = {".".join(map(str, p)): v.shape for p, v in nnx.to_flat_state(nnx.state(int4, nnx.Param))}
    assert parts["moe_layers.w_gate_up.q4"] == (moe_layers, experts, 5120 // 8, 2, 8192)
    assert parts["moe_layers.w_shared_down.scale"] == (moe_layers, 8192 // 128, 5120)
    assert parts["moe_layers.router"] == (moe_layers, 5120, experts)  # the router stays as it is
    piped = placed_config(cfg, MeshConfig.from_yaml(os.path.join(CONFIG_DIR, "2-pp2.yaml")))  # whole super-layers
    assert piped.num_layers == 48 and piped.llama4.stack_sizes == cfg.llama4.stack_sizes
    small = load_dummy(f"{name},layers=3").config
    assert small.num_layers == 3 and small.llama4.stack_sizes["moe"] == 3 // cfg.llama4.moe_step


def test_image_parts_become_markers_and_their_urls_are_kept():
    """A chat image part is an <|image|> in the message's text and its URL, in order (the engine's
    model expands the marker: tests/test_vision.py); a malformed one is a 400 naming the part."""
    from server.api_error import APIError
    from server.protocol import parse_chat

    url = "data:image/png;base64,AAAA"
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"}, {"type": "image_url", "image_url": {"url": url}}]}]}
    req = parse_chat(body)
    assert req.images == [(url, "messages[0].content[1]")]
    assert req.messages[0]["content"] == "What is in this picture?\n<|image|>"
    body["messages"][0]["content"][1] = {"type": "image_url", "image_url": {"uri": url}}
    with pytest.raises(APIError) as e:
        parse_chat(body)
    assert e.value.status == 400 and e.value.param == "messages[0].content[1]" and "'uri'" in e.value.message


def test_int4_at_load_matches_hf_on_the_same_int4_weights(checkpoints):
    """`weights_quantization="int4"` quantizes both stacks at load (groups of 32 with zero points: the
    experts, shared expert and dense MLPs too); HF given the same round-to-nearest int4 weights,
    dequantized, is the reference."""
    from flax import nnx

    from infire_jax import LLM, SamplingParams

    _, path = checkpoints["causal"]
    want = hf_model("causal")
    quantize_like_int4(want, 32)
    llm = LLM(model=path, weights_quantization="int4", int4_group_size=32, **ENGINE)
    placed = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(llm.engine.runner.state)}
    for name in ("dense_layers.wqkv", "dense_layers.w_down", "moe_layers.wo", "moe_layers.w_gate_up",
                 "moe_layers.w_shared_down"):
        assert placed[f"{name}.q4"].dtype == np.int32 and name not in placed
    _assert_matches(llm.generate(PROMPTS, SamplingParams(**GREEDY)), want)
    llm.engine.close()