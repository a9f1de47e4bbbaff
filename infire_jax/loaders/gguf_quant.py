"""A GGUF model placed with its Q4_1 / Q8_0 layer weights kept in block form on the devices.

`weights_quantization="gguf"`: q/k/v, o, gate/up and down stay as GGUF's quants and fp16 scales
(quant/gguf_blocks.py), rearranged only along the output axes into the model's fused layout, and
are dequantized per layer inside the scan (quant/resident.py). The embedding, LM head and norms
are dequantized at load as usual. A fused group (q/k/v, gate/up) stays quantized only if all its
tensors in every layer share one supported type; anything else is dequantized, so any GGUF loads.
Checkpoints of the placed weights are bypassed: the GGUF file is the compact form.
`place_quantized_at_load` serves `weights_quantization="int8"`, `"fp8"` and `"int4"` (any
Llama-family model, quantized at load by quant/resident.py `quantize_channels` or, round to nearest
in a GPTQ / AWQ checkpoint's kept form, quant/int4_rtn.py `quantize_int4`) and a `dummy:` model's
drawn "int8" / "fp8" / "int4" parts; the GGUF's kept blocks, 8-bit rows and int4 groups (at load or
a checkpoint's, loaders/llama_quant.py) are placed alike (loaders/fused_parts.py). loaders/load.py
picks the loader for each mode.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf.quants import dequantize

from infire_jax.errors import ConfigError, UnsupportedModelError
from infire_jax.loaders.fused_parts import FUSED, place_parts
from infire_jax.loaders.gguf import (_BLOCK, _LAYER_MAP, _PERMUTED_QK, PlainGGUFReader, _config, read_metadata,
                                     unpermute_qk)
from infire_jax.loaders.llama_quant import check_mesh
from infire_jax.loaders.paths import DEFAULT_MODEL_NAME, default_model_path
from infire_jax.loaders.weights import LoadedModel, Placed, from_hf_layout, stack_layers
from infire_jax.models.config import ModelConfig
from infire_jax.models.registry import abstract_model, build_state
from infire_jax.quant.gguf_blocks import BLOCK_BYTES, QK, split_blocks
from infire_jax.quant.grouped import GroupedLayout
from infire_jax.quant.int4_rtn import DEFAULT_INT4_GROUP, layouts_at_load, quantize_int4
from infire_jax.quant.resident import CHANNEL_VALUES, QuantLayout, quantize_channels
from infire_jax.loaders.tokenizer import tokenizer_from_gguf
from sharding.plan import ShardPlan


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
    reader = PlainGGUFReader(path)
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
                laid = from_hf_layout(short, unpermute(short, a), cfg)
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


def dummy_layouts(cfg, mode: str, int4_group: int = DEFAULT_INT4_GROUP) -> dict:
    """A `dummy:` model's quantized weights and their layouts under `weights_quantization=mode`, what
    `build_state` (or `models.registry.abstract_state`, for shapes alone) takes: a DeepSeek-V3-family
    one's routed experts in Kimi K2's int4 (groups of 32, bfloat16 scales); another's quantizable layer
    weights, every stack's, as a float model's are quantized at load: int8 or fp8 per output channel, or
    int4 in the AWQ / GPTQ form in groups of `int4_group` inputs (quant/int4_rtn.py `layouts_at_load`)."""
    if cfg.mla is not None and mode == "int4":
        return {f"moe_layers.{w}": GroupedLayout("int4", 32, jnp.bfloat16) for w in ("w_gate_up", "w_down")}
    if cfg.mla is not None:
        raise ConfigError(f"weights_quantization={mode!r} covers Llama-architecture models; a DeepSeek-V3-family "
                          "dummy draws its routed experts in int4")
    state = nnx.state(abstract_model(cfg, jnp.float32), nnx.Param)
    return layouts_at_load({".".join(map(str, p)): v.shape for p, v in nnx.to_flat_state(state) if len(p) == 2},
                           mode, int4_group)


def load_gguf_placed(spec: str | None, dtype, plan: ShardPlan | None) -> Placed:
    """A GGUF file (the default model's when `spec` is None) placed with its kept blocks."""
    path = spec or default_model_path()
    if not (os.path.isfile(path) and path.endswith(".gguf")):
        raise ConfigError(f"weights_quantization='gguf' keeps a GGUF file's quants: model {path!r} is not a "
                          ".gguf file")
    loaded, layouts = load_gguf_quantized(path)
    if spec is None:
        loaded.name = DEFAULT_MODEL_NAME
    return place_parts(loaded, dict(loaded.weights), layouts, dtype, plan)


def place_quantized_at_load(loaded: LoadedModel, mode: str, dtype, plan: ShardPlan | None,
                            int4_group: int = DEFAULT_INT4_GROUP) -> Placed:
    """`loaded` placed with its layer weights quantized at load: "int8" and "fp8" quantize a model's
    float layer weights per output channel, "int4" in groups of `int4_group` inputs with zero points (the
    GPTQ / AWQ kept form; the mesh must split no group); a `dummy:` model's parts are drawn on the
    device(s) ("int4": AWQ / GPTQ form, Kimi K2's for a DeepSeek-V3-family one's routed experts)."""
    if loaded.weights is None:  # dummy: random parts drawn on the device(s), as its float weights are
        layouts = dummy_layouts(loaded.config, mode, int4_group)
        graphdef, state = build_state(loaded.config, None, dtype, plan=plan, quantized=layouts)
        return Placed(loaded, graphdef, state, "quantized weights: checkpoints bypassed")
    if loaded.config.mla is not None:
        raise ConfigError(f"weights_quantization={mode!r} covers Llama-architecture models; the DeepSeek-V3 "
                          "family keeps a published quantized checkpoint's weights with 'checkpoint'")
    if mode in CHANNEL_VALUES:
        weights, layouts = quantize_channels(loaded.weights, mode)
        return place_parts(loaded, weights, layouts, dtype, plan)
    try:
        weights, layouts = quantize_int4(loaded.weights, int4_group)
    except ValueError as e:
        raise ConfigError(f"weights_quantization='int4': {e} (weights_quantization 'int8', or none, loads "
                          "any shape)") from e
    if plan is not None:
        check_mesh(layouts, loaded.config, plan)
    return place_parts(loaded, weights, layouts, dtype, plan)
