"""Loaders and tokenizer: GGUF vs HF's own reading of the same file, the native cache, dummy configs, CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from infire_jax.loaders.load import load_model
from infire_jax.loaders.dummy import CONFIGS, load_dummy
from infire_jax.loaders.weights import load_native, save_native
from infire_jax.models.hf_config import config_from_hf

TEXTS = ["Hello world 12345", "  leading spaces\n\nnewlines\ttabs", "naïve café 😀 日本語のテキスト",
         "<|im_start|>user\nhi<|im_end|>", "x=3.14159; y = [1,2,3] # comment", "I'm sure they'll've done it",
         "2024-11-21T10:00:00Z", "".join(chr(c) for c in range(0x20, 0x250, 3))]


@pytest.fixture(scope="module")
def smol():
    return load_model(None)


@pytest.fixture(scope="module")
def hf_tokenizer(default_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(default_gguf), gguf_file=os.path.basename(default_gguf))


def test_gguf_tokenizer_matches_hf(smol, hf_tokenizer):
    for text in TEXTS:
        ids = smol.tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert smol.tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_chat_template_matches_hf(smol, hf_tokenizer):
    convs = [
        [{"role": "user", "content": "hi there"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    ]
    for conv in convs:
        for gen in (True, False):
            ours = smol.tokenizer.apply_chat_template(conv, add_generation_prompt=gen)
            assert ours == hf_tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)


def test_gguf_weights_equal_hf_weights(smol, hf_smol):
    """Dequantized and un-permuted GGUF tensors equal what HF loads from the same file."""
    cfg = smol.config
    e, h, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    sd = {k: v.numpy() for k, v in hf_smol.state_dict().items()}
    w = smol.weights
    np.testing.assert_array_equal(w["embed"], sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(w["final_norm"], sd["model.norm.weight"])
    for i in (0, 17, cfg.num_layers - 1):
        p = f"model.layers.{i}."
        g = h // kv  # wqkv [E, Hkv, G + 2, D]: kv head j's G query heads, then its k and v
        wqkv = w["layers.wqkv"][i]
        q = sd[p + "self_attn.q_proj.weight"].reshape(h, d, e).transpose(2, 0, 1)
        np.testing.assert_array_equal(wqkv[:, :, :g].reshape(e, h, d), q)
        np.testing.assert_array_equal(wqkv[:, :, g], sd[p + "self_attn.k_proj.weight"].reshape(kv, d, e).transpose(2, 0, 1))
        np.testing.assert_array_equal(wqkv[:, :, g + 1], sd[p + "self_attn.v_proj.weight"].reshape(kv, d, e).transpose(2, 0, 1))
        np.testing.assert_array_equal(w["layers.wo"][i], sd[p + "self_attn.o_proj.weight"].reshape(e, h, d).transpose(1, 2, 0))
        np.testing.assert_array_equal(w["layers.w_gate_up"][i][:, 0], sd[p + "mlp.gate_proj.weight"].T)
        np.testing.assert_array_equal(w["layers.w_gate_up"][i][:, 1], sd[p + "mlp.up_proj.weight"].T)
        np.testing.assert_array_equal(w["layers.w_down"][i], sd[p + "mlp.down_proj.weight"].T)
        np.testing.assert_array_equal(w["layers.attn_norm"][i], sd[p + "input_layernorm.weight"])
        np.testing.assert_array_equal(w["layers.mlp_norm"][i], sd[p + "post_attention_layernorm.weight"])



def test_gguf_reader_slices_a_plain_view_of_the_mapped_file(default_gguf):
    """`PlainGGUFReader` hands gguf's reader a plain ndarray view of its memory map (memmap slices run
    Python code, 3x slower on a tokenizer's ~250k metadata values): no copy, the same fields."""
    from infire_jax.loaders.gguf import PlainGGUFReader, read_metadata

    reader = PlainGGUFReader(default_gguf)
    assert type(reader.data) is np.ndarray and isinstance(reader.data.base, np.memmap)
    t = reader.tensors[0]
    assert type(t.data) is np.ndarray and np.shares_memory(t.data, reader.data)
    meta = read_metadata(reader)
    assert len(meta["tokenizer.ggml.tokens"]) == 49152 and meta["general.architecture"] == "llama"

