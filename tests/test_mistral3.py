"""Mistral 3 (Mistral Small 3.1 / 3.2, Magistral Small): a `mistral3` checkpoint's language model, a
Mistral under `text_config` beside a Pixtral vision tower that is not loaded. A tiny random
Mistral3ForConditionalGeneration, saved by transformers (Mistral's published tensor names) and renamed
as transformers 4.5x saved it, is served from both: greedy tokens equal transformers' text-only
`generate` of the same model and logprobs agree within 1e-3 (float32)."""

from __future__ import annotations

import pytest
import torch
from test_gemma3 import _transformers_4_names
from test_parity import assert_parity

from infire_jax import LLM
from infire_jax.errors import UnsupportedModelError
from infire_jax.loaders.dummy import dummy_tokenizer
from infire_jax.models.config import ModelConfig
from infire_jax.models.hf_config import config_from_hf

VOCAB = 512
TEXT = dict(model_type="mistral", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1_000_000.0, sliding_window=None,
            max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)
ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(4, 32), max_model_len=128,
              page_size=4, num_kv_pages=160)
PROMPTS = [[5, 77, 200, 13, 42], list(range(60, 100)), [300, 3, 3, 190, 64, 99, 120, 7, 250, 11, 31, 17, 90, 200]]


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, head_dim=16)
    config = Mistral3Config(text_config=TEXT, vision_config=vision, image_token_index=10, spatial_merge_size=2,
                            eos_token_id=2, bos_token_id=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():
        for p in model.model.language_model.parameters():
            p.normal_(0, 0.3) if p.ndim > 1 else p.copy_(1 + 0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("mistral3")
    model.save_pretrained(path, safe_serialization=True)
    vocab = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=1,
                        num_heads=4, num_kv_heads=2, head_dim=16, eos_token_ids=(2,))
    dummy_tokenizer(vocab).save(str(path))
    return model, path


@pytest.mark.parametrize("names", ["published", "transformers-4"])
def test_language_model_matches_transformers(mistral3, names, tmp_path):
    import shutil

    model, saved = mistral3
    path = tmp_path / "model"
    shutil.copytree(saved, path)
    if names == "transformers-4":
        _transformers_4_names(path)
    llm = LLM(model=str(path), **ENGINE)
    try:
        cfg = llm.engine.model_config
        assert (cfg.architecture, cfg.num_layers, cfg.rope_theta, cfg.local_attention) == ("llama", 3, 1e6, ())
        assert cfg.eos_token_ids == (2,) and not cfg.tie_word_embeddings
        assert_parity(llm, model, PROMPTS, 24)
    finally:
        llm.engine.close()


def test_refuses_a_text_config_that_is_not_mistral():
    with pytest.raises(UnsupportedModelError, match="text_config must be a mistral"):
        config_from_hf({"model_type": "mistral3", "text_config": {**TEXT, "model_type": "qwen2"}})
    with pytest.raises(UnsupportedModelError, match="text_config must be a mistral"):
        config_from_hf({"model_type": "mistral3"})
