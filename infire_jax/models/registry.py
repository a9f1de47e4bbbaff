"""Model construction: architecture -> module class, and loaded weights -> a placed nnx state."""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from infire_jax.errors import UnsupportedModelError
from infire_jax.models.config import ModelConfig
from infire_jax.models.llama import Llama
from sharding.plan import ShardPlan

# Every supported family is a Llama-architecture decoder with flags (bias, qk-norm, MoE).
MODEL_CLASSES = {"llama": Llama, "qwen2": Llama, "qwen3": Llama, "mixtral": Llama, "qwen3_moe": Llama}

def abstract_model(cfg: ModelConfig, dtype) -> nnx.Module:
    cls = MODEL_CLASSES.get(cfg.architecture)
    if cls is None:
        raise UnsupportedModelError(f"unsupported architecture {cfg.architecture!r}")
    return nnx.eval_shape(lambda: cls(cfg, dtype=dtype, rngs=nnx.Rngs(0)))


def _place(w: np.ndarray, dtype, sharding: jax.sharding.Sharding | None) -> jax.Array:
    """Puts one weight on its devices; each process materialises only the shards it holds."""
    if sharding is None:
        return jax.device_put(np.asarray(w, dtype=dtype))
    return jax.make_array_from_callback(w.shape, sharding, lambda idx: np.asarray(w[idx], dtype=dtype))


def build_state(cfg: ModelConfig, weights: Mapping[str, np.ndarray] | None, dtype, *,
                plan: ShardPlan | None = None, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
    """Places the weights on the device(s), each in `dtype` and its sharding.

    With a plan, the model is the plan's effective config (kv heads repeated, layers padded to
    whole pipeline stages) and each device receives only its shard. With `weights=None` the
    model's random init runs on the device itself (for `dummy:` models), so no host copy of a
    multi-GB model is ever made.
    """
    if plan is not None:
        cfg = plan.effective_config(cfg)
        weights = plan.prepare_weights(weights) if weights is not None else None
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype))
    flat = nnx.to_flat_state(abstract)
    shardings = {path: plan.sharding(var.axes) if plan else None for path, var in flat}

    if weights is None:
        cls = MODEL_CLASSES[cfg.architecture]
        out_shardings = nnx.from_flat_state(list(shardings.items())) if plan else None
        slot_mask = plan.layer_slot_mask() if plan else None

        def init():
            state = nnx.state(cls(cfg, dtype=dtype, rngs=nnx.Rngs(seed)))
            if slot_mask is None:
                return state
            # Padding slots of short pipeline stages must be zero: that makes them identities.
            return nnx.from_flat_state([
                (p, v.replace(v[...] * slot_mask.reshape(-1, *[1] * (v[...].ndim - 1)).astype(v[...].dtype))
                 if p[0] == "layers" else v) for p, v in nnx.to_flat_state(state)])

        return graphdef, jax.jit(init, out_shardings=out_shardings)()

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
        placed.append((path, var.replace(_place(w, jnp.dtype(dtype), shardings[path]))))
    return graphdef, nnx.from_flat_state(placed)
