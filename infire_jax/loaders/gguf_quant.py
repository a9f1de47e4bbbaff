"""A GGUF model placed with its Q4_1 / Q8_0 layer weights kept in block form on the devices.

`weights_quantization="gguf"`: q/k/v, o, gate/up and down stay as GGUF's quants and fp16 scales
(quant/gguf_blocks.py), rearranged only along the output axes into the model's fused layout, and
are dequantized per layer inside the scan (quant/resident.py). The embedding, LM head and norms
are dequantized at load as usual. A fused group (q/k/v, gate/up) stays quantized only if all its
tensors in every layer share one supported type; anything else is dequantized, so any GGUF loads.
Checkpoints of the placed weights are bypassed: the GGUF file is the compact form.
`load_quantized_placed` also serves `weights_quantization="int8"` (any model, quantized at load by
quant/resident.py `quantize_int8`), which shares everything after the quantization, and hands
`weights_quantization="checkpoint"` (a published quantized checkpoint's own format) to
loaders/llama_quant.py for a GPTQ / AWQ one, which shares the tail too, and to
loaders/deepseek_quant.py for a DeepSeek-V3-family one's int4 / fp8 weights.
"""

from __future__ import annotations

import math
import os

import jax.numpy as jnp
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from infire_jax.errors import ConfigError, UnsupportedModelError
from infire_jax.loaders.gguf import _BLOCK, _LAYER_MAP, _PERMUTED_QK, _config, read_metadata, unpermute_qk
from infire_jax.loaders.weights import LoadedModel, from_hf_layout, stack_layers
from infire_jax.models.config import ModelConfig
from infire_jax.quant.gguf_blocks import BLOCK_BYTES, QK, split_blocks
from infire_jax.quant.grouped import GroupedLayout
from infire_jax.quant.resident import INPUT_AXIS, QUANTIZATION_MODES, QuantLayout
from infire_jax.tokenizer import tokenizer_from_gguf

# Fused weight -> the GGUF layer weights it is made of.
FUSED = {"wqkv": ("wq", "wk", "wv"), "wo": ("wo",), "w_gate_up": ("w_gate", "w_up"), "w_down": ("w_down",)}


