"""Sliding-window models, refused before the hybrid KV cache: Mistral v0.1's `sliding_window` (every
layer), Qwen2/3's `use_sliding_window` (the layers from `max_window_layers` on, or as `layer_types`
says), Mixtral's. The config parser against transformers' own config classes, and tiny random HF
checkpoints against transformers (greedy tokens, float32 logprobs within 1e-3), prompts and outputs
longer than the window; the Qwen2 model with both kinds of layers also against itself with every
page kept."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_parity import assert_parity

from infire_jax import LLM, SamplingParams
from infire_jax.errors import UnsupportedModelError
from infire_jax.core.hybrid_kv_cache import HybridKVCacheManager
from infire_jax.loaders.dummy import dummy_tokenizer
from infire_jax.models.config import ModelConfig
from infire_jax.models.hf_config import config_from_hf

WINDOW = 16
VOCAB = 512
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=4096, initializer_range=0.3, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, rms_norm_eps=1e-6)
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 32), max_model_len=128,
              page_size=4, num_kv_pages=160, num_decode_steps=1)


def hf_windows(hf_config) -> tuple[tuple[int, int], ...]:
    """What transformers' config object applies per layer: (0, W) where a layer slides."""
    window = hf_config.sliding_window
    types = getattr(hf_config, "layer_types", None) or ["sliding_attention"] * hf_config.num_hidden_layers
    if not window:
        return ()
    return tuple((0, window) if t == "sliding_attention" else (0, 0) for t in types)


@pytest.mark.parametrize("family, kwargs", [
    ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)),
    ("qwen2", dict(use_sliding_window=False, sliding_window=WINDOW, max_window_layers=2)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=WINDOW,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
    ("mistral", dict(sliding_window=WINDOW)),
    ("mistral", dict(sliding_window=None)),
    ("mixtral", dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2)),
])
def test_parser_slides_the_layers_transformers_slides(family, kwargs):
    from transformers import AutoConfig

    hf = AutoConfig.for_model(family, num_hidden_layers=4, **COMMON, **kwargs)
    ours = config_from_hf(hf.to_dict()).local_attention
    assert ours == hf_windows(hf)
    if family == "qwen2" and kwargs["use_sliding_window"]:
        assert ours == ((0, 0), (0, 0), (0, WINDOW), (0, WINDOW))


def test_parser_refuses_what_it_cannot_honour():
    base = dict(model_type="qwen2", num_hidden_layers=2, vocab_size=VOCAB, hidden_size=64, num_attention_heads=4,
                use_sliding_window=True, sliding_window=WINDOW)
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        config_from_hf({**base, "layer_types": ["sliding_attention", "chunked_attention"]})
    with pytest.raises(UnsupportedModelError, match="sliding_window"):
        config_from_hf({**base, "sliding_window": -3})
    with pytest.raises(UnsupportedModelError, match="llama"):
        config_from_hf({**base, "model_type": "llama"})
    # A Mistral config.json without the key gets transformers' default window of 4096.
    assert config_from_hf({**base, "model_type": "mistral", "sliding_window": None}).local_attention == ()
    mistral = {k: v for k, v in base.items() if k != "sliding_window"}
    assert config_from_hf({**mistral, "model_type": "mistral"}).local_attention == ((0, 4096),) * 2


