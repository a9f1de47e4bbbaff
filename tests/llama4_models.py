"""Tiny random HF Llama 4 checkpoints, saved as transformers saves them.

Both interleave dense and MoE layers, have a NoPE layer (global, temperature-tuned with floor_scale 8,
so the scale changes every 8 positions) beside RoPE layers attending within 16-token chunks, so a
prompt and 48 generated tokens cross several chunks:
- `causal`: a `Llama4ForCausalLM` (`llama4_text`), 5 layers (two dense + MoE super-layers and a
  dense layer left over), NoPE on a dense layer, qk L2 norm, llama3 rope scaling, top-1 routing;
- `multimodal`: a `Llama4ForConditionalGeneration` (`llama4`: text weights under `language_model.`
  beside a one-layer vision tower), 6 layers (three super-layers: on 2 pipeline stages, 1 and a
  padding one, then 2), NoPE on a MoE layer and on a dense one of the last super-layer, no qk norm,
  top-2 routing. Its reference is its `.language_model` (transformers' text-only forward of the wrapper fails).
The LM head is scaled up (`SHARPEN`) so that greedy decoding has no near-ties between float32 engines.
`image_checkpoint` is the multimodal one with a two-layer tower of 56-pixel tiles and a tokenizer that
knows the image placeholder's tokens, for images through the engine (test_vision.py, test_vision_mesh.py,
test_fleet_images.py).
"""

from __future__ import annotations

import numpy as np

from deepseek_models import VOCAB, _save_tokenizer
from infire_jax.vision import prompt

SHARPEN = 4.0
# 8 query and 2 kv heads, widths divisible by 8: tp 2 and 8 fit (kv heads repeated for tp 8).
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
               num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_local_experts=8,
               interleave_moe_layer_step=2, attention_chunk_size=16, attn_temperature_tuning=True, floor_scale=8,
               attn_scale=0.1, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
               bos_token_id=256, eos_token_id=257, pad_token_id=0, tie_word_embeddings=False)
TEXT_CONFIGS = {
    "causal": dict(_COMMON, num_hidden_layers=5, no_rope_layers=[1, 1, 0, 1, 1], use_qk_norm=True,
                   num_experts_per_tok=1,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 32}),
    "multimodal": dict(_COMMON, num_hidden_layers=6, no_rope_layers=[1, 0, 1, 1, 0, 1], use_qk_norm=False,
                       num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
_VISION = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, image_size=28,
               patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)


def hf_model(name: str, **overrides):
    """The HF model in float32, its LM head sharpened; `overrides` change fields of the text config."""
    import torch
    from transformers import Llama4Config, Llama4ForCausalLM, Llama4ForConditionalGeneration, Llama4TextConfig

    torch.manual_seed(0)
    text = {**TEXT_CONFIGS[name], **overrides}
    if name == "multimodal":
        model = Llama4ForConditionalGeneration(Llama4Config(text_config=text, vision_config=_VISION))
        head = model.language_model.lm_head
    else:
        model = Llama4ForCausalLM(Llama4TextConfig(**text))
        head = model.lm_head
    model = model.to(torch.float32).eval()
    with torch.no_grad():
        head.weight.mul_(SHARPEN)
    return model


# Token ids of the placeholder's special tokens in the tiny vocabulary (tests/deepseek_models.py's 320):
# <|patch|> is the config's image_token_index.
SPECIAL = {prompt.PATCH: 300, prompt.START: 301, prompt.END: 302, prompt.TILE_X: 303, prompt.TILE_Y: 304,
           prompt.IMAGE: 305}
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def image_checkpoint(path) -> tuple[object, str]:
    """A tiny random Llama4ForConditionalGeneration (the multimodal text config, a two-layer tower of
    56-pixel tiles: 4 tokens a tile), its LM head sharpened against near-ties, saved to `path` as
    transformers saves it with the image tokens named: (the HF model, its directory)."""
    import torch
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    torch.manual_seed(2)
    vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                  patch_size=14, vision_output_dim=48, projector_input_dim=48, projector_output_dim=48)
    model = Llama4ForConditionalGeneration(Llama4Config(text_config=TEXT_CONFIGS["multimodal"], vision_config=vision,
                                                        image_token_index=SPECIAL[prompt.PATCH])).eval()
    with torch.no_grad():
        model.language_model.lm_head.weight.mul_(SHARPEN)
    path = save(model, path)
    _name_special_tokens(path)
    return model, path


