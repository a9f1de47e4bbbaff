"""Tiny random Llama / Qwen2 / Mixtral / Qwen3-MoE checkpoints in the 8-bit schemes with a scale per output channel, per
tensor or per block (loaders/hf_quantized.py's module doc lists them), and each one's float twin.

Written from the schemes' definitions, independent of infire_jax: the weights are quantized here
(absmax to the format's largest value, per row, block or tensor), stored as each scheme stores them
(the scale's shape, name and dtype, the activation tensors beside), and the twin holds `float64(q) *
scale` element by element, in float32.
"""

from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np

from deepseek_models import VOCAB, _save_tokenizer
from gptq_awq_models import CONFIG, FAMILIES, LINEARS

FUSED_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
FP8, INT8 = ml_dtypes.float8_e4m3fn, np.int8


def _compressed(values: str, strategy: str, activations: dict | None) -> dict:
    weights = dict(num_bits=8, type=values, symmetric=True, strategy=strategy, dynamic=False, group_size=None)
    group = dict(targets=["Linear"], weights=weights, input_activations=activations, output_activations=None)
    return dict(quant_method="compressed-tensors", format=f"{values}-quantized", ignore=["lm_head"],
                config_groups={"group_0": group}, quantization_status="compressed")


DYNAMIC = dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)


def _compressed_blocks(block: int) -> dict:
    """llm-compressor's FP8_BLOCK: fp8 weights in `block` x `block` blocks, activations in dynamic groups."""
    config = _compressed("float", "block", dict(DYNAMIC, strategy="group", group_size=block))
    config["config_groups"]["group_0"]["weights"]["block_structure"] = [block, block]
    return config

