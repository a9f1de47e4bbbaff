"""A published 8-bit checkpoint of GLM-4.5, MiniMax-M2, Llama 4, Gemma 3 or Qwen3.5 placed with its layer
weights kept.

`weights_quantization="checkpoint"` on a `glm4_moe`, `minimax_m2`, `llama4`, `gemma3` or `qwen3_5` (and
Qwen3-Next) checkpoint whose `quantization_config` is fp8 with square `weight_block_size` blocks
(MiniMax-M2's and Qwen3.5's releases: 128) or an 8-bit scheme with a scale per output channel or tensor
(llm-compressor's FP8 and FP8-dynamic, as GLM-4.5's and Llama 4 Maverick's FP8 releases and Gemma 3's
FP8-dynamic ones are; AutoFP8; int8 W8A8; loaders/hf_quantized.py). The projections it quantizes and
the family's `linear_targets` names (q/k/v, o, the DeltaNets' projections, the dense and shared MLPs,
every routed expert) stay 8-bit on the device, in the form `--weights-quantization fp8` keeps a float
model in (quant/resident.py): the values as published and a float32 scale per output channel, or, for
fp8 blocks, per output channel and block of inputs (each block's scale repeated on its rows and, on
o_proj where a block spans heads, on each head's piece; loaders/llama_quant.py `block_form`); any other
quantized module is dequantized. The parts take the float weights' own path into the model's layout:
the family's converter moves output axes only, so it is run once over the values (with the tensors
left alone) and once over the scales. What the checkpoint leaves unquantized (the embedding, LM head,
norms, biases, routers, and whatever its ignore list names, as Maverick's attention) stays as the float
loader gives it. Refused, naming the tensor or weight: other schemes (GPTQ / AWQ load dequantized), a
stacked weight only partly quantized, blocks that do not tile a weight's inputs, and a mesh whose shards
would split a block.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import numpy as np

from infire_jax.errors import ConfigError, UnsupportedModelError
from infire_jax.loaders import deepseek_hf, gemma3_hf, llama4_hf, qwen3_5_hf
from infire_jax.loaders.deepseek_quant import check_whole, kept_scheme
from infire_jax.loaders.fused_parts import place_parts
from infire_jax.loaders.hf import checkpoint_tensors, read_hf_config
from infire_jax.loaders.hf_quantized import GQA_EXPERT_KINDS, QuantScheme, dequantize_module, grouped, not_float8
from infire_jax.loaders.llama_quant import block_form, channel_form, check_mesh
from infire_jax.loaders.tokenizer import Tokenizer
from infire_jax.loaders.weights import LoadedModel, Placed
from infire_jax.models.config import ModelConfig
from infire_jax.quant.resident import QuantLayout
from sharding.plan import ShardPlan


def _glm4_weights(tensors, cfg: ModelConfig) -> dict[str, np.ndarray]:
    return deepseek_hf.deepseek_weights(tensors, cfg, False)


# model_type -> (HF tensors -> our stacked weights, an HF linear module -> the stacked weights it is part of)
FAMILIES: dict[str, tuple[Callable, Callable]] = {
    "glm4_moe": (_glm4_weights, deepseek_hf.linear_targets), "minimax_m2": (_glm4_weights, deepseek_hf.linear_targets),
    "llama4": (llama4_hf.llama4_weights, llama4_hf.linear_targets),
    "llama4_text": (llama4_hf.llama4_weights, llama4_hf.linear_targets),
    "gemma3": (gemma3_hf.gemma3_weights, gemma3_hf.linear_targets),
    "gemma3_text": (gemma3_hf.gemma3_weights, gemma3_hf.linear_targets),
    **{t: (qwen3_5_hf.qwen3_5_weights, qwen3_5_hf.linear_targets)
       for t in ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")}}


def keeps(path: str | None) -> bool:
    """Whether `path` is an HF directory of a checkpoint of one of `FAMILIES`."""
    if not (path and os.path.isfile(os.path.join(path, "config.json"))):
        return False
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f).get("model_type") in FAMILIES


def _kept_form(name: str, w: dict[str, np.ndarray], short: str, scheme: QuantScheme, cfg: ModelConfig
               ) -> tuple[np.ndarray, np.ndarray, QuantLayout]:
    """A quantized module's values and float32 scales in HF's `[out, in / group]` layout, and its layout;
    o_proj's one scale a row repeated for each head's piece (the model keeps it `[Hq, D, E]`)."""
    parts, layout = (channel_form if scheme.kind == "channel" else block_form)(name, w, short, scheme, cfg)
    scale = parts["scale"]
    if short == "wo" and not layout.group:
        scale = np.repeat(scale, cfg.num_heads, axis=1)
    return parts[layout.kind], scale, layout


def load_kept(path: str) -> tuple[LoadedModel, dict[str, QuantLayout]]:
    """The model with each kept stacked weight as parts ("moe_layers.wqkv.fp8", "moe_layers.wqkv.scale") in
    the model's layout, and their layouts by name in the stack; every other weight as the float loader
    gives it."""
    scheme = kept_scheme(path)
    cfg = read_hf_config(path)
    with open(os.path.join(path, "config.json")) as f:
        convert, linear_targets = FAMILIES[json.load(f)["model_type"]]
    if scheme.kind not in GQA_EXPERT_KINDS:
        raise ConfigError(f"weights_quantization='checkpoint' keeps fp8 and 8-bit weights of {cfg.architecture} "
                          f"checkpoints, not {scheme.kind}; load without weights_quantization to dequantize it")
    plain, values, scales, kept, layouts = [], [], [], {}, {}
    for name, w in grouped(checkpoint_tensors(path), scheme):
        targets = linear_targets(name, cfg) if isinstance(w, dict) else ()
        if not targets:  # a tensor the scheme leaves alone, or a quantized one outside the layers
            plain.append((f"{name}.weight", dequantize_module(name, w, scheme)) if isinstance(w, dict)
                         else (name, not_float8(name, w)))
            continue
        short = targets[0].rpartition(".")[2]
        v, s, layout = _kept_form(name, w, short, scheme, cfg)
        if layouts.setdefault(short, layout) != layout:
            raise UnsupportedModelError(f"{name}: kept as {layout}, but other tensors of {short} as {layouts[short]}; "
                                        "load without weights_quantization to dequantize it")
        values.append((f"{name}.weight", v))
        scales.append((f"{name}.weight", s))
        kept.update((t, name) for t in targets)
    check_whole(plain, kept, linear_targets, cfg)
    weights = convert(plain + values, cfg)
    parts = convert(scales, cfg)
    for t in sorted(kept):
        short = t.rpartition(".")[2]
        weights[f"{t}.{layouts[short].kind}"] = weights.pop(t)
        weights[f"{t}.scale"] = parts[t]
    float_ones = sorted(k for k in weights if k.count(".") == 1 and k.rpartition(".")[2] in layouts)
    if float_ones:  # one stack's weight kept, the other's not: a layout is by name in the stack
        raise UnsupportedModelError(f"{float_ones[0]} is not quantized but the other stack's "
                                    f"{float_ones[0].rpartition('.')[2]} is; load without weights_quantization "
                                    "to dequantize it")
    loaded = LoadedModel(config=cfg, tokenizer=Tokenizer.from_dir(path), name=os.path.basename(os.path.normpath(path)),
                         weights=weights)
    return loaded, layouts


def load_kept_placed(path: str, dtype, plan: ShardPlan | None) -> Placed:
    """The checkpoint placed with its 8-bit layer weights kept (see the module doc)."""
    loaded, layouts = load_kept(path)
    if plan is not None:
        check_mesh(layouts, loaded.config, plan)
    return place_parts(loaded, dict(loaded.weights), layouts, dtype, plan)
