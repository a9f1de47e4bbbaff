"""A Llama 4 or Gemma 3 checkpoint's vision tower and projector, read apart from the text model (a
`dummy:` Llama 4's drawn at random).

`Llama4ForConditionalGeneration` keeps them as `vision_model.*` and `multi_modal_projector.*` beside
the text weights (loaders/llama4_hf.py skips them), `Gemma3ForConditionalGeneration` as `vision_tower.*`
and `multi_modal_projector.*` (transformers 4.5x: under `model.`; loaders/gemma3_hf.py skips them). Only
those tensors are read here, by name from each safetensors file's index, so the text weights (200 GB for
Scout) are not read a second time.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
from infire_jax.errors import UnsupportedModelError
from infire_jax.loaders.dummy import dummy_hf_config
from infire_jax.loaders.hf import checkpoint_tensors
from infire_jax.loaders.hf_quantized import dequantized, quant_scheme
from infire_jax.vision.encoder import random_weights
from infire_jax.vision.gemma3_encoder import Gemma3VisionConfig
from infire_jax.vision.gemma3_inputs import check_processor
from infire_jax.vision.towers import MODEL_TYPES, TowerConfig, prefixes, vision_config, weights_from_hf


def vision_hf_config(model: str) -> dict[str, Any] | None:
    """The config.json of `model` (an HF directory or a `dummy:` name) if it is a Llama 4 or Gemma 3
    model with a vision tower, else None."""
    if model.startswith("dummy:"):
        hf = dummy_hf_config(model[len("dummy:"):])
    else:
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            hf = json.load(f)
    return hf if hf.get("model_type") in MODEL_TYPES and hf.get("vision_config") else None


def load_vision_config(model: str, hf: dict[str, Any]) -> TowerConfig:
    """The tower of `model` (its config.json `hf`); a Gemma 3 directory's preprocessor_config.json is
    checked against what vision/gemma3_inputs.py implements."""
    cfg = vision_config(hf)
    path = os.path.join(model, "preprocessor_config.json")
    if isinstance(cfg, Gemma3VisionConfig) and os.path.isfile(path):
        with open(path) as f:
            check_processor(json.load(f), cfg.image_size)
    return cfg


def has_vision(model: str) -> bool:
    return vision_hf_config(model) is not None


def load_vision_weights(model: str, cfg: TowerConfig, dtype, seed: int = 0,
                        sharding: jax.sharding.Sharding | None = None) -> dict:
    """The tower's weights on the device (the pytree `vision.encoder.encode` takes): a checkpoint's, or a
    `dummy:` model's drawn at random; placed on `sharding` (a mesh's replicated one: the same values
    as on one device). Only Llama 4's dummies have a tower (`dummy:gemma-3-*` are text configs)."""
    if model.startswith("dummy:"):
        weights = random_weights(cfg, dtype, seed)
    else:
        weights = weights_from_hf(cfg, load_vision_tower(model)[1], dtype)
    return weights if sharding is None else jax.device_put(weights, sharding)


def load_vision_tower(path: str) -> tuple[TowerConfig, dict[str, np.ndarray]]:
    """(the tower's config, its tensors by HF name as float32 numpy arrays) of an HF directory; a tower the
    checkpoint quantized (its `quantization_config` not leaving it out) is dequantized as read, as the text
    weights are (loaders/hf_quantized.py), whatever form the text weights are then kept in."""
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    cfg = vision_config(hf)
    read = checkpoint_tensors(path, lambda name: name.startswith(prefixes(cfg)))
    tensors = {name: np.asarray(w, np.float32) for name, w in dequantized(read, quant_scheme(hf))}
    if not tensors:
        raise UnsupportedModelError(f"{path}: the config has a vision tower but the weights have no "
                                    f"{' or '.join(prefixes(cfg))} tensors")
    return cfg, tensors
