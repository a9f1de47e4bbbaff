"""A GPTQ / AWQ, 8-bit or fp8-block checkpoint of a Llama-family model, its layer weights kept.

`weights_quantization="checkpoint"` on a Llama / Qwen / Mistral checkpoint whose
`quantization_config` is an 8-bit scheme (loaders/hf_quantized.py: llm-compressor's FP8 or int8,
AutoFP8, fbgemm_fp8): q/k/v, o, gate/up and down stay 8-bit on the device, fp8 or int8 values with
a float32 scale per output channel (a per-tensor scale repeated on the rows; wo's repeated for
each head, as the model's `[Hq, D, E]` layout keeps one per head), moved into the model's layout as
the float weights are. Or `fp8` with `weight_block_size` (Qwen3's and Qwen2.5's official FP8
releases, DeepSeek-V3's form on a GQA model): the fp8 values as published and a float32 scale per
output channel and block of inputs, each block's scale repeated on its rows (quant/grouped.py's
form) and, for wo where a block spans heads, on each head's piece. With these 8-bit schemes a
Mixtral or Qwen3-MoE checkpoint keeps its experts too, stacked `[X, in, out]` a layer as the float
loader stacks them. Or gptq or awq (dense models): q/k/v, o, gate/up and down stay 4-bit on the
device (quant/gptq_awq.py `kept_parts`: values packed along the input axis, GPTQ's words as they
are and AWQ's output-packed ones unpacked and packed again, with each group's scale and zero point)
and are dequantized one layer at a time inside the layer scan (quant/resident.py). The parts take the
weight's own path into the model's fused layout, along output axes only, as a GGUF file's blocks
do (fused_parts.py). wo's groups are cut at head boundaries (a group's scale and zero repeated on
each piece), so the model's `[Hq, D, E]` layout splits none. With act-order (`desc_act`: a
group is any set of inputs, `g_idx`) each weight keeps its whole zero / scale tables, unsplit
over the devices, and an int16 index of each input's group, split along the inputs as the weight
is (`kept_parts_act_order`); the scan gathers each input's zero and scale with it. Permuting the
inputs instead is no option: q/k/v and gate/up share their input, the hidden state, with
different `g_idx`. Everything else (embedding, LM head, norms, biases, routers) is what the float
loader gives, dequantized at load if quantized. Refused, naming the tensor or weight: a permuted
`g_idx` in a checkpoint whose `desc_act` is not set, a fused weight (or a layer's experts) only
partly quantized, GPTQ / AWQ MoE models, MLA models, and a mesh whose shards would split a group or
a word; all of these load dequantized without `weights_quantization`.
"""

from __future__ import annotations

import json
import math
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from infire_jax.errors import ConfigError, UnsupportedModelError
from infire_jax.loaders.fused_parts import FUSED, place_parts
from infire_jax.loaders.hf import checkpoint_tensors, expert_weight, layer_weight, llama_weights, read_hf_config
from infire_jax.loaders.hf_quantized import GQA_EXPERT_KINDS, QuantScheme, channel_parts, dequantize_module, \
    gqa_kept_scheme, grouped, quant_scheme, unpack_module
from infire_jax.loaders.hf_quantized import kept_parts as block_parts  # gptq_awq has its own kept_parts
from infire_jax.loaders.weights import LoadedModel, Placed, from_hf_layout, stack_layers
from infire_jax.models.config import ModelConfig
from infire_jax.models.registry import abstract_model
from infire_jax.quant.gptq_awq import kept_group, kept_parts, kept_parts_act_order
from infire_jax.quant.resident import INPUT_AXIS, QuantLayout
from infire_jax.loaders.tokenizer import Tokenizer
from sharding.plan import ShardPlan

_FUSED_OF = {short: fused for fused, members in FUSED.items() for short in members}
_DEQUANTIZE = "load without weights_quantization to dequantize it"


def keeps(path: str | None) -> bool:
    """Whether `path` is an HF directory whose quantization_config this module keeps
    (hf_quantized.gqa_kept_scheme)."""
    cfg_path = os.path.join(path or "", "config.json")
    if not os.path.isfile(cfg_path):
        return False
    with open(cfg_path) as f:
        return gqa_kept_scheme(json.load(f)) is not None


def _llama_family(cfg: ModelConfig, scheme: QuantScheme) -> bool:
    """Whether the float loader reads `cfg`'s checkpoint as a Llama (hf.py `llama_weights`), dense or,
    for an 8-bit scheme, with Mixtral's or Qwen3-MoE's experts."""
    others = (cfg.mla, cfg.glm4, cfg.gpt_oss, cfg.llama4, cfg.gemma3, cfg.gemma4, cfg.gated_delta)
    return (not cfg.is_moe or scheme.kind in GQA_EXPERT_KINDS) and all(o is None for o in others)


