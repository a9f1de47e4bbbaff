"""A published quantized DeepSeek-V3-family checkpoint placed with its quantized layer weights kept.

`weights_quantization="checkpoint"`: every layer weight the checkpoint quantizes (Kimi K2/K2.5:
the routed experts in int4; DeepSeek-V3: every linear weight in fp8 blocks) stays in its format on
the device (quant/grouped.py) and is dequantized one layer at a time inside the layer scan. A kept
weight's parts take the float weight's own path into the model's layout (deepseek_hf.py moves only
output axes), so they land where the weight would. Quantized tensors outside the layers (none in
the published checkpoints) are dequantized at load as usual. Refused, naming the weight: groups
that do not tile the weight's input axis (within a head for wo), a weight whose parts are only
partly quantized, and a mesh whose shards would split a group. Checkpoints of the placed weights
are bypassed: the quantized checkpoint is the compact form.
"""

from __future__ import annotations

import json
import math
import os
from typing import Callable

import jax.numpy as jnp
from flax import nnx

from infire_jax.errors import ConfigError, UnsupportedModelError
from infire_jax.loaders.deepseek_hf import deepseek_weights, linear_targets, rope_interleaved
from infire_jax.loaders.hf import checkpoint_tensors, read_hf_config
from infire_jax.loaders.hf_quantized import QuantScheme, dequantize_module, grouped, kept_parts, quant_scheme
from infire_jax.loaders.weights import LoadedModel, Placed
from infire_jax.models.config import ModelConfig
from infire_jax.models.registry import abstract_model, build_state
from infire_jax.quant.grouped import INPUT_AXIS, VALUE_PART, GroupedLayout
from infire_jax.loaders.tokenizer import Tokenizer
from sharding.plan import ShardPlan


def kept_scheme(path: str) -> QuantScheme:
    """The checkpoint's scheme; ConfigError unless `path` is a quantized HF checkpoint directory."""
    if not (path and os.path.isfile(os.path.join(path, "config.json"))):
        raise ConfigError(f"weights_quantization='checkpoint' keeps a quantized HF checkpoint's weights: model "
                          f"{path!r} is not an HF model directory")
    with open(os.path.join(path, "config.json")) as f:
        scheme = quant_scheme(json.load(f))
    if scheme is None:
        raise ConfigError(f"weights_quantization='checkpoint': {path} has no quantization_config (a float "
                          "checkpoint); load it without weights_quantization")
    return scheme


def _model_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """Each plain weight's (shape, logical axes), by parameter path."""
    flat = nnx.to_flat_state(nnx.state(abstract_model(cfg, jnp.float32), nnx.Param))
    return {".".join(map(str, p)): (tuple(v.shape), v.axes) for p, v in flat}


def load_kept(path: str) -> tuple[LoadedModel, dict[str, GroupedLayout]]:
    """The model with each kept weight as parts ("moe_layers.w_gate_up.packed", "....scale") in the
    model's layout, and their layouts; every other weight as the float loader gives it."""
    scheme = kept_scheme(path)
    cfg = read_hf_config(path)
    if cfg.mla is None:
        raise ConfigError(f"weights_quantization='checkpoint' covers the DeepSeek-V3 family and GPTQ / AWQ "
                          f"checkpoints; {cfg.architecture} {scheme.kind} checkpoints are dequantized at load (leave "
                          "weights_quantization unset)")
    group = scheme.group if scheme.kind == "int4" else scheme.block
    plain, values, scales, kept = [], [], [], {}
    for name, w in grouped(checkpoint_tensors(path), scheme):
        targets = linear_targets(name, cfg) if isinstance(w, dict) else ()
        if not targets:  # a tensor the scheme leaves alone, or a quantized one outside the layers
            plain.append((f"{name}.weight", dequantize_module(name, w, scheme)) if isinstance(w, dict) else (name, w))
            continue
        v, s = kept_parts(name, w, scheme)
        values.append((f"{name}.weight", v))
        scales.append((f"{name}.weight", s))
        kept.update((t, name) for t in targets)
    check_whole(plain, kept, linear_targets, cfg)
    shapes = _model_shapes(cfg)
    for t in sorted(kept):
        try:  # before the conversion reshapes the parts by heads
            GroupedLayout(scheme.kind, group, None).part_shapes(t, shapes[t][0])
        except ValueError as e:
            raise UnsupportedModelError(f"{e} (load without weights_quantization to dequantize it)") from e
    interleaved = rope_interleaved(path)
    weights = deepseek_weights(plain + values, cfg, interleaved)
    parts = deepseek_weights(scales, cfg, interleaved)
    layouts = {}
    for t in sorted(kept):
        weights[f"{t}.{VALUE_PART[scheme.kind]}"] = weights.pop(t)
        weights[f"{t}.scale"] = parts[t]
        layouts[t] = GroupedLayout(scheme.kind, group, parts[t].dtype)
    loaded = LoadedModel(config=cfg, tokenizer=Tokenizer.from_dir(path), name=os.path.basename(os.path.normpath(path)),
                         weights=weights)
    return loaded, layouts


def check_whole(plain: list[tuple[str, object]], kept: dict[str, str], targets: Callable, cfg: ModelConfig) -> None:
    """UnsupportedModelError naming the weight if a plain tensor is part of a kept stacked weight
    (`kept`: stacked weight -> a quantized module of it; `targets(module, cfg)`: the family's
    `linear_targets`)."""
    for name, _ in plain:
        partly = set(targets(name.removesuffix(".weight"), cfg)) & set(kept)
        if partly:
            t = sorted(partly)[0]
            raise UnsupportedModelError(f"{t}: {name} is not quantized but {kept[t]} is; a weight is kept "
                                        "quantized whole (load without weights_quantization to dequantize it)")


def check_mesh(layouts: dict[str, GroupedLayout], cfg: ModelConfig, plan: ShardPlan) -> None:
    """ConfigError naming the weight if the mesh would split one of its groups across devices."""
    shapes = _model_shapes(cfg)
    for t, layout in layouts.items():
        shape, axes = shapes[t]
        axis = len(shape) + INPUT_AXIS[t.rpartition(".")[2]]
        entry = plan.spec(axes)[axis]
        mesh_axes = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        shards = math.prod(plan.sizes[a] for a in mesh_axes)
        if (shape[axis] // layout.group) % shards:
            raise ConfigError(f"{t}: its {shape[axis] // layout.group} {layout.kind} groups of {layout.group} "
                              f"inputs cannot be split {shards} ways over {'x'.join(mesh_axes)}; use a mesh that "
                              "splits it less, or load without weights_quantization")


def load_kept_placed(spec: str | None, dtype, plan: ShardPlan | None) -> Placed:
    """The model placed with the checkpoint's quantized layer weights kept (see the module doc)."""
    loaded, layouts = load_kept(spec)
    if plan is not None:
        check_mesh(layouts, loaded.config, plan)
    graphdef, state = build_state(loaded.config, loaded.weights, dtype, plan=plan, quantized=layouts)
    return Placed(loaded, graphdef, state, "quantized weights: checkpoints bypassed")