def _tiny_hf_dir(tmp_path_factory, family: str):
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config, Qwen3Config

    if family == "qwen2":  # layers 0-1 global, 2-3 sliding
        cfg = Qwen2Config(**COMMON, num_hidden_layers=4, rope_theta=10000.0, use_sliding_window=True,
                          sliding_window=WINDOW, max_window_layers=2)
    elif family == "qwen3":  # layers 0-1 sliding, 2-3 global
        cfg = Qwen3Config(**COMMON, num_hidden_layers=4, head_dim=16, rope_theta=10000.0, use_sliding_window=True,
                          sliding_window=WINDOW, layer_types=["sliding_attention"] * 2 + ["full_attention"] * 2)
    else:  # every layer sliding
        cfg = MistralConfig(**COMMON, num_hidden_layers=3, head_dim=16, rope_theta=10000.0, sliding_window=WINDOW)
    torch.manual_seed({"qwen2": 5, "mistral": 6, "qwen3": 7}[family])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp(f"{family}-sliding")
    model.save_pretrained(path, safe_serialization=True)
    vocab = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=1,
                        num_heads=4, num_kv_heads=2, head_dim=16, eos_token_ids=(2,))
    dummy_tokenizer(vocab).save(str(path))
    return str(path), model


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, VOCAB, n).tolist() for n in (40, 7, 25)]  # and 48 tokens out: past the window


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_tiny_sliding_window_models_match_transformers(family, tmp_path_factory):
    path, hf_model = _tiny_hf_dir(tmp_path_factory, family)
    llm = LLM(model=path, **ENGINE)
    cfg = llm.engine.model_config
    groups = llm.engine.runner.rc.kv_groups
    assert isinstance(llm.engine.kv, HybridKVCacheManager)
    if family == "qwen2":
        assert cfg.local_attention == ((0, 0), (0, 0), (0, WINDOW), (0, WINDOW))
        assert [(g.kind, g.layers) for g in groups.groups] == [("global", (0, 1)), (f"window {WINDOW}", (2, 3))]
    else:
        assert cfg.local_attention == ((0, WINDOW),) * 3 and groups.num_groups == 1
    assert_parity(llm, hf_model, _prompts(), 48)
    if family == "qwen2":  # the same model keeping every page: the same tokens, the same logprobs
        params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, logprobs=1)
        kept = LLM(model=path, **ENGINE, hybrid_kv_cache=False)
        for a, b in zip(llm.generate(_prompts(), params), kept.generate(_prompts(), params)):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            np.testing.assert_allclose([lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)],
                                       [lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)],
                                       rtol=0, atol=1e-5)
    kv = llm.engine.kv
    assert kv.num_free_pages == kv.num_usable_pages and llm.engine.compiles_since_warmup == 0


def test_pipeline_stages_match_one_device(tmp_path_factory, tmp_path):
    """pp = 2 (2-pp2.yaml, 2 virtual devices): each stage's layer scan takes its own layers' windows and
    reads its share of the hybrid pool through its layers' group tables. The Qwen3 model's window layers
    are stage 0's, its global layers stage 1's (a group per kind, each page half padding); the 3-layer
    Mistral's stages hold 1 and 2 layers, the padding slot beside its stage's layer. Greedy tokens and
    logprobs (1e-4) of prompts and outputs past the window equal one device's, and every page comes back."""
    import os

    from test_sharding import ROOT, _assert_same, _results, _run_worker

    models = {family: _tiny_hf_dir(tmp_path_factory, family)[0] for family in ("qwen3", "mistral")}
    meshes = [os.path.join(ROOT, "sharding", "configs", m) for m in ("1.yaml", "2-pp2.yaml")]
    job = {"runs": [{"model": path, "mesh": mesh} for path in models.values() for mesh in meshes],
           "prompts": _prompts(), "max_tokens": 24, "engine": {k: v for k, v in ENGINE.items() if k != "dtype"}}
    results = _results(_run_worker(job, 2, tmp_path, "sliding_pp"))
    assert [r["fits"] for r in results] == [True] * 4, [r.get("error") for r in results]
    for single, staged in zip(results[::2], results[1::2]):
        assert staged["mesh_sizes"]["pp"] == 2
        _assert_same(staged, single)  # logprobs within the mesh tests' 1e-4 (one device's CPU kernels round apart)
        assert staged["pages_free"][0] == staged["pages_free"][1]
    assert results[1]["kv_groups"] == ("KV groups: 1 x global (2 layers), 1 x window 16 (2 layers); "
                                       "a page holds 4 layers (4 of them padding)")
    assert results[3]["kv_groups"] == "KV groups: 1 x window 16 (4 layers); a page holds 4 layers"  # 1 padding slot