def load_llama_kept(path: str) -> tuple[LoadedModel, dict[str, QuantLayout]]:
    """The model with each kept fused weight as parts ("layers.wqkv.q4", ".zero", ".scale"; 8-bit:
    "layers.wqkv.fp8" or ".int8", ".scale") in the model's layout, and their layouts; every other
    weight as the float loader gives it."""
    with open(os.path.join(path, "config.json")) as f:
        scheme = quant_scheme(json.load(f))
    cfg = read_hf_config(path)
    if not _llama_family(cfg, scheme):
        what = "Llama-architecture models (and Mixtral / Qwen3-MoE for 8-bit schemes)"
        raise ConfigError(f"weights_quantization='checkpoint' keeps {scheme.kind} weights of {what}, not "
                          f"{cfg.architecture}; {_DEQUANTIZE}")
    plain, parts, kept, formats = [], {}, {}, {}
    form = {"channel": channel_form, "fp8": block_form}.get(scheme.kind, _int4_form)
    for name, w in grouped(checkpoint_tensors(path), scheme):
        where = _kept_weight(f"{name}.weight", cfg) if isinstance(w, dict) else None
        if where is None:  # a plain tensor, or a quantized one outside the layers
            plain.append((f"{name}.weight", dequantize_module(name, w, scheme)) if isinstance(w, dict) else (name, w))
            continue
        layer, expert, short = where
        kept_form, layout = form(name, w, short, scheme, cfg)
        for part, a in kept_form.items():
            laid = _layout(short, part, a, scheme, cfg)
            per_layer = parts.setdefault(part, {}).setdefault(short, [None] * cfg.num_layers)
            if expert is None:
                per_layer[layer] = laid
            else:  # [X, in, out] a layer, as the float loader stacks an expert's weight
                per_layer[layer] = per_layer[layer] or [None] * cfg.num_experts
                per_layer[layer][expert] = laid
        kept[(layer, short)] = name
        formats.setdefault(_FUSED_OF[short], set()).add(layout)
    _check_whole(kept, plain, cfg)
    weights = llama_weights(plain, cfg)
    for part, per_layer in parts.items():
        for short, layers in per_layer.items():
            for i, layer in enumerate(layers):
                if isinstance(layer, list):
                    missing = [j for j, e in enumerate(layer) if e is None]
                    if missing:
                        raise UnsupportedModelError(f"layer {i}: the checkpoint has no {short} of experts {missing}")
                    layers[i] = np.stack(layer)
        weights.update({f"{k}.{part}": v for k, v in stack_layers(per_layer, cfg).items()})
    layouts = {}
    for fused, found in formats.items():
        if len(found) != 1:
            raise UnsupportedModelError(f"layers.{fused}: its tensors are kept in different forms "
                                        f"{sorted(map(str, found))}; {_DEQUANTIZE}")
        layouts[fused] = next(iter(found))
    loaded = LoadedModel(config=cfg, tokenizer=Tokenizer.from_dir(path), name=os.path.basename(os.path.normpath(path)),
                         weights=weights)
    return loaded, layouts


def channel_form(name: str, w: dict[str, np.ndarray], short: str, scheme: QuantScheme, cfg: ModelConfig
                  ) -> tuple[dict[str, np.ndarray], QuantLayout]:
    """An 8-bit module's parts `[O, I]` and `[O, 1]` (float32 scales), and its layout."""
    form = channel_parts(name, w, scheme)
    kind = "fp8" if form.weight.dtype != np.int8 else "int8"
    return {kind: form.weight, "scale": np.asarray(form.weight_scale, np.float32)}, QuantLayout(kind)


