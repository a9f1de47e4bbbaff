"""Resolves `infire-jax plan --model X` to a function from a mesh to the model as placed on it."""

from __future__ import annotations

import json
import os
from typing import Callable

from infire_jax.memplan.model import (
    PlanModel, formats_from_hf, from_hf_config, from_model_config, int4_layouts, placed_config)
from infire_jax.models.hf_config import config_from_hf
from sharding.mesh import MeshConfig

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "configs")


def shipped_configs() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(CONFIG_DIR) if f.endswith(".json"))


def plan_source(spec: str | None, dtype: str) -> Callable[[MeshConfig], PlanModel]:
    """`kimi-k2.5` / `dummy:kimi-k2.5` (a shipped config), a config.json file or a directory holding
    one, or any model spec the engine loads (its config only: no weight is read)."""
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
        hf = dict(hf.get("text_config") or hf)
        if hf.get("kv_lora_rank"):  # MLA: the layout does not depend on the mesh
            model = from_hf_config(hf, dtype, name=spec or path)
            return lambda mc: model
        cfg, formats = config_from_hf(hf), formats_from_hf(hf, dtype)
        int4 = int4_layouts(hf, cfg)
        return lambda mc: from_model_config(placed_config(cfg, mc), dtype, spec or path, formats, int4)
    from infire_jax.loaders.load import load_config

    cfg = load_config(spec)
    return lambda mc: from_model_config(placed_config(cfg, mc), dtype, spec or "default model")
