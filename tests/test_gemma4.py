"""Gemma 4 (models/gemma4.py) against HF transformers' Gemma4ForCausalLM, through the real engine.

Two tiny random checkpoints, each 6 layers in blocks of two windowed layers and one full layer, an
8-token window that prompts and outputs cross, soft-capped logits, and the published models' shape
contrast: windowed layers 4 kv heads of 16, full layers 1 kv head of 32 (so the full layers fill half
the pool's slot and write each head twice), RoPE on a quarter of the full layers' head ("proportional").
"dense" has the full layers' values from the k projection (attention_k_eq_v, as both published models);
"moe" a v projection (so full layers keep 4 kv heads, as transformers reads the config: the windowed layers
then fill half the slot) and a MoE block of 4 experts, top 2, beside the dense MLP. Norm weights, the
layer scalars and the router's scales are random, so a formula that drops or misplaces one fails.
Decoded greedily with chunked prefill on the hybrid KV cache (test_gemma3's prompts and engine): tokens
equal HF's `generate`, logprobs within 1e-3 (float32). The multimodal checkpoint's language model (Gemma4ForConditionalGeneration) gives
the same tokens. Then: the published configs' parameter counts against transformers' own model, and
what is refused.
"""

from __future__ import annotations

import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from deepseek_models import VOCAB, _save_tokenizer, hf_greedy
from test_gemma3 import ENGINE, NUM_TOKENS, PROMPTS, SHARPEN, WINDOW, _generate

from infire_jax.errors import ConfigError, UnsupportedModelError
from infire_jax.models.hf_config import config_from_hf

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=8,
            num_key_value_heads=4, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
            attention_k_eq_v=True, sliding_window=WINDOW, layer_types=LAYER_TYPES, final_logit_softcapping=15.0,
            hidden_size_per_layer_input=0, max_position_embeddings=2048, bos_token_id=256, eos_token_id=257,
            pad_token_id=0)
MODELS = {"dense": TINY,
          "moe": dict(TINY, attention_k_eq_v=False, enable_moe_block=True, num_experts=4, top_k_experts=2,
                      moe_intermediate_size=24)}
# The pool's slot per token, (heads, head_dim), and the full layers' head_dim: "dense" holds the windowed
# layers' 4 x 16, its full layers' 1 x 32 written twice; "moe" (without k_eq_v transformers keeps the
# windowed kv head count for full layers too) holds the full layers' 4 x 32 as 8 x 16, the windowed layers'
# heads written twice.
POOL_HEADS = {"dense": (4, 16, 32), "moe": (8, 16, 32)}


def _randomize(model) -> None:
    """Random norm weights, layer scalars and router scales around 1 (HF starts them at 1), a sharper head."""
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or name.endswith(("layer_scalar", "router.scale", "per_expert_scale")):
                p.copy_(1.0 + torch.randn_like(p) * 0.3)
        model.get_input_embeddings().weight.mul_(SHARPEN)


def _hf_model(kind: str, **changes):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**{**MODELS[kind], **changes})).to(torch.float32).eval()
    _randomize(model)
    return model


def _saved(model, path) -> str:
    model.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (the HF model, its saved float checkpoint, HF's greedy tokens and logprobs for PROMPTS),
    each made on first use and shared by the module's tests."""
    made = {}

    def get(kind: str):
        if kind not in made:
            hf = _hf_model(kind)
            path = tmp_path_factory.mktemp(f"gemma4-{kind}")
            hf.save_pretrained(path, safe_serialization=True)
            _save_tokenizer(path)
            made[kind] = hf, str(path), [hf_greedy(hf, prompt, NUM_TOKENS) for prompt in PROMPTS]
        return made[kind]

    return get


@pytest.mark.parametrize("kind,attn_impl", [("dense", "reference"), ("dense", "pallas_interpret"),
                                            ("moe", "reference")])
def test_generate_matches_hf(checkpoints, kind, attn_impl):
    """Through the CPU path (the C++ attention kernel) and the GPU's Pallas kernels (in interpret mode; on
    the dense model only, as the MoE block is outside attention)."""
    _, path, hf_tokens = checkpoints(kind)
    cfg, kv_groups, outs = _generate(path, attn_impl=attn_impl)
    assert cfg.architecture == "gemma4" and cfg.local_attention == ((0, WINDOW), (0, WINDOW), (0, 0)) * 2
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.gemma4.global_head_dim) == POOL_HEADS[kind]
    assert cfg.is_moe == (kind == "moe") and kv_groups.bounded
    for (want, want_lp), got in zip(hf_tokens, outs):
        assert got.token_ids == want
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(got.logprobs, want)], want_lp, atol=1e-3, rtol=0)