def _name_special_tokens(path: str) -> None:
    """The byte-level tokenizer's placeholder tokens 300..305 renamed to the image markers and made
    special, so that text with the markers tokenizes to those ids (as Llama 4's tokenizer does)."""
    import json

    from tokenizers import AddedToken, Tokenizer

    file = f"{path}/tokenizer.json"
    with open(file) as f:
        data = json.load(f)
    vocab = data["model"]["vocab"]
    for text, i in SPECIAL.items():
        vocab[text] = vocab.pop(f"<|extra_{i}|>")
    with open(file, "w") as f:
        json.dump(data, f)
    tk = Tokenizer.from_file(file)
    tk.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in SPECIAL])
    assert all(tk.token_to_id(text) == i for text, i in SPECIAL.items())
    tk.save(file)
    with open(f"{path}/tokenizer_config.json", "w") as f:  # a chat template: the messages' contents in a row
        json.dump({"chat_template": CHAT_TEMPLATE}, f)


def text_model(model):
    """The text-only reference: a Llama4ForCausalLM holding the checkpoint's text weights."""
    return getattr(model, "language_model", model)


def save(model, path) -> str:
    """Writes the checkpoint as transformers lays it out, with a byte-level tokenizer."""
    import pathlib

    model.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(pathlib.Path(path))
    return str(path)


def quantize_like_int8(model) -> None:
    """The text weights in place as `weights_quantization="int8"` keeps them (quant/resident.py): symmetric
    int8, one float32 scale (absmax / 127) per output channel and, for o_proj, per head (its input
    axis is each head's), round to nearest; dequantized back to float32. The router, norms,
    embedding and head stay as they are."""
    import numpy as np
    import torch

    def channel(w: np.ndarray, axis: int) -> np.ndarray:
        scale = np.abs(w).max(axis=axis, keepdims=True) / 127
        scale = np.where(scale == 0, 1, scale).astype(np.float32)
        return (np.clip(np.rint(w / scale), -127, 127).astype(np.int8).astype(np.float32) * scale).astype(np.float32)

    text = text_model(model).model
    heads = text.config.num_attention_heads
    with torch.no_grad():
        for name, p in text.named_parameters():
            w = p.detach().numpy()
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                              "up_proj.weight", "down_proj.weight")):
                q = channel(w, 1)  # [out, in]
            elif name.endswith("o_proj.weight"):
                q = channel(w.reshape(w.shape[0], heads, -1), 2).reshape(w.shape)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                q = channel(w, 1)  # [X, in, out]
            else:
                continue
            p.copy_(torch.from_numpy(q))


def quantize_like_int4(model, group: int) -> None:
    """The text weights in place as `weights_quantization="int4"` keeps them (quant/int4_rtn.py):
    AutoGPTQ's asymmetric round to nearest per output channel in groups of `group` inputs in HF's input
    order (tests/quant_reference.py), dequantized back to float32. Router, norms, embedding and head
    stay as they are."""
    import torch

    from quant_reference import reference_rtn

    def rtn(w: np.ndarray) -> np.ndarray:  # [out, in]
        q, zero, scale = reference_rtn(w, group)
        return ((q - zero) * scale.astype(np.float64)).astype(np.float32)

    text = text_model(model).model
    with torch.no_grad():
        for name, p in text.named_parameters():
            w = p.detach().numpy()
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                              "gate_proj.weight", "up_proj.weight", "down_proj.weight")):
                q = rtn(w)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [X, in, out]
                q = np.stack([rtn(e.T).T for e in w])
            else:
                continue
            p.copy_(torch.from_numpy(np.ascontiguousarray(q)))


def fp8_kv(model, kv_scales, monkeypatch) -> None:
    """Makes the text model attend to its keys and values as an fp8 pool holds them (quant_reference.py
    `attend_to_e4m3`). `kv_scales` [L, 2, Hkv]: the engine's calibrated [k_scale, v_scale]."""
    from transformers.models.llama4 import modeling_llama4

    from quant_reference import attend_to_e4m3

    attend_to_e4m3(modeling_llama4, text_model(model).config, kv_scales, monkeypatch)
