"""Resolves `infire-jax plan --model X` to a function from a mesh to the model as placed on it."""

from __future__ import annotations

import json
import os
from typing import Callable

from infire_jax.loaders.hf_quantized import quantization_config
from infire_jax.memplan.model import (
    PlanModel, at_load_layouts, formats_from_hf, from_hf_config, from_model_config, kept_layouts, placed_config,
    with_draft_head, with_vision)
from infire_jax.models.config import ModelConfig
from infire_jax.models.hf_config import config_from_hf
from infire_jax.quant.int4_rtn import DEFAULT_INT4_GROUP, INT4_GROUPS
from sharding.mesh import MeshConfig

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")
_NOT_MLA = "weights_quantization {} quantizes Llama-architecture models at load, not MLA ones"
AT_LOAD = ("int8", "fp8", "int4")  # the weights_quantization modes that quantize a float model at load


def shipped_configs() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))


def plan_source(spec: str | None, dtype: str, weights_quantization: str | None = None,
                int4_group_size: int | None = None,
                draft_head: Callable[[ModelConfig], tuple[object, dict]] | None = None
                ) -> Callable[[MeshConfig], PlanModel]:
    """`kimi-k2.5` / `dummy:kimi-k2.5` (a shipped config), a config.json file or a directory holding
    one, or any model spec the engine loads (its config only: no weight is read). `weights_quantization`
    "int8" / "fp8" / "int4": the layer weights as quantized at load (int4 in groups of `int4_group_size`,
    default 128); `draft_head(config)`: a speculative draft head beside the model (the speculation layer's
    `speculative/plan.py`: the abstract head of the placed config and the weights split over the mesh),
    placed by `with_draft_head`. ValueError for any other mode or a model it does not cover."""
    target, cfg = _target(spec, dtype, weights_quantization, int4_group_size)
    if draft_head is None:  # no speculation, or n-grams
        return target
    draft_head(cfg)  # a head the target cannot take is refused here, before any mesh is tried

    def placed(mc: MeshConfig) -> PlanModel:
        if mc.sizes["pp"] > 1:  # as speculative/setup.py refuses it
            raise ValueError(f"a draft head reads the target's states on one device or a mesh without pipeline "
                             f"stages; this mesh has pp={mc.sizes['pp']}")
        model = target(mc)  # checks that the mesh splits the target, before the head is placed as it
        return with_draft_head(model, *draft_head(placed_config(cfg, mc)), dtype)

    return placed


def _target(spec: str | None, dtype: str, weights_quantization: str | None,
            int4_group_size: int | None) -> tuple[Callable[[MeshConfig], PlanModel], ModelConfig]:
    """`plan_source`'s model without a draft head, and its config."""
    if weights_quantization not in (None, *AT_LOAD):
        raise ValueError(f"weights_quantization {weights_quantization!r} is not planned at load ({', '.join(AT_LOAD)}"
                         "; a GPTQ / AWQ, 8-bit, DeepSeek-V3 or Kimi config is planned as its checkpoint is kept)")
    if int4_group_size is not None and weights_quantization != "int4":
        raise ValueError("int4_group_size sets the groups of weights_quantization int4")
    if int4_group_size not in (None, *INT4_GROUPS):
        raise ValueError(f"int4_group_size {int4_group_size}: choose from {list(INT4_GROUPS)}")
    group = int4_group_size or DEFAULT_INT4_GROUP

    name = (spec or "").removeprefix("dummy:")
    path = None
    if name in shipped_configs():
        path = os.path.join(CONFIG_DIR, f"{name}.json")
    elif spec and spec.endswith(".json") and os.path.isfile(spec):
        path = spec
    elif spec and os.path.isfile(os.path.join(spec, "config.json")):
        path = os.path.join(spec, "config.json")
    if path is not None:
        with open(path) as f:
            hf = json.load(f)
        vision = hf if hf.get("model_type") in ("llama4", "gemma3") and hf.get("vision_config") else None
        quant = quantization_config(hf)  # a multimodal wrapper's, beside its text_config
        hf = {**({"quantization_config": quant} if quant else {}), **(hf.get("text_config") or hf)}
        if hf.get("kv_lora_rank"):  # MLA: the layout does not depend on the mesh
            if weights_quantization:
                raise ValueError(_NOT_MLA.format(weights_quantization))
            model = from_hf_config(hf, dtype, name=spec or path)
            return (lambda mc: model), config_from_hf(hf)
        cfg, formats = config_from_hf(hf), formats_from_hf(hf, dtype)
        kept = at_load_layouts(cfg, weights_quantization, group) if weights_quantization else kept_layouts(hf, cfg)
        return (lambda mc: _served(from_model_config(placed_config(cfg, mc), dtype, spec or path, formats, kept),
                                   vision)), cfg
    from infire_jax.loaders.dummy import dummy_hf_config
    from infire_jax.loaders.load import load_config
    from infire_jax.loaders.vision import vision_hf_config

    cfg = load_config(spec)
    if weights_quantization and cfg.mla is not None:
        raise ValueError(_NOT_MLA.format(weights_quantization))
    kept = at_load_layouts(cfg, weights_quantization, group) if weights_quantization else {}
    vision = vision_hf_config(spec) if spec else None
    # a dummy's formats are its published config's (gpt-oss: the experts in MXFP4)
    formats = formats_from_hf(dummy_hf_config(name), dtype) if spec and spec.startswith("dummy:") else None
    return (lambda mc: _served(from_model_config(placed_config(cfg, mc), dtype, spec or "default model", formats,
                                                 kept), vision)), cfg


def _served(model: PlanModel, vision_hf: dict | None) -> PlanModel:
    """`model` with the vision tower and image pool where the engine serves images: a Llama 4 or Gemma 3
    with a tower, whatever form its text weights are kept in, on one device or replicated on every device
    of a mesh (engine/setup.py `_vision`)."""
    return model if vision_hf is None else with_vision(model, vision_hf)