def test_prefix_hits_and_preemption_keep_hf_tokens(checkpoints):
    """The engine's paging with the pool viewed per layer kind: a prompt sharing 41 tokens with an earlier
    one reuses its pages (prefix cache), and requests preempted when a small pool runs out resume; both
    give HF's greedy tokens."""
    from infire_jax import LLM, SamplingParams

    hf, path, _ = checkpoints("dense")
    shared = PROMPTS[1] + [3]
    rng = np.random.default_rng(0)
    # 90 tokens each: 4 x 30 pages > 63; no token 0, which HF's generate masks as padding
    crowd = [rng.integers(1, 256, n).tolist() for n in (30, 25, 28, 20)]
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    llm = LLM(model=path, **{**ENGINE, "num_kv_pages": 64})
    try:
        llm.generate([shared + [7]], params)
        out = llm.generate([shared + [9, 10, 11]], params)[0]
        assert out.num_cached_tokens > 0
        assert out.outputs[0].token_ids == hf_greedy(hf, shared + [9, 10, 11], NUM_TOKENS)[0]
        llm.engine.scheduler.growth_ratio = 0.1  # admit optimistically: the pool must run out
        outs = llm.generate(crowd, SamplingParams(max_tokens=90, temperature=0, ignore_eos=True))
        assert llm.engine.scheduler.num_preemptions > 0
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 90)[0] for p in crowd]
    finally:
        llm.engine.close()