def block_form(name: str, w: dict[str, np.ndarray], short: str, scheme: QuantScheme, cfg: ModelConfig
                ) -> tuple[dict[str, np.ndarray], QuantLayout]:
    """A block-scaled fp8 module's values `[O, I]` and float32 scales `[O, I / group]`: each block's scale
    repeated on its rows and, for wo where a block spans heads, on each head's piece."""
    values, scale = block_parts(name, w, scheme)
    if values.shape[1] % scheme.block:
        raise ConfigError(f"{name}: fp8 blocks of {scheme.block} do not tile its {values.shape[1]} inputs; "
                          f"{_DEQUANTIZE}")
    group = kept_group(scheme.block, cfg.head_dim if short == "wo" else None)
    scale = np.repeat(np.asarray(scale, np.float32), scheme.block // group, axis=1)
    return {"fp8": values, "scale": scale}, QuantLayout("fp8", group, jnp.float32)


def _int4_form(name: str, w: dict[str, np.ndarray], short: str, scheme: QuantScheme, cfg: ModelConfig
               ) -> tuple[dict[str, np.ndarray], QuantLayout]:
    """A GPTQ / AWQ module's kept parts in HF's `[O, n]` layout, and its layout (see the module doc)."""
    unpacked = unpack_module(name, w, scheme)
    if unpacked.act_order and not scheme.act_order:
        raise ConfigError(f"{name}.g_idx: its groups are not runs of consecutive inputs but "
                          f"quantization_config.desc_act is not set; {_DEQUANTIZE}")
    if short == "wo" and cfg.head_dim % 8:
        raise ConfigError(f"{name}: head_dim {cfg.head_dim} splits its 8-input words between heads; {_DEQUANTIZE}")
    size = unpacked.q.shape[1] // unpacked.scale.shape[1]
    if scheme.act_order:
        per_group, kept_form = size, kept_parts_act_order(unpacked)
        kept_form["g_idx"] = np.broadcast_to(kept_form["g_idx"], (unpacked.q.shape[0], kept_form["g_idx"].size))
    else:
        per_group = kept_group(size, cfg.head_dim if short == "wo" else None)
        kept_form = kept_parts(unpacked, per_group)
    return kept_form, QuantLayout("int4", per_group, jnp.dtype(unpacked.scale.dtype), scheme.act_order)


def _layout(short: str, part: str, a: np.ndarray, scheme: QuantScheme, cfg: ModelConfig) -> np.ndarray:
    """A kept part `[O, n]` in the model's layout, moved as `from_hf_layout` moves it. An act-order
    g_idx (the same for every output) becomes the weight's layout with its last axis 1, and wo's
    whole zero / scale tables `[E, G]` become `[1, G, E]` (any head's input may be in any group). An
    8-bit wo's scales `[E, 1]` are repeated for each head, `[Hq, 1, E]`."""
    if part == "g_idx":
        return np.ascontiguousarray(from_hf_layout(short, a, cfg)[..., :1])
    if short == "wo" and part == "scale" and scheme.kind == "channel":
        return np.ascontiguousarray(np.broadcast_to(a.T[None], (cfg.num_heads, 1, a.shape[0])))
    if scheme.act_order and short == "wo" and part != "q4":
        return a.T[None]
    return from_hf_layout(short, a, cfg)


def _kept_weight(name: str, cfg: ModelConfig) -> tuple[int, int | None, str] | None:
    """(layer, expert or None, model weight name) of a layer tensor a fused weight is kept from."""
    where = layer_weight(name, cfg)
    if where is not None:
        return (where[0], None, where[1]) if where[1] in _FUSED_OF else None
    return expert_weight(name, cfg)


def _check_whole(kept: dict[tuple[int, str], str], plain: list, cfg: ModelConfig) -> None:
    """UnsupportedModelError naming the tensor if a fused weight is quantized in part only."""
    quantized = {_FUSED_OF[short] for _, short in kept}
    for name, _ in plain:
        where = _kept_weight(name, cfg)
        if where and _FUSED_OF[where[2]] in quantized:
            raise UnsupportedModelError(f"{name} is not quantized but other parts of layers.{_FUSED_OF[where[2]]} "
                                        f"are; a weight is kept quantized whole ({_DEQUANTIZE})")


def check_mesh(layouts: dict[str, QuantLayout], cfg: ModelConfig, plan: ShardPlan) -> None:
    """ConfigError naming the weight if the mesh would split one of its groups across devices."""
    flat = nnx.to_flat_state(nnx.state(abstract_model(cfg, jnp.float32), nnx.Param))
    shapes = {".".join(map(str, p)): (tuple(v.shape), v.axes) for p, v in flat}
    for fused, layout in layouts.items():
        if layout.kind != "int4" and not layout.group:  # 8-bit values split anywhere, their scales with the outputs
            continue
        for name in [n for n in shapes if n.count(".") == 1 and n.partition(".")[2] == fused]:  # every stack's
            shape, axes = shapes[name]
            axis = len(shape) + INPUT_AXIS[fused]
            groups = shape[axis] // layout.group
            entry = plan.spec(axes)[axis]
            mesh_axes = entry if isinstance(entry, tuple) else (entry,) if entry else ()
            shards = math.prod(plan.sizes[a] for a in mesh_axes)
            split_groups = groups > 1 and groups % shards and not layout.act_order  # act-order: whole tables
            if split_groups or (layout.kind == "int4" and (shape[axis] // 8) % shards):
                raise ConfigError(f"{name}: its {groups} {layout.kind} groups of {layout.group} inputs cannot be split "
                                  f"{shards} ways over {'x'.join(mesh_axes)}; use a mesh that splits it less, or "
                                  f"{_DEQUANTIZE}")


def load_kept_placed(path: str, dtype, plan: ShardPlan | None) -> Placed:
    """The checkpoint placed with its layer weights kept (see the module doc)."""
    loaded, layouts = load_llama_kept(path)
    if plan is not None:
        check_mesh(layouts, loaded.config, plan)
    return place_parts(loaded, dict(loaded.weights), layouts, dtype, plan)
