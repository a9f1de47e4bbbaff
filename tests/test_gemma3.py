"""Gemma 3 (models/gemma3.py) against HF transformers' Gemma3ForCausalLM, through the real engine.

A tiny random checkpoint (6 layers, five windowed to one global, an 8-token window that prompts and
outputs cross; the two RoPE bases, the global one scaled linearly; a query_pre_attn_scalar other than
head_dim; random norm weights, so Gemma's 1 + w counts) is loaded by our HF loader and decoded greedily
with chunked prefill on the hybrid KV cache: tokens must equal HF's `generate`, logprobs agree within
1e-3 (float32). The multimodal checkpoint's language model (Gemma3ForConditionalGeneration, with
Google's published tensor names and with transformers 4.5x's) gives the same tokens. Then: the published configs'
shapes and parameter counts against transformers' own model, a mesh against one device, and what is
refused.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from deepseek_models import VOCAB, _save_tokenizer, hf_greedy

from infire_jax.errors import ConfigError, UnsupportedModelError
from infire_jax.models.hf_config import config_from_hf

WINDOW = 8
SHARPEN = 4.0  # the embedding (the tied head) scaled up, so greedy decoding has no near-ties between engines
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
            max_position_embeddings=2048, bos_token_id=256, eos_token_id=257, pad_token_id=0,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
NUM_TOKENS = 40  # the prompts and outputs run well past the window
PROMPTS = [[5, 77, 200, 13, 42], list(range(60, 100)), [258, 3, 3, 190, 64, 99, 120, 7, 250, 11, 31, 17, 90, 200]]
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 32), max_model_len=128,
              page_size=4, num_kv_pages=240)


def _randomize(model) -> None:
    """Random norm weights (HF starts them at 0, so 1 + w would be 1 everywhere), a sharper head."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.5)
        model.get_input_embeddings().weight.mul_(SHARPEN)


def hf_model():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**TINY)).to(torch.float32).eval()
    _randomize(model)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the HF model, its saved float checkpoint)."""
    hf = hf_model()
    path = tmp_path_factory.mktemp("gemma3")
    hf.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    return hf, str(path)


@pytest.fixture(scope="module")
def hf_tokens(checkpoint):
    hf, _ = checkpoint
    return [hf_greedy(hf, prompt, NUM_TOKENS) for prompt in PROMPTS]


def _generate(path: str, **engine) -> list:
    from infire_jax import LLM, SamplingParams

    llm = LLM(model=path, **{**ENGINE, **engine})
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1))
        return llm.engine.model_config, llm.engine.runner.rc.kv_groups, [o.outputs[0] for o in outs]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("attn_impl", ["reference", "pallas_interpret"])
def test_generate_matches_hf(checkpoint, hf_tokens, attn_impl):
    """Through the CPU path (the C++ attention kernel, the panel matmuls) and the GPU's Pallas kernels
    (in interpret mode)."""
    _, path = checkpoint
    cfg, kv_groups, outs = _generate(path, attn_impl=attn_impl)
    assert cfg.architecture == "gemma3" and cfg.local_attention == ((0, WINDOW),) * 5 + ((0, 0),)
    assert kv_groups.bounded  # the windowed layers keep a bounded number of pages
    for (want, want_lp), got in zip(hf_tokens, outs):
        assert got.token_ids == want
        np.testing.assert_allclose([lp[t].logprob for lp, t in zip(got.logprobs, want)], want_lp, atol=1e-3, rtol=0)


def _multimodal_checkpoint(hf, path) -> None:
    """`hf`'s weights as a Gemma3ForConditionalGeneration with a tiny vision tower, saved by transformers."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config={k: v for k, v in TINY.items() if k != "eos_token_id"}, vision_config=vision,
                          mm_tokens_per_image=4, eos_token_id=TINY["eos_token_id"], image_token_index=VOCAB - 1,
                          boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)
    mm = Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    mm.model.language_model.load_state_dict(hf.model.state_dict())
    mm.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)


