"""Model construction: architecture -> module class, and loaded weights -> a placed nnx state."""

from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from infire_jax.errors import UnsupportedModelError
from infire_jax.models.config import ModelConfig
from infire_jax.models.llama import Llama

# Every supported family is a Llama-architecture decoder with flags (bias, qk-norm, MoE).
MODEL_CLASSES = {"llama": Llama, "qwen2": Llama, "qwen3": Llama, "mixtral": Llama, "qwen3_moe": Llama}

# Maps a parameter's logical axes to where it lives (None: the default device).
ShardingFn = Callable[[tuple[str, ...]], jax.sharding.Sharding]


def abstract_model(cfg: ModelConfig, dtype) -> nnx.Module:
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise UnsupportedModelError(f"unsupported architecture {cfg.architecture!r}")
    return nnx.eval_shape(lambda: cls(cfg, dtype=dtype, rngs=nnx.Rngs(0)))


def build_state(cfg: ModelConfig, weights: Mapping[str, np.ndarray] | None, dtype, *,
                sharding: ShardingFn | None = None, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
    """Places the weights on the device(s), each in `dtype` and its sharding.

    With `weights=None` the model's random init runs on the device itself (for `dummy:` models),
    so no host copy of a multi-GB model is ever made.
    """
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype))
    flat = nnx.to_flat_state(abstract)
    shardings = {path: sharding(var.axes) if sharding else None for path, var in flat}

    if weights is None:
        cls = MODEL_CLASSES[cfg.architecture]
        out_shardings = nnx.from_flat_state([(p, s) for p, s in shardings.items()]) if sharding else None
        init = jax.jit(lambda: nnx.split(cls(cfg, dtype=dtype, rngs=nnx.Rngs(seed)))[1],
                       out_shardings=out_shardings)
        return graphdef, init()

    expected = {".".join(map(str, p)) for p, _ in flat}
    extra = sorted(set(weights) - expected)
    if extra:
        raise UnsupportedModelError(f"weights not used by the {cfg.architecture} model: {extra[:5]}")
    placed = []
    for path, var in flat:
        name = ".".join(map(str, path))
        if name not in weights:
            raise UnsupportedModelError(f"weight {name!r} is missing from the checkpoint")
        w = weights[name]
        if tuple(w.shape) != tuple(var.shape):
            raise UnsupportedModelError(f"weight {name!r} has shape {tuple(w.shape)}, expected {tuple(var.shape)}")
        arr = jax.device_put(np.asarray(w, dtype=jnp.dtype(dtype)), shardings[path])
        placed.append((path, var.replace(arr)))
    return graphdef, nnx.from_flat_state(placed)
