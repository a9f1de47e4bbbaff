"""Tiny random HF checkpoints of the DeepSeek-V3 family, saved as transformers saves them.

Both have MLA with a low-rank q, YaRN rope, a dense first layer, grouped routed experts with a
random score-correction bias, and a shared expert. `kimi-k2.5` is Kimi K2.5's layout: a
`kimi_k25` config wrapping the text model's, weights under `language_model.`.
"""

from __future__ import annotations

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


def hf_model(name: str):
    """The HF model in float32 with a random score-correction bias (HF initialises it to zero)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**TEXT_CONFIGS[name])).to(torch.float32).eval()
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
