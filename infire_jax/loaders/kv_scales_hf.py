"""An HF checkpoint's own fp8 KV-cache scales (issue 30), in the spellings vLLM reads.

Per layer N, under `model.layers.N.self_attn.` (a multimodal checkpoint's `model.language_model.layers.N.`;
Qwen3.5's attention layers alone, each at its index in the pool): `k_scale` and `v_scale` (FP8
checkpoints such as AutoFP8's), `k_proj.k_scale` / `v_proj.v_scale` (ModelOpt), `k_proj.output_scale` /
`v_proj.output_scale` (compressed-tensors' kv_cache_scheme), or the older `kv_scale` (one for both).
Each is a scalar or one value per kv head, with vLLM's meaning, which is runner/kv_scales.py's:
`k_fp8 = k / k_scale`. They are no model weights: the weight loaders skip them (`is_kv_scale`)
and the engine reads them here, from the directory, because a model restored from its placed
checkpoint (loaders/checkpoint.py) never runs the HF loader. Reading them costs the safetensors
headers and the few scale tensors.
"""

from __future__ import annotations

import glob
import os
import re

import jax
import numpy as np
from jaxtyping import Float
from safetensors import safe_open

from infire_jax.errors import ConfigError
from infire_jax.loaders.weights import language_model_name
from infire_jax.models.config import ModelConfig

_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|k_proj\.k_scale|v_proj\.v_scale"
                    r"|k_proj\.output_scale|v_proj\.output_scale)")
# Which of k (0) and v (1) each spelling sets.
_SETS = {"k_scale": (0,), "v_scale": (1,), "kv_scale": (0, 1), "k_proj.k_scale": (0,), "v_proj.v_scale": (1,),
         "k_proj.output_scale": (0,), "v_proj.output_scale": (1,)}


def is_kv_scale(name: str) -> bool:
    """Whether an HF tensor name is a KV-cache scale (skipped by the weight loaders)."""
    return _SCALE.fullmatch(name) is not None


def read_kv_scales(path: str | None, cfg: ModelConfig) -> Float[np.ndarray, "L 2 Hkv"] | None:
    """The scales of the checkpoint directory `path`, [layers, (k, v), kv heads] float32, a scalar
    broadcast over the heads; None when it has none (or `path` is no directory). ConfigError naming
    the tensor for a wrong shape, a value that is not finite and positive, a scale given twice, or
    scales on only some layers."""
    if not path or not os.path.isdir(path):
        return None
    found: dict[tuple[int, int], tuple[str, np.ndarray]] = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with jax.default_device(jax.local_devices(backend="cpu")[0]), safe_open(file, framework="flax") as f:
            for name in f.keys():
                m = _SCALE.fullmatch(language_model_name(name) or "")
                if m:
                    layer = int(m.group(1))
                    if layer >= cfg.num_layers:
                        raise ConfigError(f"{name}: the model has {cfg.num_layers} layers")
                    layer = cfg.kv_layer(layer)
                    if layer is None:
                        raise ConfigError(f"{name}: layer {m.group(1)} keeps no keys and values (a linear-attention "
                                          "layer)")
                    value = _checked(name, np.asarray(f.get_tensor(name), np.float32), cfg)
                    for kv in _SETS[m.group(2)]:
                        key = (layer, kv)
                        if key in found:
                            raise ConfigError(f"{name}: layer {key[0]}'s {'kv'[kv]} scale is also given by "
                                              f"{found[key][0]}")
                        found[key] = (name, value)
    if not found:
        return None
    scales = np.empty((cfg.num_kv_layers, 2, cfg.num_kv_heads), np.float32)
    for layer in range(cfg.num_layers):
        pooled = cfg.kv_layer(layer)
        for kv in (0, 1) if pooled is not None else ():
            if (pooled, kv) not in found:
                some = next(iter(found.values()))[0]
                raise ConfigError(f"model.layers.{layer}.self_attn.{'kv'[kv]}_scale is missing: the checkpoint "
                                  f"has KV-cache scales ({some}, ...) but not for every layer's k and v")
            scales[pooled, kv] = found[(pooled, kv)][1]
    return scales


def _checked(name: str, value: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """One tensor's scales as a scalar or a [kv heads] vector."""
    if value.size == 1:
        value = value.reshape(())
    elif value.shape != (cfg.num_kv_heads,):
        raise ConfigError(f"{name} has shape {value.shape}: a KV-cache scale is a scalar or one per kv head "
                          f"({cfg.num_kv_heads},)")
    if not np.all(np.isfinite(value) & (value > 0)):
        raise ConfigError(f"{name} holds {value}: a KV-cache scale is finite and positive")
    return value