# fp8 blocks (Qwen3's FP8 releases: 128): 64 here, so that a block of o_proj's inputs spans two heads of 32
BLOCK = 64
FP8_BLOCKS = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[BLOCK, BLOCK])
# name: (quantization_config, values, scale per "channel", "tensor" or "block", scale's stored shape and
#        dtype, activation tensors written beside each weight, family)
CASES = {
    "fp8-dynamic": (_compressed("float", "channel", DYNAMIC), FP8, "channel", "[O, 1]", ml_dtypes.bfloat16, {},
                    "llama"),
    "fp8-static": (_compressed("float", "tensor", dict(DYNAMIC, strategy="tensor", dynamic=False)), FP8, "tensor",
                   "[1]", np.float32, {"input_scale": np.ones(1, np.float32)}, "qwen2"),
    "autofp8": (dict(quant_method="fp8", activation_scheme="static"), FP8, "tensor", "[]", np.float32,
                {"input_scale": np.ones((), np.float32)}, "llama"),
    "fbgemm-fp8": (dict(quant_method="fbgemm_fp8", activation_scale_ub=1200.0, modules_to_not_convert=["lm_head"]),
                   FP8, "channel", "[O, 1]", np.float32, {"input_scale_ub": np.full(1, 1200.0, np.float32)}, "llama"),
    "w8a8-int8": (_compressed("int", "channel", dict(DYNAMIC, type="int")), INT8, "channel", "[O]", np.float16, {},
                  "llama"),
    "fp8-block": (FP8_BLOCKS, FP8, "block", "[O / B, I / B]", np.float32, {}, "qwen2"),
    "fp8-block-compressed": (_compressed_blocks(BLOCK), FP8, "block", "[O / B, I / B]", ml_dtypes.bfloat16, {},
                             "llama"),
    "fp8-block-moe": (FP8_BLOCKS, FP8, "block", "[O / B, I / B]", np.float32, {}, "mixtral"),
    "fp8-block-qwen3-moe": (FP8_BLOCKS, FP8, "block", "[O / B, I / B]", np.float32, {}, "qwen3_moe"),
}
# The MoE families' MLP: 4 experts (2 a token) of the dense MLP's shapes, each expert's gate, up and down
# quantized (Mixtral's w1, w3, w2), a float router; Qwen3-MoE's q / k norms are float as well.
EXPERTS = 4
MOE = {"mixtral": (dict(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=EXPERTS,
                        num_experts_per_tok=2), "block_sparse_moe",
                   {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
       "qwen3_moe": (dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=EXPERTS,
                          num_experts_per_tok=2, moe_intermediate_size=CONFIG["intermediate_size"], norm_topk_prob=True,
                          head_dim=CONFIG["hidden_size"] // CONFIG["num_attention_heads"]), "mlp",
                     {p: p for p in ("gate_proj", "up_proj", "down_proj")})}


def _quantize(w: np.ndarray, values, strategy: str, scale_dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`w [O, I]` as 8-bit values, the stored scale (per row [O, 1], per block [O / B, I / B], or one),
    and each weight's scale in float64 [O, I]: absmax to the format's top."""
    top = 448.0 if values is FP8 else 127.0
    o, i = w.shape
    if strategy == "block":
        amax = np.abs(w).reshape(o // BLOCK, BLOCK, i // BLOCK, BLOCK).max(axis=(1, 3))
    else:
        amax = np.abs(w).max(axis=1, keepdims=True) if strategy == "channel" else np.abs(w).max()
    scale = np.asarray(amax / top).astype(scale_dtype)
    wide = scale.astype(np.float64)
    if strategy == "block":
        wide = np.repeat(np.repeat(wide, BLOCK, axis=0), BLOCK, axis=1)
    each = np.broadcast_to(wide, w.shape)
    x = w / each
    q = x.astype(FP8) if values is FP8 else np.clip(np.rint(x), -127, 127).astype(INT8)
    return q, scale, each


def _stored(scale: np.ndarray, form: str, out: int) -> np.ndarray:
    shapes = {"[O, 1]": (out, 1), "[O]": (out,), "[1]": (1,), "[]": (), "[O / B, I / B]": scale.shape}
    return scale.reshape(shapes[form])


def write_checkpoints(base: pathlib.Path, name: str, seed: int = 0) -> tuple[str, str]:
    """The quantized checkpoint `name` and its float twin (the weights the scheme defines, in float32)."""
    from safetensors.numpy import save_file

    config, values, strategy, form, scale_dtype, activations, family = CASES[name]
    rng = np.random.default_rng(seed)
    e = CONFIG["hidden_size"]
    common = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, e)).astype(np.float32),
              "lm_head.weight": (rng.standard_normal((VOCAB, e)) * 0.1).astype(np.float32),
              "model.norm.weight": (1 + 0.1 * rng.standard_normal(e)).astype(np.float32)}
    quantized, twin = dict(common), dict(common)
    for layer in range(CONFIG["num_hidden_layers"]):
        pre = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            quantized[f"{pre}.{norm}.weight"] = twin[f"{pre}.{norm}.weight"] = \
                (1 + 0.1 * rng.standard_normal(e)).astype(np.float32)
        linears = LINEARS
        if family in MOE:
            _, block, names = MOE[family]
            linears = {m: shape for m, shape in LINEARS.items() if m.startswith("self_attn.")}
            linears |= {f"{block}.experts.{j}.{w}": LINEARS[f"mlp.{proj}"] for j in range(EXPERTS)
                        for w, proj in names.items()}
            quantized[f"{pre}.{block}.gate.weight"] = twin[f"{pre}.{block}.gate.weight"] = \
                rng.standard_normal((EXPERTS, e)).astype(np.float32)
        if family == "qwen3_moe":
            for norm in ("q_norm", "k_norm"):
                quantized[f"{pre}.self_attn.{norm}.weight"] = twin[f"{pre}.self_attn.{norm}.weight"] = \
                    (1 + 0.1 * rng.standard_normal(MOE[family][0]["head_dim"])).astype(np.float32)
        for module, (out, inp) in linears.items():
            q, scale, each = _quantize(rng.standard_normal((out, inp)) / np.sqrt(inp), values, strategy, scale_dtype)
            quantized[f"{pre}.{module}.weight"] = q
            # DeepSeek-V3's name for a block scale; compressed-tensors names every scale `weight_scale`
            scale_name = "weight_scale_inv" if strategy == "block" and config["quant_method"] == "fp8" else \
                "weight_scale"
            quantized[f"{pre}.{module}.{scale_name}"] = _stored(scale, form, out)
            quantized.update({f"{pre}.{module}.{k}": v for k, v in activations.items()})
            # the definition, element by element in float64: each weight times its row's, block's or the
            # tensor's scale
            twin[f"{pre}.{module}.weight"] = (q.astype(np.float64) * each).astype(np.float32)
            if family == "qwen2" and module in FUSED_QKV:
                quantized[f"{pre}.{module}.bias"] = twin[f"{pre}.{module}.bias"] = \
                    (0.1 * rng.standard_normal(out)).astype(np.float32)
    paths = []
    for label, tensors, quant in (("", quantized, config), ("-float", twin, None)):
        path = base / f"{name}{label}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "model.safetensors"))
        hf = dict(CONFIG, **(MOE[family][0] if family in MOE else FAMILIES[family]), torch_dtype="float32")
        if quant is not None:
            hf["quantization_config"] = quant
        (path / "config.json").write_text(json.dumps(hf))
        _save_tokenizer(path)
        paths.append(str(path))
    return paths[0], paths[1]


