"""A speculative draft head as `infire-jax plan` counts it (memplan/source.py `plan_source`'s `draft_head`)."""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from flax import nnx

from infire_jax.models.config import ModelConfig
from infire_jax.speculative.config import SpeculativeConfig


def draft_head_for(value, dtype: str) -> Callable[[ModelConfig], tuple[object, dict]] | None:
    """For a `speculative_config` (vLLM's, as serve's): the function from the target's placed config to (the
    abstract head, its weights split over the mesh by logical axes), as speculative/setup.py places it: an
    EAGLE-3 head (read from its config and safetensors headers) or the target's MTP layer (sharing the
    target's embedding and head, as published DeepSeek-V3 and GLM-4.5 checkpoints do; its decoder layer split
    as the target's layers, and its pool as the target's pool); None for none or n-grams. A draft model is
    refused (ValueError): it runs on one device beside the target."""
    sc = SpeculativeConfig.parse(value)
    if sc is None or sc.method == "ngram":
        return None
    if sc.method == "draft_model":
        raise ValueError("speculative_config.method 'draft_model' is not planned: the draft runs on one device, "
                         "beside the target")

    def head(cfg: ModelConfig) -> tuple[object, dict]:
        if sc.method == "eagle3":
            from infire_jax.speculative.eagle3 import Eagle3Head
            from infire_jax.speculative.eagle3_loader import head_config

            head_cfg = head_config(sc.model, cfg)
            return nnx.eval_shape(lambda: Eagle3Head(head_cfg, dtype=jnp.dtype(dtype))), {}
        from infire_jax.speculative.mtp import MTPHead, check_family

        check_family(cfg)
        mtp = nnx.eval_shape(lambda: MTPHead(cfg, dtype=jnp.dtype(dtype)))
        return mtp, {f"layers.{k}": v for k, v in mtp.layers.axes().items()}

    return head
