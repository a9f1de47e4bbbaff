"""Tiny random HF checkpoints of the DeepSeek-V3 family, saved as transformers saves them.

Both have MLA with a low-rank q, YaRN rope, a dense first layer, grouped routed experts with a
random score-correction bias, and a shared expert. `kimi-k2.5` is Kimi K2.5's layout: a
`kimi_k25` config wrapping the text model's, weights under `language_model.`. `quantize_checkpoint`
rewrites one in a published quantized layout: DeepSeek-V3's fp8 (every linear weight but the
router's and the embedding's, block scales) or Kimi K2's compressed-tensors int4 (routed experts).
"""

from __future__ import annotations

import functools
import json
import os
import pathlib

VOCAB = 320  # divisible by 8: the vocabulary splits over tp=8


def _save_tokenizer(path) -> None:
    """Byte-level BPE over the 256 byte symbols plus placeholder tokens, VOCAB in all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({f"<|extra_{i}|>": i for i in range(len(vocab), VOCAB)})
    tk = Tokenizer(models.BPE(vocab, [], fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.save(str(path / "tokenizer.json"))


# 8 heads and widths divisible by 8, so tp=8 fits.
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
               num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1, kv_lora_rank=32, q_lora_rank=48,
               qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, num_experts_per_tok=2,
               first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-6,
               initializer_range=0.1, bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)
TEXT_CONFIGS = {
    # DeepSeek-V3's shape of routing (8 groups of 32, 4 kept): 4 groups of 2, 2 kept. mscale differs from
    # mscale_all_dim so that both YaRN factors (cos/sin and softmax scale) are exercised.
    "deepseek-v3": dict(_COMMON, n_routed_experts=8, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
                                         "mscale": 1.0, "mscale_all_dim": 0.8}),
    # Kimi K2's: one group (no group limit), scaling 2.827, YaRN with beta_fast = beta_slow = 1.
    # A 16-wide rope key, so the Pallas decode kernel can tile it (the parity test runs it).
    "kimi-k2.5": dict(_COMMON, qk_rope_head_dim=16, n_routed_experts=12, n_group=1, topk_group=1,
                      routed_scaling_factor=2.827,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
                                       "original_max_position_embeddings": 64, "beta_fast": 1.0, "beta_slow": 1.0,
                                       "mscale": 1.0, "mscale_all_dim": 1.0}),
}


def hf_model(name: str, **overrides):
    """The HF model in float32 with a random score-correction bias (HF initialises it to zero);
    `overrides` change fields of the text config."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**TEXT_CONFIGS[name], **overrides})).to(torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.2)
    return model


def save(name: str, model, path) -> str:
    """Writes the checkpoint (and a byte-level tokenizer) as the published model lays it out."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(pathlib.Path(path))
    if name == "kimi-k2.5":
        file = os.path.join(path, "model.safetensors")
        tensors = {f"language_model.{k}": v for k, v in load_file(file).items()}
        save_file(tensors, file)
        with open(os.path.join(path, "config.json")) as f:
            text = json.load(f)
        text["model_type"] = "kimi_k2"
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
                       "text_config": text, "tie_word_embeddings": False}, f)
    return str(path)


def hf_greedy(hf, prompt: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    """HF's greedy tokens after `prompt` (no eos) and each one's float64 log-probability."""
    import torch

    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    want = ref.sequences[0, len(prompt):].tolist()
    return want, [torch.log_softmax(step[0].double(), -1)[tok].item() for step, tok in zip(ref.logits, want)]


def quantization_config(scheme: str, size: int) -> dict:
    """config.json's `quantization_config`: fp8 with size x size blocks, or int4 groups of `size`."""
    if scheme == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [size, size]}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": size}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"]}


def _quantized(scheme: str, name: str, w) -> bool:
    """DeepSeek-V3's fp8 tensors: every linear weight but the router's and the embedding's; Kimi
    K2's int4 tensors: the routed experts."""
    if scheme == "fp8":
        return w.ndim == 2 and name.endswith(("proj.weight", "kv_a_proj_with_mqa.weight"))
    return ".mlp.experts." in name and name.endswith(".weight")


def quantize_checkpoint(path: str, scheme: str, size: int, which=None) -> dict:
    """Rewrites the float checkpoint at `path` in the published quantized layout (fp8 blocks or int4
    groups of `size`) of the tensors `which(name, array)` picks (default: DeepSeek-V3's and Kimi K2's);
    returns the float64 weights the quantized tensors define, by name."""
    import ml_dtypes
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from infire_jax.quant.formats import quantize_fp8_block, quantize_int4_group
    from quant_reference import fp8_block, int4_pack_quantized

    file = os.path.join(path, "model.safetensors")
    tensors, defined, out = load_file(file), {}, {}
    for name, t in tensors.items():
        w = t.numpy()
        module = name.removesuffix(".weight")
        if not (which or functools.partial(_quantized, scheme))(name, w):
            out[name] = t
        elif scheme == "fp8":
            q = quantize_fp8_block(w, size)
            raw = np.asarray(q.weight)
            out[name] = torch.from_numpy(raw.view(np.uint8).copy()).view(torch.float8_e4m3fn)
            out[f"{module}.weight_scale_inv"] = torch.from_numpy(np.array(q.weight_scale_inv))
            defined[name] = fp8_block(raw.view(np.uint8), np.asarray(q.weight_scale_inv), size)
        else:
            q = quantize_int4_group(w, size, ml_dtypes.bfloat16)
            packed, scale = np.asarray(q.weight_packed), np.asarray(q.weight_scale)
            out[f"{module}.weight_packed"] = torch.from_numpy(packed.copy())
            out[f"{module}.weight_scale"] = torch.from_numpy(scale.view(np.uint16).copy()).view(torch.bfloat16)
            out[f"{module}.weight_shape"] = torch.tensor(w.shape, dtype=torch.int64)
            defined[name] = int4_pack_quantized(packed, scale.astype(np.float32), w.shape, size)
    save_file(out, file)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    (config["text_config"] if "text_config" in config else config)["quantization_config"] = \
        quantization_config(scheme, size)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return defined