def _transformers_4_names(path) -> None:
    """Renames a saved multimodal checkpoint's tensors (transformers 5 saves Google's published names,
    `language_model.model.*`) as transformers 4.52 to 4.57 saved them (`model.language_model.*`)."""
    from safetensors.numpy import load_file, save_file

    for file in [f for f in os.listdir(path) if f.endswith(".safetensors")]:
        tensors = load_file(os.path.join(path, file))
        assert "language_model.model.embed_tokens.weight" in tensors and any(k.startswith("vision_tower.")
                                                                             for k in tensors)
        renamed = {k.replace("language_model.model.", "model.language_model.")
                   .replace("vision_tower.", "model.vision_tower.")
                   .replace("multi_modal_projector.", "model.multi_modal_projector."): v for k, v in tensors.items()}
        save_file(renamed, os.path.join(path, file))


@pytest.mark.parametrize("names", ["published", "transformers-4"])
def test_multimodal_checkpoint_serves_its_language_model(checkpoint, hf_tokens, tmp_path, names):
    """A `gemma3` config (text_config inside) and its vision weights skipped: the text model's tokens."""
    hf, _ = checkpoint
    _multimodal_checkpoint(hf, tmp_path)
    if names == "transformers-4":
        _transformers_4_names(tmp_path)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["model_type"] == "gemma3"
    cfg, _, outs = _generate(str(tmp_path), attn_impl="reference", token_buckets=(32,))
    assert cfg.architecture == "gemma3" and cfg.eos_token_ids == (TINY["eos_token_id"],)
    assert [o.token_ids for o in outs] == [want for want, _ in hf_tokens]


@pytest.mark.parametrize("name", ["gemma-3-1b", "gemma-3-4b", "gemma-3-12b", "gemma-3-27b"])
def test_published_configs_build_transformers_model(name):
    """`dummy:gemma-3-*` (the published text configs) parse as transformers' Gemma3TextConfig reads them
    (layer types, RoPE), and the model the engine builds (abstractly) and its memory plan count the
    parameters of transformers' Gemma3ForCausalLM (on the meta device): 1b's 999,885,952 as published."""
    import math

    from flax import nnx
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from infire_jax.loaders.dummy import CONFIGS
    from infire_jax.memplan.model import from_model_config
    from infire_jax.models.registry import abstract_model

    hf = CONFIGS[name]
    cfg = config_from_hf(hf)
    theirs = Gemma3TextConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    assert [w > 0 for _, w in cfg.local_attention] == [t == "sliding_attention" for t in theirs.layer_types]
    assert {w for _, w in cfg.local_attention} == {0, theirs.sliding_window}
    rope = theirs.rope_parameters
    assert (cfg.rope_theta, cfg.gemma3.local_rope_theta) == (rope["full_attention"]["rope_theta"],
                                                            rope["sliding_attention"]["rope_theta"])
    assert (cfg.rope_scaling.factor if cfg.rope_scaling else None) == rope["full_attention"].get("factor")
    with torch.device("meta"):
        count = sum(p.numel() for p in Gemma3ForCausalLM(theirs).parameters())
    built = sum(np.prod(v.shape) for _, v in nnx.to_flat_state(nnx.state(abstract_model(cfg, jnp.bfloat16))))
    assert cfg.param_count() == built == count
    assert sum(math.prod(t.shape) for t in from_model_config(cfg, "bfloat16").tensors) == built
    if name == "gemma-3-1b":
        assert count == 999_885_952


def test_transformers_4_layout_reads_as_5():
    """A 4.x config (rope_theta, rope_scaling, rope_local_base_freq, sliding_window_pattern) and the 5.x
    one transformers writes for it give the same ModelConfig."""
    from transformers import Gemma3TextConfig

    old = dict(model_type="gemma3_text", num_hidden_layers=12, rope_theta=500_000.0, rope_local_base_freq=20_000.0,
               rope_scaling={"rope_type": "linear", "factor": 4.0}, sliding_window_pattern=4, sliding_window=64)
    new = Gemma3TextConfig(**{k: v for k, v in old.items() if k != "model_type"}).to_dict()
    assert "rope_parameters" in new and "layer_types" in new
    ours = config_from_hf(old)
    assert ours == config_from_hf(new)
    assert (ours.rope_theta, ours.gemma3.local_rope_theta, ours.rope_scaling.factor) == (500_000.0, 20_000.0, 4.0)
    assert [w for _, w in ours.local_attention] == [64, 64, 64, 0] * 3


