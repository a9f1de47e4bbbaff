"""`dummy:<name>`: random weights of a real model configuration, drawn on the device, for benchmarks."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from infire_jax.errors import ModelNotFoundError
from infire_jax.loaders.weights import LoadedModel
from infire_jax.models.config import ModelConfig
from infire_jax.models.hf_config import config_from_hf

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# Llama 4's text model: every 4th layer NoPE (global, temperature-tuned), the others RoPE within 8192-token
# chunks with q/k L2-normed (Scout; Maverick does not norm them); one routed expert a token plus a shared one.
_LLAMA4_TEXT = dict(
    model_type="llama4_text", vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
    num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128, hidden_act="silu",
    rms_norm_eps=1e-5, rope_theta=500000.0, attention_chunk_size=8192, no_rope_layers=[1, 1, 1, 0] * 12,
    attn_temperature_tuning=4, floor_scale=8192, attn_scale=0.1, num_experts_per_tok=1, attention_bias=False,
    tie_word_embeddings=False, bos_token_id=200000, eos_token_id=[200001, 200007, 200008], pad_token_id=200018)

# Llama 4's vision tower, the same in Scout and Maverick (a 336-pixel tile: 144 <|patch|> tokens).
_LLAMA4_VISION = dict(
    hidden_size=1408, num_hidden_layers=34, num_attention_heads=16, intermediate_size=5632, image_size=336,
    patch_size=14, pixel_shuffle_ratio=0.5, projector_input_dim=4096, projector_output_dim=4096,
    vision_output_dim=4096, rope_theta=10000.0, norm_eps=1e-5, hidden_act="gelu", num_channels=3,
    multi_modal_projector_bias=False, vision_feature_layer=-1, vision_feature_select_strategy="default")
# The image tokens of Llama 4's tokenizer that the config does not name, at ids of the dummy vocabulary.
_LLAMA4_IMAGE_TOKENS = {"<|tile_x_separator|>": 200084, "<|tile_y_separator|>": 200085, "<|image|>": 200090}

# gpt-oss (models/gpt_oss.py): windowed (128) and full layers alternating, 4 experts a token; the two sizes
# differ only in their depth and experts. Their `layer_types` (sliding first, then alternating) is the
# parser's default, left out so that `,layers=N` keeps it whole.
_GPT_OSS = dict(
    model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, head_dim=64,
    num_attention_heads=64, num_key_value_heads=8, sliding_window=128, num_experts_per_tok=4, hidden_act="silu",
    rms_norm_eps=1e-5, max_position_embeddings=131072, attention_bias=True, swiglu_limit=7.0,
    tie_word_embeddings=False, eos_token_id=200002, pad_token_id=199999, rope_theta=150000,
    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 4096},
    # the experts in MXFP4, as published (`infire-jax plan` counts them so; dummy weights are drawn plain)
    quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})

# Gemma 3's language models (models/gemma3.py): five windowed layers to one global, the published text
# configs' fields (the others are Gemma3TextConfig's defaults: sliding_window_pattern 6, RoPE bases 1e6
# and 1e4); 4b and up scale the global layers' RoPE linearly by 8.
_GEMMA3 = dict(model_type="gemma3_text", vocab_size=262208, head_dim=256, query_pre_attn_scalar=256,
               sliding_window=1024, max_position_embeddings=131072, rope_scaling={"rope_type": "linear", "factor": 8.0},
               rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=[1, 106])

# Gemma 4's language models (models/gemma4.py): five windowed layers (head_dim 256) to one full layer
# (head_dim 512, keys and values from one projection), soft-capped logits; the 26B-A4B adds a MoE block
# (128 experts, top 8) beside each layer's dense MLP. From public copies of the published configs.
_GEMMA4 = dict(model_type="gemma4_text", vocab_size=262144, head_dim=256, global_head_dim=512, sliding_window=1024,
               max_position_embeddings=262144, final_logit_softcapping=30.0, attention_k_eq_v=True,
               hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False, rms_norm_eps=1e-6,
               hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 106],
               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                   "rope_theta": 1000000.0}})

# GLM-4.5 (models/glm4_moe.py): GQA rotating half of each head, DeepSeek-V3's MoE with one shared expert
# after the first dense layer(s); Air without q/k norms. Their multi-token-prediction layer is not served.
_GLM45 = dict(model_type="glm4_moe", vocab_size=151552, head_dim=128, num_attention_heads=96, num_key_value_heads=8,
              partial_rotary_factor=0.5, attention_bias=True, rope_theta=1000000, rms_norm_eps=1e-5,
              max_position_embeddings=131072, num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1,
              norm_topk_prob=True, tie_word_embeddings=False, eos_token_id=[151329, 151336, 151338],
              num_nextn_predict_layers=1)

# Qwen3.5 (models/qwen3_5.py): three Gated DeltaNet layers to one gated attention layer, the published
# 27b's and 35b-a3b's text configs (the MoE's: 256 experts, top 8, and a shared expert).
_QWEN3_5 = dict(model_type="qwen3_5_text", vocab_size=248320, head_dim=256, linear_num_key_heads=16,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=248044,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                 "mrope_interleaved": True, "mrope_section": [11, 11, 10]})

# The published HF config.json values of each model (only the fields we read).
CONFIGS: dict[str, dict] = {
    "llama-3.1-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}, max_position_embeddings=131072, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
    "llama-3.2-1b": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}, max_position_embeddings=131072, tie_word_embeddings=True,
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
    "qwen3-0.6b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645),
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, bos_token_id=151643, eos_token_id=151645),
    # Qwen3-235B-A22B (and its FP8 release's shapes): 94 MoE layers of 128 experts, 8 a token
    "qwen3-235b-a22b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
        num_attention_heads=64, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=1536, norm_topk_prob=True, bos_token_id=151643, eos_token_id=151645),
    "mixtral-8x7b": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=False, num_local_experts=8, num_experts_per_tok=2,
        bos_token_id=1, eos_token_id=2),
    # The DeepSeek-V3 family (models/deepseek.py): MLA, 1 shared + 256 / 384 routed experts, grouped routing.
    "deepseek-v3": dict(
        model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4,
        num_experts_per_tok=8, moe_layer_freq=1, first_k_dense_replace=3, norm_topk_prob=True,
        scoring_func="sigmoid", hidden_act="silu", max_position_embeddings=163840, rms_norm_eps=1e-6,
        rope_theta=10000, rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                        "type": "yarn"},
        attention_bias=False, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1),
    # Kimi K2.5: its text model is Kimi K2 (DeepSeek-V3 with 384 experts, 64 heads, no group limit).
    "kimi-k2.5": dict(
        model_type="kimi_k25", tie_word_embeddings=False, bos_token_id=163584, eos_token_id=163585,
        text_config=dict(
            model_type="kimi_k2", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
            moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
            n_shared_experts=1, n_routed_experts=384, routed_scaling_factor=2.827, kv_lora_rank=512,
            q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc",
            n_group=1, topk_group=1, num_experts_per_tok=8, moe_layer_freq=1, first_k_dense_replace=1,
            norm_topk_prob=True, scoring_func="sigmoid", hidden_act="silu", max_position_embeddings=262144,
            rms_norm_eps=1e-6, rope_theta=50000.0,
            rope_scaling={"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                          "original_max_position_embeddings": 4096, "type": "yarn"},
            attention_bias=False, tie_word_embeddings=False, bos_token_id=163584, eos_token_id=163585)),
    # Llama 4 (models/llama4.py) with its vision tower (vision/), the published multimodal configs.
    "llama-4-scout": dict(
        model_type="llama4", tie_word_embeddings=False, boi_token_index=200080, eoi_token_index=200081,
        image_token_index=200092, vision_config=_LLAMA4_VISION,
        text_config=dict(_LLAMA4_TEXT, num_local_experts=16, interleave_moe_layer_step=1, moe_layers=list(range(48)),
                         use_qk_norm=True, max_position_embeddings=10485760,
                         rope_scaling={"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 1.0, "original_max_position_embeddings": 8192})),
    "llama-4-maverick": dict(
        model_type="llama4", tie_word_embeddings=False, boi_token_index=200080, eoi_token_index=200081,
        image_token_index=200092, vision_config=_LLAMA4_VISION,
        text_config=dict(_LLAMA4_TEXT, num_local_experts=128, interleave_moe_layer_step=2,
                         moe_layers=list(range(1, 48, 2)), use_qk_norm=False, max_position_embeddings=1048576,
                         rope_scaling=None)),
    "gemma-3-1b": dict(_GEMMA3, vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                       num_attention_heads=4, num_key_value_heads=1, sliding_window=512, rope_scaling=None,
                       max_position_embeddings=32768),
    "gemma-3-4b": dict(_GEMMA3, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                       num_attention_heads=8, num_key_value_heads=4),
    "gemma-3-12b": dict(_GEMMA3, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                        num_attention_heads=16, num_key_value_heads=8),
    "qwen3.5-0.8b": dict(_QWEN3_5, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                         num_attention_heads=8, num_key_value_heads=2, linear_num_value_heads=16,
                         tie_word_embeddings=True),
    "qwen3.5-27b": dict(_QWEN3_5, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48),
    "qwen3.5-35b-a3b": dict(_QWEN3_5, model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
                            num_attention_heads=16, num_key_value_heads=2, linear_num_value_heads=32,
                            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512),
    "gemma-3-27b": dict(_GEMMA3, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                        num_attention_heads=32, num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168),
    "gemma-4-31b": dict(_GEMMA4, hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
                        num_attention_heads=32, num_key_value_heads=16, num_global_key_value_heads=4),
    "gemma-4-26b-a4b": dict(_GEMMA4, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                            num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2,
                            enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704),
    "glm-4.5-air": dict(_GLM45, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                        num_hidden_layers=46, n_routed_experts=128, first_k_dense_replace=1, use_qk_norm=False,
                        routed_scaling_factor=1.0),
    "glm-4.5": dict(_GLM45, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=92,
                    n_routed_experts=160, first_k_dense_replace=3, use_qk_norm=True, routed_scaling_factor=2.5),
    # MiniMax-M2 (models/glm4_moe.py): q/k normed over all heads, half of each head rotated, 8 of 256 experts.
    "minimax-m2": dict(model_type="minimax_m2", vocab_size=200064, hidden_size=3072, intermediate_size=1536,
                       num_hidden_layers=62, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
                       rotary_dim=64, num_local_experts=256, num_experts_per_tok=8, rope_theta=5000000,
                       rms_norm_eps=1e-6, max_position_embeddings=196608, use_qk_norm=True, qk_norm_type="per_layer",
                       scoring_func="sigmoid", use_routing_bias=True, tie_word_embeddings=False,
                       bos_token_id=200034, eos_token_id=200020,
                       # published in fp8 only (drawn plain; `--weights-quantization checkpoint` draws the blocks)
                       quantization_config=dict(quant_method="fp8", fmt="float8_e4m3fn", activation_scheme="dynamic",
                                                weight_block_size=[128, 128],
                                                modules_to_not_convert=["gate", "e_score_correction_bias", "lm_head"])),
    "gpt-oss-20b": dict(_GPT_OSS, num_hidden_layers=24, num_local_experts=32),
    "gpt-oss-120b": dict(_GPT_OSS, num_hidden_layers=36, num_local_experts=128),
}

_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def dummy_tokenizer(cfg: ModelConfig, hf: dict | None = None):
    """Byte-level tokenizer spanning the model's vocabulary: bytes first, then placeholder tokens; a
    multimodal Llama 4 config's image tokens (`hf`) as special tokens at their ids."""
    from infire_jax.loaders.tokenizer import Tokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for i in range(len(vocab), cfg.vocab_size):
        vocab[f"<|dummy_{i}|>"] = i
    special = image_tokens(hf) if hf else {}
    for token, i in special.items():
        del vocab[f"<|dummy_{i}|>"]
        vocab[token] = i
    tk = HFTokenizer(models.BPE(vocab, [], fuse_unk=False))
    tk.add_special_tokens(list(special))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
    return Tokenizer(tk, bos_token=None, eos_token=f"<|dummy_{eos}|>" if eos else None, chat_template=_CHATML)


