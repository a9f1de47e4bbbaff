"""A published 8-bit checkpoint of GLM-4.5, MiniMax-M2, Llama 4, Gemma 3 / 4 or Qwen3.5 placed with its layer
weights kept.

`weights_quantization="checkpoint"` on a `glm4_moe`, `minimax_m2`, `llama4`, `gemma3`, `gemma4` or `qwen3_5`
(and Qwen3-Next) checkpoint whose `quantization_config` is fp8 with square `weight_block_size` blocks
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
import re
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import numpy as np

from infire_jax.errors import ConfigError, UnsupportedModelError
from infire_jax.loaders import deepseek_hf, gemma3_hf, gemma4_hf, llama4_hf, qwen3_5_hf
from infire_jax.loaders.deepseek_quant import check_whole, kept_scheme
from infire_jax.loaders.dummy import load_dummy, spec_hf_config
from infire_jax.loaders.fused_parts import place_parts
from infire_jax.loaders.hf import checkpoint_tensors, read_hf_config
from infire_jax.loaders.hf_quantized import (
    GQA_EXPERT_KINDS, QuantScheme, dequantize_module, grouped, hf_skips, not_float8, quant_scheme, quantization_config)
from infire_jax.loaders.llama_quant import block_form, channel_form, check_mesh
from infire_jax.loaders.tokenizer import Tokenizer
from infire_jax.loaders.weights import LoadedModel, Placed
from infire_jax.models.config import ModelConfig
from infire_jax.models.hf_config import config_from_hf
from infire_jax.models.registry import build_state
from infire_jax.quant.gptq_awq import kept_group
from infire_jax.quant.resident import INPUT_AXIS, QuantLayout
from sharding.plan import ShardPlan


def _glm4_weights(tensors, cfg: ModelConfig) -> dict[str, np.ndarray]:
    return deepseek_hf.deepseek_weights(tensors, cfg, False)


def _gemma4_scales(tensors, cfg: ModelConfig) -> dict[str, np.ndarray]:
    return gemma4_hf.gemma4_weights(tensors, cfg, parts=True)


# model_type -> (HF tensors -> our stacked weights, an HF linear module -> the stacked weights it is part of,
# and the scales' converter where it is not the weights')
FAMILIES: dict[str, tuple[Callable, ...]] = {
    "glm4_moe": (_glm4_weights, deepseek_hf.linear_targets), "minimax_m2": (_glm4_weights, deepseek_hf.linear_targets),
    "llama4": (llama4_hf.llama4_weights, llama4_hf.linear_targets),
    "llama4_text": (llama4_hf.llama4_weights, llama4_hf.linear_targets),
    "gemma3": (gemma3_hf.gemma3_weights, gemma3_hf.linear_targets),
    "gemma3_text": (gemma3_hf.gemma3_weights, gemma3_hf.linear_targets),
    **{t: (qwen3_5_hf.qwen3_5_weights, qwen3_5_hf.linear_targets)
       for t in ("qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")},
    **{t: (gemma4_hf.gemma4_weights, gemma4_hf.linear_targets, _gemma4_scales) for t in ("gemma4", "gemma4_text")}}


def keeps(spec: str | None) -> bool:
    """Whether `spec` is a checkpoint of one of `FAMILIES` (an HF directory), or a `dummy:` one whose
    published config is quantized (MiniMax-M2's fp8 blocks: its parts are drawn so)."""
    hf = spec_hf_config(spec)
    if hf is None or hf.get("model_type") not in FAMILIES:
        return False
    return not spec.startswith("dummy:") or bool(quantization_config(hf))


def layouts(scheme: QuantScheme, quantization: Mapping[str, Any], cfg: ModelConfig) -> dict[str, QuantLayout]:
    """The kept projections' layouts by name in their stack (every family's names: one a model lacks is never
    looked up) for an 8-bit `scheme`: fp8 or int8 values and a float32 scale per output channel, or for fp8
    blocks per output channel and block of inputs (wo's within a head). The attention's are left out where
    the config's ignore list keeps it unquantized, as Llama 4 Maverick's FP8 release does."""
    shorts = tuple(INPUT_AXIS)
    if attention_ignored(quantization):
        shorts = tuple(s for s in shorts if s not in ("wqkv", "wo", "wq", "wk", "wv"))
    if scheme.kind == "channel":
        kind = "int8" if scheme.values == np.int8 else "fp8"
        return {short: QuantLayout(kind) for short in shorts}
    return {short: QuantLayout("fp8", kept_group(scheme.block, cfg.head_dim if short == "wo" else None), jnp.float32)
            for short in shorts}


def attention_ignored(q: Mapping[str, Any]) -> bool:
    """Whether a quantization config leaves the attention's projections unquantized: its `ignore`
    (compressed-tensors: names, or "re:" patterns) or `modules_to_not_convert` (transformers' patterns)
    covers them."""
    patterns = list(q.get("ignore") or []) + list(q.get("modules_to_not_convert") or [])
    probes = [f"{top}model.layers.0.self_attn.{m}" for top in ("", "language_model.") for m in ("q_proj", "o_proj")]
    return any(re.match(p[3:], m) if p.startswith("re:") else hf_skips(m, [p]) for p in patterns for m in probes)


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
        convert, linear_targets, *scale_convert = FAMILIES[json.load(f)["model_type"]]
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
    parts = (scale_convert[0] if scale_convert else convert)(scales, cfg)
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


def load_kept_placed(spec: str, dtype, plan: ShardPlan | None) -> Placed:
    """The checkpoint placed with its 8-bit layer weights kept (see the module doc); a `dummy:` model's
    drawn as its published config's scheme keeps them."""
    if spec.startswith("dummy:"):
        loaded = load_dummy(spec[len("dummy:"):])
        parts = dummy_layouts(spec)
        if plan is not None:
            check_mesh(parts, loaded.config, plan)
        graphdef, state = build_state(loaded.config, None, dtype, plan=plan, seed=loaded.random_seed, quantized=parts)
        return Placed(loaded, graphdef, state, "quantized weights: checkpoints bypassed")
    loaded, parts = load_kept(spec)
    if plan is not None:
        check_mesh(parts, loaded.config, plan)
    return place_parts(loaded, dict(loaded.weights), parts, dtype, plan)


def dummy_layouts(spec: str) -> dict[str, QuantLayout]:
    """A `dummy:` model's kept layouts, from its published config (bench/gpu_target.py builds them too)."""
    hf = spec_hf_config(spec)
    scheme = quant_scheme(hf)
    if scheme is None or scheme.kind not in GQA_EXPERT_KINDS:
        raise ConfigError(f"weights_quantization='checkpoint': {spec}'s published config keeps no 8-bit weights")
    return layouts(scheme, quantization_config(hf), config_from_hf(hf))