@pytest.mark.parametrize("field,value,match", [
    ("final_logit_softcapping", 30.0, "soft-capping"), ("attn_logit_softcapping", 50.0, "soft-capping"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("hidden_activation", "gelu", "hidden_activation"), ("layer_types", ["full_attention"], "layer_types"),
    ("rope_parameters", {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}, "windowed layers"),
    ("rope_parameters", {"full_attention": {"rope_type": "yarn", "factor": 2.0}}, "rope_type"),
    ("attention_bias", True, "attention_bias"), ("some_new_field", 1, "not a field")])
def test_config_refuses_what_it_cannot_honour(field, value, match):
    with pytest.raises(UnsupportedModelError, match=match):
        config_from_hf({**TINY, "model_type": "gemma3_text", field: value})


def test_int4_at_load_equals_its_float_twin(tmp_path):
    """`weights_quantization="int4"` in groups of 32 (wo's kept in pieces of a 16-wide head): the engine
    holds the layer weights' int4 parts alone and gives the tokens and logprobs of the float engine on a
    twin checkpoint whose projections are the values decoded from the format's definition
    (tests/quant_twins.py)."""
    from infire_jax import SamplingParams
    from quant_twins import assert_kept_and_follows_twin, quantize_twin, twin_outputs

    hf = hf_model()
    for name in ("float", "twin"):
        if name == "twin":
            quantize_twin(hf, "int4", lambda _: TINY["head_dim"], group=32)
        hf.save_pretrained(tmp_path / name, safe_serialization=True)
        _save_tokenizer(tmp_path / name)
    engine = dict(ENGINE, token_buckets=(32,))
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    want = twin_outputs(str(tmp_path / "twin"), engine, PROMPTS, params)
    kept = [f"layers.{w}" for w in ("wqkv", "wo", "w_gate_up", "w_down")]
    assert_kept_and_follows_twin(str(tmp_path / "float"), dict(engine, weights_quantization="int4", int4_group_size=32),
                                 kept, "q4", PROMPTS, params, want, 1e-5)


def test_refuses_what_its_layers_do_not_take(checkpoint):
    """LoRA and palette-compressed weights are refused naming Gemma 3, before any step runs."""
    from infire_jax import LLM

    _, path = checkpoint
    for extra, match in ((dict(enable_lora=True), "not on Gemma 3"),
                         (dict(weights_compression="palette", dtype="bfloat16"),
                          "weights_compression is not supported for Gemma 3")):
        with pytest.raises(ConfigError, match=match):
            LLM(model=path, **{**ENGINE, **extra})


def test_meshes_match_one_device(checkpoint, tmp_path):
    """tp 2 (the heads with their q/k norms whole on each device, the MLP's width; the sandwich norms
    after the reductions) and a pipeline of 2 stages (each with its layers' window rows and RoPE picks),
    in one process with virtual devices: one device's greedy tokens, its logprobs within float32
    rounding of the reductions' order."""
    from test_sharding import ROOT, _assert_each_device_holds_its_shard, _results, _run_worker

    _, path = checkpoint
    meshes = ["1", "2", "2-pp2"]
    runs = [{"model": path, "mesh": os.path.join(ROOT, "sharding", "configs", f"{m}.yaml"), "tag": m} for m in meshes]
    engine = {**{k: v for k, v in ENGINE.items() if k != "dtype"}, "token_buckets": [32], "num_decode_steps": 1}
    job = {"runs": runs, "prompts": PROMPTS, "max_tokens": 16, "engine": engine}
    results = {r["tag"]: r for r in _results(_run_worker(job, 2, tmp_path, "gemma3"))}
    single = results["1"]
    for mesh, r in results.items():
        assert r["fits"] and r["tokens"] == single["tokens"], (mesh, r.get("error"))
        np.testing.assert_allclose(r["logprobs"], single["logprobs"], atol=1e-4, rtol=0)
        if mesh == "1":
            continue
        _assert_each_device_holds_its_shard(r)
        specs = {k: v["spec"] for k, v in r["params"].items()}
        if mesh == "2":
            assert specs["layers.wqkv"][2] == "tp" and specs["layers.w_down"] == [None, "tp", None]
            assert specs["layers.post_attn_norm"] == specs["layers.q_norm"] == [None, None]
        else:
            assert specs["layers.post_mlp_norm"] == ["pp", None] and r["kv_groups"] is not None