def image_tokens(hf: dict) -> dict[str, int]:
    """A Llama 4 config's image tokens by id (vision/prompt.py's strings); none without a vision tower."""
    if not hf.get("vision_config"):
        return {}
    return {"<|image_start|>": hf["boi_token_index"], "<|image_end|>": hf["eoi_token_index"],
            "<|patch|>": hf["image_token_index"], **_LLAMA4_IMAGE_TOKENS}


def dummy_hf_config(spec: str) -> dict:
    """The HF config.json of `spec` (a name of CONFIGS, optionally with `,layers=N`)."""
    name = spec.partition(",")[0]
    if name not in CONFIGS:
        raise ModelNotFoundError(f"unknown dummy model {name!r}; known: {sorted(CONFIGS)}")
    return with_layers(CONFIGS[name], spec) if "," in spec else CONFIGS[name]


def spec_hf_config(spec: str | None) -> dict | None:
    """The HF config.json of a model spec: a `dummy:` model's published one, an HF directory's; None for any
    other spec (a GGUF file, the default model)."""
    if spec and spec.startswith("dummy:"):
        return dummy_hf_config(spec[len("dummy:"):])
    if not (spec and os.path.isfile(os.path.join(spec, "config.json"))):
        return None
    with open(os.path.join(spec, "config.json")) as f:
        return json.load(f)


def with_layers(hf: dict, spec: str) -> dict:
    """`hf` with `num_hidden_layers` (a multimodal config's text model's) set from `spec`'s `,layers=N`
    suffix: a few layers of a large model, e.g. one dense and one MoE layer of Kimi K2.5 on one GPU."""
    _, _, override = spec.partition(",")
    key, _, value = override.partition("=")
    if key != "layers" or not value.isdigit() or int(value) < 1:
        raise ModelNotFoundError(f"dummy model suffix {override!r}: expected ',layers=N' with N >= 1")
    if "text_config" in hf:
        return {**hf, "text_config": with_layers(hf["text_config"], spec)}
    return {**hf, "num_hidden_layers": int(value)}


def load_dummy(spec: str, seed: int = 0) -> LoadedModel:
    """`spec`: a name of CONFIGS, optionally with `,layers=N` (`dummy:kimi-k2.5,layers=2`)."""
    hf = dummy_hf_config(spec)
    cfg = config_from_hf(hf)
    return LoadedModel(config=cfg, tokenizer=dummy_tokenizer(cfg, hf), name=f"dummy:{spec}", weights=None,
                       random_seed=seed)
