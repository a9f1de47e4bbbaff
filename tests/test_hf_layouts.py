"""Checkpoints whose layout differs from Llama's but whose model is models/llama.py's, each against
transformers (greedy tokens equal, float32 logprobs within 1e-3):

- Mistral 3 (Mistral Small 3.1 / 3.2, Magistral Small): a `mistral3` checkpoint's language model, a
  Mistral under `text_config` beside a Pixtral vision tower that is not loaded. A tiny random
  Mistral3ForConditionalGeneration, saved by transformers (Mistral's published tensor names) and
  renamed as transformers 4.5x saved it, against transformers' text-only `generate` of it.
- Phi-3 / Phi-4 (`phi3`): q/k/v fused in one weight and gate/up in another, split at load; a tiny
  random Phi3ForCausalLM with more query heads than kv heads, with and without a sliding window.
"""

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


def _save(model, path) -> None:
    """The transformers model's checkpoint, with a tokenizer of its vocabulary (EOS 2)."""
    model.save_pretrained(path, safe_serialization=True)
    vocab = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=1,
                        num_heads=4, num_kv_heads=2, head_dim=16, eos_token_ids=(2,))
    dummy_tokenizer(vocab).save(str(path))


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
    _save(model, path)
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


@pytest.mark.parametrize("window", [None, 8])
def test_phi3_matches_transformers(window, tmp_path):
    from transformers import Phi3Config, Phi3ForCausalLM

    text = {k: v for k, v in TEXT.items() if k not in ("model_type", "head_dim", "sliding_window")}
    torch.manual_seed(1)
    model = Phi3ForCausalLM(Phi3Config(**text, sliding_window=window, pad_token_id=0, eos_token_id=2,
                                       bos_token_id=1, initializer_range=0.3)).to(torch.float32).eval()
    _save(model, tmp_path)
    llm = LLM(model=str(tmp_path), **ENGINE)
    try:
        assert llm.engine.model_config.local_attention == (((0, window),) * 3 if window else ())
        assert_parity(llm, model, PROMPTS, 24)
    finally:
        llm.engine.close()


def test_refuses_a_text_config_that_is_not_mistral():
    with pytest.raises(UnsupportedModelError, match="text_config must be a mistral"):
        config_from_hf({"model_type": "mistral3", "text_config": {**TEXT, "model_type": "qwen2"}})
    with pytest.raises(UnsupportedModelError, match="text_config must be a mistral"):
        config_from_hf({"model_type": "mistral3"})


@pytest.mark.parametrize("checkpoint_len, served_len", [(128, 128), (32, 32), (128, 32)],
                         ids=["long-factors", "short-factors", "extended-served-short"])
def test_phi4_mini_partial_rotation_and_longrope_match_transformers(checkpoint_len, served_len, tmp_path):
    """Phi-4-mini's layers: q and k rotate three quarters of each head, with LongRoPE (random short and
    long factors, an original context of 32). A checkpoint extending it (to 128: an attention factor of
    sqrt(1 + ln 4 / ln 32)) served at 128 rotates every position by the long factors, as transformers
    rotates a sequence longer than 32 (one forward over 44 and 53 tokens); one that does not, by the
    short factors, as transformers rotates sequences within 32 (24 tokens); the extending one served at
    32 (vLLM's choice by max_model_len) by the short factors with its attention factor, as transformers
    rotates that checkpoint's sequences within 32."""
    import math

    import numpy as np

    from transformers import Phi3Config, Phi3ForCausalLM

    extended = served_len > 32

    text = {k: v for k, v in TEXT.items() if k not in ("model_type", "head_dim", "sliding_window", "rope_theta")}
    rng = np.random.default_rng(3)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": rng.uniform(1, 3, 6).round(3).tolist(), "long_factor": rng.uniform(2, 20, 6).round(3).tolist()}
    torch.manual_seed(3)
    config = Phi3Config(**{**text, "max_position_embeddings": checkpoint_len},
                        original_max_position_embeddings=32, rope_parameters=rope, pad_token_id=0, eos_token_id=2,
                        bos_token_id=1, initializer_range=0.3)
    model = Phi3ForCausalLM(config).to(torch.float32).eval()
    _save(model, tmp_path)
    llm = LLM(model=str(tmp_path), **{**ENGINE, "max_model_len": served_len})
    try:
        cfg = llm.engine.model_config
        rs = cfg.rope_scaling
        assert (cfg.rotary_dim, rs.kind, rs.original_max_position_embeddings) == (12, "longrope", 32)
        assert rs.freq_factors == tuple(rope["long_factor" if extended else "short_factor"])
        attention = 1.0 if checkpoint_len == 32 else math.sqrt(1 + math.log(4) / math.log(32))
        assert rs.attention_factor == pytest.approx(attention)
        assert_parity(llm, model, [PROMPTS[0], PROMPTS[2]] if extended else [PROMPTS[0]], 40 if extended else 20)
        if checkpoint_len != served_len:  # the loader's modules too (what a GPU's runner, built after them, runs)
            import jax.numpy as jnp
            from flax import nnx

            from infire_jax.loaders.load import load_placed
            from infire_jax.loaders.weights import rotating_as

            placed = rotating_as(load_placed(str(tmp_path), jnp.float32, None), rs)
            assert nnx.merge(placed.graphdef, placed.state).cfg.rope_scaling == rs
    finally:
        llm.engine.close()