def test_multimodal_checkpoint_serves_its_language_model(checkpoints, tmp_path):
    """A `gemma4` config (text_config inside), its vision tower and embedder skipped: the text model's tokens."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    kind = "moe"  # the MoE layers' names under the language model's prefix too
    hf, _, hf_tokens = checkpoints(kind)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16)
    config = Gemma4Config(text_config={k: v for k, v in MODELS[kind].items() if k != "eos_token_id"},
                          vision_config=vision, audio_config=None, eos_token_id=TINY["eos_token_id"])
    mm = Gemma4ForConditionalGeneration(config).to(torch.float32).eval()
    mm.model.language_model.load_state_dict(hf.model.state_dict())
    mm.save_pretrained(tmp_path, safe_serialization=True)
    _save_tokenizer(tmp_path)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["model_type"] == "gemma4"
    cfg, _, outs = _generate(str(tmp_path), attn_impl="reference", token_buckets=(32,))
    assert cfg.architecture == "gemma4" and cfg.eos_token_ids == (TINY["eos_token_id"],)
    assert [o.token_ids for o in outs] == [want for want, _ in hf_tokens]


# (kind, weights_quantization, config changes): int4 on heads of 32 and 64, so that groups of 32 fit both kinds'.
QUANTIZED = {"dense int8": ("dense", "int8", {}), "moe fp8": ("moe", "fp8", {}),
             "dense int4": ("dense", "int4", dict(head_dim=32, global_head_dim=64))}


@pytest.mark.parametrize("case", list(QUANTIZED))
def test_weights_quantized_at_load_equal_their_float_twin(case, tmp_path, monkeypatch):
    """`weights_quantization` int8 / fp8 (a float32 scale per output channel, wo's per head too) and int4
    (groups of 32) on both layer kinds' projections and the MoE experts: the engine holds their quantized
    parts alone and gives the tokens and logprobs of the float engine on a twin checkpoint, whose
    projections are the kept values decoded from the formats' definitions (tests/quant_twins.py). The MoE's
    also through the GPU's kernels (interpret mode), which read the parts in place: the dense quantized
    matmul, and the grouped one for the experts."""
    from infire_jax import SamplingParams
    from quant_twins import assert_kept_and_follows_twin, quantize_twin, twin_outputs

    kind, mode, changes = QUANTIZED[case]
    hf = _hf_model(kind, **changes)
    path = _saved(hf, tmp_path / "float")
    dims = {"sliding_attention": changes.get("head_dim", TINY["head_dim"]),
            "full_attention": changes.get("global_head_dim", TINY["global_head_dim"])}
    quantize_twin(hf, mode, lambda name: dims[LAYER_TYPES[int(name.split(".")[2])]], group=32)
    engine = dict(ENGINE, token_buckets=(32,))
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    want = twin_outputs(_saved(hf, tmp_path / "twin"), engine, PROMPTS, params)
    quantized = dict(engine, weights_quantization=mode, int4_group_size=32 if mode == "int4" else None)
    names = ["wqkv", "wo", "w_gate_up", "w_down", *(["w_experts_gate_up", "w_experts_down"] if kind == "moe" else [])]
    kept = [f"{stack}.{name}" for stack in ("sliding_layers", "full_layers") for name in names]
    part = {"int8": "int8", "fp8": "fp8", "int4": "q4"}[mode]
    assert_kept_and_follows_twin(path, quantized, kept, part, PROMPTS, params, want, 1e-5)
    if kind == "moe":
        monkeypatch.setenv("INFIRE_JAX_QUANT_MATMUL", "pallas")
        monkeypatch.setenv("INFIRE_JAX_MOE_GROUPED", "pallas")
        assert_kept_and_follows_twin(path, quantized, kept, part, PROMPTS, params, want, 1e-4)


def test_meshes_match_hf(checkpoints, tmp_path):
    """Both checkpoints on meshes, in one process with 8 virtual devices: "dense" on tp 2 (its full layers'
    one kv head repeated to 2, each device's half of the pool's slot one 32-wide head), "moe" on tp 2 x pp 2
    x ep 2 (2 experts a device, a block a stage with its window rows). Each run gives HF's greedy tokens and
    logprobs, as one device does (test_generate_matches_hf). tp 4 on "dense" is refused by name: the slot's
    2 full-layer heads of 32 cannot be split over 4."""
    from test_sharding import ROOT, _assert_each_device_holds_its_shard, _results, _run_worker

    every = tmp_path / "tp2-pp2-ep2.yaml"
    every.write_text("mesh: {dp: 1, pp: 2, tp: 2, ep: 2}\n"
                     "rules: {vocab: tp, q_heads: tp, kv_heads: tp, mlp: tp, experts: ep, layers: pp}\n")
    configs = os.path.join(ROOT, "sharding", "configs")
    runs = [{"model": checkpoints(kind)[1], "mesh": mesh, "tag": f"{kind} {os.path.basename(mesh)[:-5]}"}
            for kind, mesh in (("dense", f"{configs}/4.yaml"), ("dense", f"{configs}/2.yaml"), ("moe", str(every)))]
    # int8 at load on tp 2 (the full layers' one kv head repeated in the kept values and scales) as on one device
    runs += [{"model": checkpoints("dense")[1], "mesh": f"{configs}/{mesh}.yaml", "tag": f"int8 {mesh}",
              "weights_quantization": "int8"} for mesh in ("1", "2")]
    engine = {**{k: v for k, v in ENGINE.items() if k != "dtype"}, "token_buckets": [32], "num_decode_steps": 1}
    job = {"runs": runs, "prompts": PROMPTS, "max_tokens": NUM_TOKENS, "engine": engine}
    results = {r["tag"]: r for r in _results(_run_worker(job, 8, tmp_path, "gemma4"))}
    refused = results.pop("dense 4")
    int8 = [results.pop(f"int8 {mesh}") for mesh in ("1", "2")]
    assert all(r["fits"] for r in int8), [r.get("error") for r in int8]
    assert int8[1]["tokens"] == int8[0]["tokens"]
    np.testing.assert_allclose(int8[1]["logprobs"], int8[0]["logprobs"], atol=1e-4, rtol=0)
    assert int8[1]["params"]["full_layers.wqkv.int8"]["spec"][2] == "tp"
    assert not refused["fits"] and "does not fit the model" in refused["error"] and "tp=4" in refused["error"]
    for tag, r in results.items():
        kind, mesh = tag.split()
        assert r["fits"], (tag, r.get("error"))
        for (want, want_lp), got, got_lp in zip(checkpoints(kind)[2], r["tokens"], r["logprobs"]):
            assert got == want, tag
            np.testing.assert_allclose(got_lp, want_lp, atol=1e-3, rtol=0)
        _assert_each_device_holds_its_shard(r)
        specs, sizes = {k: v["spec"] for k, v in r["params"].items()}, r["mesh_sizes"]
        for stack in ("sliding_layers", "full_layers"):
            assert specs[f"{stack}.wqkv"][2] == specs[f"{stack}.wo"][1] == "tp"
            assert specs[f"{stack}.layer_scalar"][0] == ("pp" if sizes["pp"] > 1 else None)
        if sizes["ep"] > 1:
            assert specs["sliding_layers.w_experts_down"][1] == "ep"
    # "dense"'s full layers hold their one kv head twice on tp 2: [layers, E, 2, G / 2 + 1 (q and k), D] float32
    assert results["dense 2"]["params"]["full_layers.wqkv"]["global"] == (
        2 * TINY["hidden_size"] * 2 * (TINY["num_attention_heads"] // 2 + 1) * TINY["global_head_dim"] * 4)


@pytest.mark.parametrize("name", ["gemma-4-31b", "gemma-4-26b-a4b"])
def test_published_configs_build_transformers_model(name):
    """`dummy:gemma-4-*` parse as transformers' Gemma4TextConfig reads them (layer kinds, per-layer shapes),
    and the model the engine builds (abstractly) and its memory plan count the parameters of transformers'
    Gemma4ForCausalLM (on the meta device), plus one layer scalar a layer (a buffer there)."""
    from flax import nnx
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from infire_jax.loaders.dummy import CONFIGS
    from infire_jax.memplan.model import from_model_config
    from infire_jax.models.registry import abstract_model

    hf = CONFIGS[name]
    cfg = config_from_hf(hf)
    theirs = Gemma4TextConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    assert [w > 0 for _, w in cfg.local_attention] == [t == "sliding_attention" for t in theirs.layer_types]
    full, local = (theirs.per_layer_config[theirs.layer_types.index(t)]
                   for t in ("full_attention", "sliding_attention"))
    assert (cfg.gemma4.global_head_dim, cfg.gemma4.global_kv_heads) == (full.head_dim, full.num_key_value_heads)
    assert (cfg.head_dim, cfg.gemma4.sliding_kv_heads) == (local.head_dim, local.num_key_value_heads)
    with torch.device("meta"):
        count = sum(p.numel() for p in Gemma4ForCausalLM(theirs).parameters())
    built = sum(np.prod(v.shape) for _, v in nnx.to_flat_state(nnx.state(abstract_model(cfg, jnp.bfloat16))))
    assert cfg.param_count() == built == count + cfg.num_layers
    assert sum(math.prod(t.shape) for t in from_model_config(cfg, "bfloat16").tensors) == built
    # The pool's slot is the windowed layers' (16 x 256 or 8 x 256): the full layers' 4 x 512 / 2 x 512 fill half.
    assert cfg.num_kv_heads == cfg.gemma4.sliding_kv_heads


# Each shipped mesh's fit for the published models: None where it fits (the full layers' kv heads repeated
# to tp where fewer), else the refusal's words.
PUBLISHED_MESHES = {
    "gemma-4-31b": {"2": None, "2-pp2": None, "4": None, "8": None, "8-tp4-pp2": None,
                    "8-pp8": "10 blocks of 6 layers .* cannot be split evenly over 8", "8-ep8": "mixture-of-experts"},
    "gemma-4-26b-a4b": {"2": None, "4": None, "8-ep8": None, "8-tp2-ep4": None,
                        "8-tp4-pp2": "5 blocks of 6 layers .* cannot be split evenly over 2",
                        "8": "tp=8 must divide the KV slot of a token, 8 heads of 256 .* 4 of 512"}}


@pytest.mark.parametrize("name", sorted(PUBLISHED_MESHES))
def test_published_models_on_shipped_meshes(name):
    """Shapes only (the plan's checks, no device): which meshes take `dummy:gemma-4-*`, the kv heads as placed
    (the engine's plan and the memory plan's alike), and the refusals by name."""
    import jax

    from infire_jax.loaders.dummy import CONFIGS
    from infire_jax.memplan.model import placed_config
    from sharding.mesh import CONFIG_DIR, MeshConfig, MeshConfigError
    from sharding.plan import ShardPlan

    cfg = config_from_hf(CONFIGS[name])
    for mesh, refusal in PUBLISHED_MESHES[name].items():
        mc = MeshConfig.from_yaml(os.path.join(CONFIG_DIR, f"{mesh}.yaml"))
        if refusal:
            with pytest.raises(MeshConfigError, match=f"does not fit the model: .*{refusal}"):
                ShardPlan.create(cfg, mc, [jax.devices()[0]] * 8)
            continue
        placed = ShardPlan.create(cfg, mc, [jax.devices()[0]] * 8).effective_config(cfg)
        assert placed == placed_config(cfg, mc) and placed.num_kv_heads == cfg.num_kv_heads, mesh
        tp = mc.sizes["tp"]
        assert placed.gemma4.global_kv_heads == max(cfg.gemma4.global_kv_heads, tp), mesh


@pytest.mark.parametrize("field,value,match", [
    ("hidden_size_per_layer_input", 256, "per-layer embeddings"), ("num_kv_shared_layers", 2, "num_kv_shared_layers"),
    ("use_double_wide_mlp", True, "use_double_wide_mlp"), ("use_bidirectional_attention", "all", "causally"),
    ("attention_bias", True, "attention_bias"), ("hidden_activation", "gelu", "hidden_activation"),
    ("layer_types", ["sliding_attention", "full_attention", "full_attention"] * 2, "blocks"),
    ("num_global_key_value_heads", 3, "per_layer_config"),
    ("rope_parameters", {"full_attention": {"rope_type": "yarn", "factor": 2.0}}, "rope_type"),
    ("some_new_field", 1, "not a field")])
def test_config_refuses_what_it_cannot_honour(field, value, match):
    with pytest.raises(UnsupportedModelError, match=match):
        config_from_hf({**TINY, "model_type": "gemma4_text", field: value})


def test_refuses_what_its_layers_do_not_take(checkpoints):
    """LoRA, palette-compressed weights and an fp8 KV cache are refused naming Gemma 4, before any step runs."""
    from infire_jax import LLM

    _, path, _ = checkpoints("dense")
    for extra, match in ((dict(enable_lora=True), "not on Gemma 4"),
                         (dict(weights_compression="palette", dtype="bfloat16"),
                          "weights_compression covers .* this model has none of them"),
                         (dict(kv_cache_dtype="fp8"), "kv_cache_dtype fp8 is not supported")):
        with pytest.raises(ConfigError, match=match):
            LLM(model=path, **{**ENGINE, **extra})