def part_to_layout(short: str, p: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """One part `[out, n]` (n: the input axis in quants or blocks) to the model's layout, as
    `from_hf_layout` moves the weight itself."""
    e, hq, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if short == "wq":
        return p.reshape(hq, d, -1).transpose(2, 0, 1)
    if short in ("wk", "wv"):
        return p.reshape(hkv, d, -1).transpose(2, 0, 1)
    if short == "wo":  # [E, Hq * n'] -> [Hq, n', E]: blocks never cross a head (checked)
        return p.reshape(e, hq, -1).transpose(1, 2, 0)
    return p.T  # w_gate, w_up, w_down


def _kept_types(raw: dict, cfg: ModelConfig) -> dict[str, str]:
    """Fused weight -> its GGUF type, for the fused weights that stay quantized."""
    by_short: dict[str, set[str]] = {}
    for name, t in raw.items():
        m = _BLOCK.fullmatch(name)
        if m and _LAYER_MAP.get(m.group(2)) in {s for group in FUSED.values() for s in group}:
            by_short.setdefault(_LAYER_MAP[m.group(2)], set()).add(t.tensor_type.name)
    kept = {}
    for fused, members in FUSED.items():
        types = set().union(*(by_short.get(s, set()) for s in members))
        if len(types) == 1 and next(iter(types)) in BLOCK_BYTES:
            kept[fused] = next(iter(types))
    if "wo" in kept and cfg.head_dim % QK:
        del kept["wo"]  # a block would span two heads
    return kept


def load_gguf_quantized(path: str) -> tuple[LoadedModel, dict[str, QuantLayout]]:
    """The model with its kept weights as parts ("layers.wqkv.q4_1", ...) and their layouts."""
    reader = GGUFReader(path)
    meta = read_metadata(reader)
    raw = {t.name: t for t in reader.tensors}
    cfg = _config(meta, raw)
    if cfg.is_moe:
        raise UnsupportedModelError("weights_quantization='gguf' covers dense GGUF models")
    raw.pop("rope_freqs.weight", None)
    permuted = meta.get("general.architecture") in _PERMUTED_QK
    kept = _kept_types(raw, cfg)
    kept_short = {s: f for f, group in FUSED.items() if f in kept for s in group}

    def unpermute(short: str, w: np.ndarray) -> np.ndarray:
        if short in ("wq", "bq") and permuted:
            return unpermute_qk(w, cfg.num_heads)
        if short in ("wk", "bk") and permuted:
            return unpermute_qk(w, cfg.num_kv_heads)
        return w

    dense: dict[str, list] = {}
    parts: dict[str, dict[str, list]] = {}
    weights: dict[str, np.ndarray] = {}
    for name, t in sorted(raw.items()):
        m = _BLOCK.fullmatch(name)
        if m is None:
            target = {"token_embd.weight": "embed", "output_norm.weight": "final_norm",
                      "output.weight": "lm_head"}.get(name)
            if target is None:
                raise UnsupportedModelError(f"unexpected GGUF tensor {name!r}")
            weights[target] = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
            continue
        layer, short = int(m.group(1)), _LAYER_MAP.get(m.group(2))
        if short is None:
            raise UnsupportedModelError(f"unexpected GGUF tensor {name!r}")
        if short in kept_short:
            row_len = int(t.shape[0])  # GGUF shapes list the input (row) length first
            for part, a in split_blocks(np.asarray(t.data), t.tensor_type.name, row_len).items():
                laid = part_to_layout(short, unpermute(short, a), cfg)
                parts.setdefault(part, {}).setdefault(short, [None] * cfg.num_layers)[layer] = laid
        else:
            w = unpermute(short, np.asarray(dequantize(t.data, t.tensor_type), np.float32))
            dense.setdefault(short, [None] * cfg.num_layers)[layer] = from_hf_layout(short, w, cfg)
    weights.update(stack_layers(dense, cfg))
    for part, per_layer in parts.items():
        weights.update({f"{k}.{part}": v for k, v in stack_layers(per_layer, cfg).items()})
    layouts = {fused: QuantLayout(kind) for fused, kind in kept.items()}
    model = LoadedModel(config=cfg, weights=weights, tokenizer=tokenizer_from_gguf(meta),
                        name=str(meta.get("general.name") or path))
    return model, layouts


def dummy_layout(mode: str, cfg) -> QuantLayout:
    """A dummy model's quantized layout: int8 per output channel, or int4 in the AWQ / GPTQ form (uint8
    zeros, float16 scales) in groups of 128 inputs, fewer where a weight's input axis (wo's: head_dim)
    is not a multiple of 128. (A DeepSeek-V3-family dummy's int4 is its routed experts, as Kimi K2's.)"""
    if mode == "int8":
        return QuantLayout("int8")
    return QuantLayout("int4", group=math.gcd(128, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim))


def load_quantized_placed(spec: str | None, dtype, plan, mode: str):
    """The model placed with its layer weights kept quantized (`mode`: "gguf" keeps a GGUF file's
    blocks; "int8" quantizes any model's float layer weights at load, per output channel;
    "checkpoint" keeps a quantized HF checkpoint's own format: GPTQ / AWQ int4, DeepSeek-V3's fp8, Kimi's
    int4)."""
    from infire_jax.loaders.checkpoint import Placed
    from infire_jax.loaders.load import DEFAULT_MODEL_NAME, default_model_path, load_model
    from infire_jax.models.registry import build_state
    from infire_jax.quant.resident import quantize_int8
    from sharding.plan import repeat_kv_heads

    if mode not in QUANTIZATION_MODES:
        raise ConfigError(f"unknown weights_quantization {mode!r}; choose from {list(QUANTIZATION_MODES)}")
    if mode == "checkpoint":
        from infire_jax.loaders import llama_quant

        if not llama_quant.is_gptq_awq(spec):
            from infire_jax.loaders.deepseek_quant import load_kept_placed

            return load_kept_placed(spec, dtype, plan)
        loaded, layouts = llama_quant.load_gptq_awq_kept(spec)
        if plan is not None:
            llama_quant.check_mesh(layouts, loaded.config, plan)
        weights = dict(loaded.weights)
    elif mode in ("int8", "int4"):
        loaded = load_model(spec)
        if loaded.config.mla is not None and mode == "int4" and loaded.weights is None:
            # a DeepSeek-V3-family dummy: routed experts in Kimi K2's int4 (groups of 32, bfloat16 scales)
            layouts = {f"moe_layers.{w}": GroupedLayout("int4", 32, jnp.bfloat16) for w in ("w_gate_up", "w_down")}
            graphdef, state = build_state(loaded.config, None, dtype, plan=plan, quantized=layouts)
            return Placed(loaded, graphdef, state, "quantized weights: checkpoints bypassed")
        if loaded.config.mla is not None:
            raise ConfigError(f"weights_quantization={mode!r} covers Llama-architecture models; the DeepSeek-V3 "
                              "family keeps a published quantized checkpoint's weights with 'checkpoint'")
        if loaded.weights is None:  # dummy: random parts drawn on the device(s), as its float weights are
            layouts = {short: dummy_layout(mode, loaded.config) for short in INPUT_AXIS}
            graphdef, state = build_state(loaded.config, None, dtype, plan=plan, quantized=layouts)
            return Placed(loaded, graphdef, state, "quantized weights: checkpoints bypassed")
        if mode == "int4":
            raise ConfigError("weights_quantization='int4' draws random AWQ / GPTQ-form parts for dummy: models; "
                              "a GPTQ / AWQ checkpoint keeps its own int4 weights with 'checkpoint'")
        weights, layouts = quantize_int8(loaded.weights)
    else:
        path = spec or default_model_path()
        if not (os.path.isfile(path) and path.endswith(".gguf")):
            raise ConfigError(f"weights_quantization='gguf' keeps a GGUF file's quants: model {path!r} is not a "
                              ".gguf file")
        loaded, layouts = load_gguf_quantized(path)
        if spec is None:
            loaded.name = DEFAULT_MODEL_NAME
        weights = dict(loaded.weights)
    if plan is not None and plan.kv_repeat > 1:
        for k in [k for k in weights if k.startswith("layers.wqkv.")]:
            weights[k] = repeat_kv_heads(weights[k], plan.kv_repeat)
    graphdef, state = build_state(loaded.config, weights, dtype, plan=plan, quantized=layouts)
    return Placed(loaded, graphdef, state, "quantized weights: checkpoints bypassed")