def test_native_form_round_trips(smol, tmp_path):
    path = str(tmp_path / "native")
    save_native(smol, path)
    again = load_native(path)
    assert again.config == smol.config and again.name == smol.name
    assert set(again.weights) == set(smol.weights)
    for k in smol.weights:
        np.testing.assert_array_equal(again.weights[k], smol.weights[k])
    assert again.tokenizer.encode(TEXTS[2]) == smol.tokenizer.encode(TEXTS[2])
    assert again.tokenizer.chat_template == smol.tokenizer.chat_template
    assert load_model(path).config == smol.config  # a native directory is a model spec too


def test_dummy_configs_have_published_sizes():
    published = {"llama-3.1-8b": 8_030_261_248, "llama-3.2-1b": 1_235_814_400, "qwen3-0.6b": 596_049_920,
                 "smollm2-135m": 134_515_008}
    for name, count in published.items():
        assert config_from_hf(CONFIGS[name]).param_count() == count


def test_dummy_model_shapes_without_allocating():
    from flax import nnx

    import jax.numpy as jnp
    from infire_jax.models.registry import abstract_model

    m = load_dummy("llama-3.1-8b")
    state = nnx.state(abstract_model(m.config, jnp.bfloat16))
    total = sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(state))
    assert total == m.config.param_count()
    assert m.tokenizer.vocab_size == m.config.vocab_size
    assert m.tokenizer.decode(m.tokenizer.encode("dummy text")) == "dummy text"


def test_large_dummy_weights_are_drawn_a_chunk_at_a_time(monkeypatch):
    """A one-device draw of a large weight keeps one chunk's temporaries (a whole draw of 4 layers of
    Llama 4 Scout's stacked experts needs 86 GB of them, more than any GPU holds); chunked draws keep
    the normal draw's spread and are the same on every call."""
    import jax
    import jax.numpy as jnp

    from infire_jax.models import registry

    scout_experts = (4, 16, 5120, 16384)  # layers, experts, hidden, 2 x expert width (gate_up)
    assert registry.draw_chunks(int(np.prod(scout_experts))) == 20  # 5 x 2^30 elements in chunks of 2^28
    program = registry.weight_draw(scout_experts, jnp.bfloat16, "normal", None, None, 20)
    memory = program.lower(np.uint32(0), np.uint32(0)).compile().memory_analysis()
    assert memory.output_size_in_bytes == 2 * np.prod(scout_experts)
    assert memory.temp_size_in_bytes < 8e9, memory.temp_size_in_bytes  # one chunk: ~24 bytes an element
    monkeypatch.setattr(registry, "DRAW_CHUNK_ELEMENTS", 1000)
    assert registry.draw_chunks(3 * 800) == 3 and registry.draw_chunks(1009) == 1  # a prime: drawn whole
    w = np.asarray(registry.weight_draw((4, 600), jnp.float32, "normal", None, None, 3)(0, 5))
    again = np.asarray(registry.weight_draw((4, 600), jnp.float32, "normal", None, None, 3)(0, 5))
    np.testing.assert_array_equal(w, again)
    chunks = w.reshape(3, 800)
    assert not np.allclose(chunks[0], chunks[1]) and abs(w.std() - 0.02) < 0.002 and abs(w.mean()) < 0.002
    bits = np.asarray(registry.weight_draw((4, 600), jnp.int8, "int8", None, None, 1)(0, 6))
    assert bits.min() >= -127 and len(np.unique(bits)) > 200 and jax.numpy.dtype(bits.dtype) == jnp.int8


def _cli(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    small = ["--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--max-model-len", "512"]
    return subprocess.run([sys.executable, "-m", "infire_jax", *args, *small], input=stdin, capture_output=True,
                          text=True, timeout=600)


def test_cli_generate_and_chat():
    gen = _cli("generate", "The capital of France is", "--max-tokens", "8")
    assert gen.returncode == 0, gen.stderr
    assert "Paris" in gen.stdout
    chat = _cli("chat", "--max-tokens", "24", stdin="What is the capital of France?\n/exit\n")
    assert chat.returncode == 0, chat.stderr
    assert "Paris" in chat.stdout


def test_cli_reports_bad_model_clearly(tmp_path):
    res = _cli("generate", "hi", "--model", str(tmp_path / "missing.gguf"))
    assert res.returncode == 2
    assert "error:" in res.stderr and "not found" in res.stderr
