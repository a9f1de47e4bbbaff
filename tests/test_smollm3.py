"""SmolLM3 (`smollm3`): the Llama model with every fourth layer a NoPE layer (q and k not rotated;
ModelConfig.nope_layers), and optionally sliding windows on those layers. Tiny random checkpoints of
transformers' SmolLM3ForCausalLM against transformers (greedy tokens, float32 logprobs within 1e-3) with
prompts and outputs past the window; a pipeline of two stages (each with its own layers' NoPE flags)
against one device; the parser against transformers' config."""

from __future__ import annotations

import os

import pytest
import torch
from test_parity import assert_parity
from test_sliding_window_models import COMMON, ENGINE, VOCAB, WINDOW, _prompts

from infire_jax import LLM
from infire_jax.errors import UnsupportedModelError
from infire_jax.loaders.dummy import dummy_tokenizer
from infire_jax.models.config import ModelConfig
from infire_jax.models.hf_config import config_from_hf


def _checkpoint(tmp_path_factory, **kw):
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    torch.manual_seed(3)
    cfg = SmolLM3Config(**{**COMMON, "tie_word_embeddings": True}, num_hidden_layers=8, head_dim=16, pad_token_id=0,
                        rope_theta=10000.0, **kw)
    model = SmolLM3ForCausalLM(cfg).to(torch.float32).eval()
    path = tmp_path_factory.mktemp("smollm3")
    model.save_pretrained(path, safe_serialization=True)
    vocab = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=1,
                        num_heads=4, num_kv_heads=2, head_dim=16, eos_token_ids=(2,))
    dummy_tokenizer(vocab).save(str(path))
    return str(path), model


@pytest.mark.parametrize("window", [None, WINDOW], ids=["global", "windowed-nope-layers"])
def test_matches_transformers(tmp_path_factory, window):
    kw = dict(use_sliding_window=True, sliding_window=window) if window else {}
    path, hf = _checkpoint(tmp_path_factory, **kw)
    llm = LLM(model=path, **ENGINE)
    try:
        cfg = llm.engine.model_config
        assert cfg.nope_layers == (False, False, False, True) * 2
        assert cfg.local_attention == (((0, 0),) * 3 + ((0, WINDOW),)) * 2 if window else not cfg.local_attention
        assert_parity(llm, hf, _prompts(), 32)
    finally:
        llm.engine.close()


def test_pipeline_stages_match_one_device(tmp_path_factory, tmp_path):
    """pp = 2: each stage's layer scan reads its own layers' NoPE flags (layers 3 and 7)."""
    from test_sharding import ROOT, _assert_same, _results, _run_worker

    path, _ = _checkpoint(tmp_path_factory)
    meshes = [os.path.join(ROOT, "sharding", "configs", m) for m in ("1.yaml", "2-pp2.yaml")]
    job = {"runs": [{"model": path, "mesh": mesh} for mesh in meshes], "prompts": _prompts(), "max_tokens": 16,
           "engine": {k: v for k, v in ENGINE.items() if k != "dtype"}}
    single, staged = _results(_run_worker(job, 2, tmp_path, "smollm3_pp"))
    assert single["fits"] and staged["fits"] and staged["mesh_sizes"]["pp"] == 2, staged.get("error")
    _assert_same(staged, single)


def test_parser_follows_transformers():
    from transformers import SmolLM3Config

    for kw in (dict(num_hidden_layers=6), dict(num_hidden_layers=6, no_rope_layer_interval=3),
               dict(num_hidden_layers=4, no_rope_layers=[0, 1, 1, 0]),
               dict(num_hidden_layers=8, use_sliding_window=True, sliding_window=64)):
        theirs = SmolLM3Config(**kw)
        ours = config_from_hf(theirs.to_dict())
        assert list(ours.nope_layers) == [not r for r in theirs.no_rope_layers], kw
        windows = [w for _, w in ours.local_attention] or [0] * theirs.num_hidden_layers
        assert windows == [64 if t == "sliding_attention" else 0 for t in theirs.layer_types], kw
    with pytest.raises(UnsupportedModelError, match="no_rope_layers"):
        config_from_hf({**SmolLM3Config(num_hidden_layers=4).to_dict(), "no_rope_layers": [1, 1, 0]})