def test_phi3_refuses_rotations_its_factors_do_not_fit():
    base = {**TEXT, "model_type": "phi3"}
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor=0.2 must rotate an even number"):
        config_from_hf({**base, "partial_rotary_factor": 0.2})
    longrope = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    assert config_from_hf({**base, "rope_scaling": longrope}).rope_scaling.kind == "longrope"
    with pytest.raises(UnsupportedModelError, match="factors have 8 entries; the 12 rotated dimensions have 6"):
        config_from_hf({**base, "partial_rotary_factor": 0.75, "rope_scaling": longrope})
    with pytest.raises(UnsupportedModelError, match="long_factor must be a list of positive numbers"):
        config_from_hf({**base, "rope_scaling": {**longrope, "long_factor": [0.0] * 8}})


def test_broken_configs_are_refused_naming_the_field(mistral3, tmp_path):
    """A field the parser needs and lacks, or has of the wrong type, an activation the MLP is not, a
    config.json that is not JSON, head counts the weights do not have: UnsupportedModelError naming it,
    not a KeyError from inside a parser or a reshape's ValueError."""
    import json
    import shutil

    missing = {k: v for k, v in TEXT.items() if k != "num_attention_heads"}
    with pytest.raises(UnsupportedModelError, match="mistral config has no field 'num_attention_heads'"):
        config_from_hf(missing)
    with pytest.raises(UnsupportedModelError, match="no field 'factor'"):
        config_from_hf({**TEXT, "model_type": "llama", "rope_scaling": {"rope_type": "llama3"}})
    with pytest.raises(UnsupportedModelError, match="wrong type"):
        config_from_hf({**TEXT, "num_hidden_layers": "three"})
    with pytest.raises(UnsupportedModelError, match="deepseek_v3 config has no field"):
        config_from_hf({**TEXT, "model_type": "deepseek_v3"})
    for act in ("gelu", "relu"):  # transformers would run them; the SwiGLU MLP would not
        with pytest.raises(UnsupportedModelError, match=f"hidden_act='{act}'"):
            config_from_hf({**TEXT, "model_type": "qwen3", "hidden_act": act})
    assert config_from_hf({**TEXT, "hidden_act": "swish"}).num_layers == 3  # silu's other name

    _, path = mistral3
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(config)[:40])
    with pytest.raises(UnsupportedModelError, match="config.json is not valid JSON"):
        LLM(model=str(broken), **ENGINE)
    config["text_config"]["num_key_value_heads"] = 4  # the weights hold 2
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="does not fit the config's 4 attention heads, 4 KV heads"):
        LLM(model=str(broken), **ENGINE)


def test_qwen3_with_yarn_matches_transformers(tmp_path):
    """Qwen2.5's and Qwen3's long-context setting: YaRN over the Llama-family layers (its blended
    frequencies and transformers' attention factor on cos and sin), past the original context."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    text = {k: v for k, v in TEXT.items() if k not in ("model_type", "sliding_window")}
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    torch.manual_seed(2)
    config = Qwen3Config(**{**text, "max_position_embeddings": 128}, rope_parameters=rope, pad_token_id=0,
                         eos_token_id=2, bos_token_id=1, initializer_range=0.3)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    _save(model, tmp_path)
    llm = LLM(model=str(tmp_path), **ENGINE)
    try:
        rs = llm.engine.model_config.rope_scaling
        assert (rs.kind, rs.factor, rs.original_max_position_embeddings) == ("yarn", 4.0, 32)
        assert_parity(llm, model, [PROMPTS[1], PROMPTS[2]], 40)  # to position 80: past the original 32
    finally:
        llm.engine.close()
