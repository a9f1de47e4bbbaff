"""Reads the MTP layer from the target's own HF checkpoint (vLLM's mtp needs no other model).

Qwen3.5 and Qwen3-Next ship it as `mtp.*`: `fc` [E, 2E], `pre_fc_norm_embedding`, `pre_fc_norm_hidden`,
`norm` (RMSNorms of Qwen's 1 + w) and `layers.0`, a gated attention layer with its MLP or MoE named as the
target's layers (loaders/qwen3_5_hf.py converts it, as the attention layer of a one-group model).
DeepSeek-V3 and GLM-4.5 ship it as `model.layers.{L}` with L = num_hidden_layers (config.json's
`num_nextn_predict_layers` counts such layers; the first is read and reused for every draft, as vLLM
does): `enorm`, `hnorm`, `eh_proj` [E, 2E], `shared_head.norm`, `shared_head.head` and a MoE decoder
layer's tensors, named as the target's layers (loaders/deepseek_hf.py converts them), and often
`embed_tokens`. Only that layer's tensors are read (and quantized ones dequantized, as the target's).
`shared_head.head` and `embed_tokens` equal to the target's LM head and embedding (read from the same
checkpoint to compare) are not held twice. A checkpoint without the layer is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import numpy as np
from flax import nnx

from infire_jax.errors import ConfigError, UnsupportedModelError
from infire_jax.loaders.deepseek_hf import layer_weights, rope_interleaved
from infire_jax.loaders.gemma3_hf import gemma_norm
from infire_jax.loaders.hf import checkpoint_tensors
from infire_jax.loaders.hf_quantized import dequantized, quant_scheme
from infire_jax.loaders.qwen3_5_hf import qwen3_5_weights
from infire_jax.models.config import ModelConfig
from infire_jax.models.deepseek_config import text_config
from infire_jax.models.qwen3_5_config import text_config as qwen3_5_text_config
from infire_jax.speculative.mtp import MTPHead, check_family
from sharding.plan import ShardPlan

# The MTP layer's own tensors (inside `model.layers.{L}.`) -> the head's attributes.
_OWN = {"enorm.weight": "enorm", "hnorm.weight": "hnorm", "eh_proj.weight": "eh_proj",
        "shared_head.norm.weight": "norm", "shared_head.head.weight": "head", "embed_tokens.weight": "embed"}
# Optional, and compared with the target's (by HF name): held only where they differ.
_SHARED = {"head": "lm_head.weight", "embed": "model.embed_tokens.weight"}


def _mtp_config(path: str | None) -> dict:
    """config.json, once it is known to declare an MTP layer."""
    raw = _read_config(path)
    n = text_config(raw).get("num_nextn_predict_layers")
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"speculative_config.method 'mtp': {path} has no MTP layer (config.json's "
                          f"num_nextn_predict_layers is {n!r})")
    return raw


def _read_config(path: str | None) -> dict:
    cfg_path = os.path.join(path, "config.json") if path else ""
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"speculative_config.method 'mtp' reads the MTP layer from the target's HF checkpoint "
                          f"directory; the model {path!r} is not one (no config.json)")
    with open(cfg_path) as f:
        return json.load(f)


def load_mtp(path: str | None, target: ModelConfig, *, dtype, plan: ShardPlan | None = None) -> MTPHead:
    """The MTP head for `target`, from its checkpoint directory `path`, placed on `plan`'s mesh (`build_mtp_head`)
    or the default device."""
    check_family(target)
    if target.gated_delta is not None:
        return _load_qwen3_5(path, target, dtype=dtype, plan=plan)
    raw = _mtp_config(path)
    index = target.num_layers
    layer_name = re.compile(rf"(?:language_model\.)?model\.layers\.{index}\.(.+)")
    scheme = quant_scheme(raw)
    own, rest = {}, []
    for name, w in dequantized(checkpoint_tensors(path, lambda n: bool(layer_name.fullmatch(n))), scheme):
        inner = layer_name.fullmatch(name).group(1)
        if inner in _OWN:
            own[_OWN[inner]] = np.asarray(w)
        elif not inner.endswith("rotary_emb.inv_freq"):
            rest.append((inner, w))
    missing = [f"model.layers.{index}.{hf}" for hf, ours in _OWN.items() if ours not in own and ours not in _SHARED]
    if not rest:
        missing.append(f"model.layers.{index}.self_attn.*, mlp.* (its decoder layer)")
    if missing:
        raise ConfigError(f"speculative_config.method 'mtp': {path} lacks the MTP layer's tensors {missing}")
    for name, target_name in _SHARED.items():
        if target.tie_word_embeddings and name == "head":
            target_name = "model.embed_tokens.weight"
        if name in own and _equals_checkpoint(path, scheme, target_name, own[name]):
            del own[name]
    interleaved = rope_interleaved(path) if target.mla is not None else False
    return build_mtp_head(target, own, layer_weights(rest, target, interleaved, index), dtype=dtype, plan=plan)


# Qwen3.5's MTP tensors outside its decoder layer (inside `mtp.`) -> the head's attributes.
_QWEN_OWN = {"fc.weight": "eh_proj", "pre_fc_norm_embedding.weight": "enorm", "pre_fc_norm_hidden.weight": "hnorm",
             "norm.weight": "norm", "embed_tokens.weight": "embed"}


def _load_qwen3_5(path: str | None, target: ModelConfig, *, dtype, plan: ShardPlan | None) -> MTPHead:
    """Qwen3.5's (Qwen3-Next's) `mtp.*`: the first MTP layer serves every draft, as vLLM runs a checkpoint of
    one; its embedding is the target's unless the checkpoint has its own (`mtp_use_dedicated_embeddings`)."""
    raw = _read_config(path)
    n = qwen3_5_text_config(raw).get("mtp_num_hidden_layers", 1)
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"speculative_config.method 'mtp': {path} has no MTP layer (config.json's "
                          f"mtp_num_hidden_layers is {n!r})")
    attention = f"model.layers.{target.gated_delta.interval - 1}."  # the attention layer of a one-group model
    own, layer = {}, []
    for name, w in dequantized(checkpoint_tensors(path, lambda n: n.startswith("mtp.")), quant_scheme(raw)):
        inner = name.removeprefix("mtp.")
        if inner in _QWEN_OWN:
            short = _QWEN_OWN[inner]
            own[short] = gemma_norm(np.asarray(w)) if short in ("enorm", "hnorm", "norm") else np.asarray(w)
        elif inner.startswith("layers.0."):
            layer.append((attention + inner.removeprefix("layers.0."), w))
        elif not inner.startswith("layers."):
            raise ConfigError(f"speculative_config.method 'mtp': unexpected MTP tensor {name!r}")
    missing = [f"mtp.{hf}" for hf, ours in _QWEN_OWN.items() if ours not in own and ours != "embed"]
    if not layer:
        missing.append("mtp.layers.0.* (its decoder layer)")
    if missing:
        raise ConfigError(f"speculative_config.method 'mtp': {path} lacks the MTP layer's tensors {missing}")
    one_group = dataclasses.replace(target, num_layers=target.gated_delta.interval)
    try:
        stacked = qwen3_5_weights(layer, one_group)
    except UnsupportedModelError as e:
        raise ConfigError(f"speculative_config.method 'mtp': {e}") from e
    weights = {name.removeprefix("attention_layers."): w[0] for name, w in stacked.items()}
    return build_mtp_head(target, own, weights, dtype=dtype, plan=plan)


def _equals_checkpoint(path: str, scheme, name: str, w: np.ndarray) -> bool:
    """Whether the checkpoint's tensor `name` (the target's, outside any language_model. prefix) equals `w`."""
    def keep(n: str) -> bool:
        return n.removeprefix("language_model.").startswith(name.removesuffix("weight"))

    found = [t for n, t in dequantized(checkpoint_tensors(path, keep), scheme) if n.endswith(name)]
    return len(found) == 1 and found[0].shape == w.shape and np.array_equal(np.asarray(found[0]), w)


def build_mtp_head(cfg: ModelConfig, own: dict[str, np.ndarray], layer: dict[str, np.ndarray], *, dtype,
                   plan: ShardPlan | None = None) -> MTPHead:
    """Places the weights in a head: `own` by HF layout ((out, in) eh_proj), `layer` as one layer of the family's
    stacks. On `plan`'s mesh the layer is split as the target's layers (DeepSeek-V3's is 11.6B parameters;
    GLM-4.5's and Qwen3.5's kv heads repeated up to tp, as ShardPlan.prepare_weights repeats the target's),
    the rest is whole on every device; without a plan, on the default device."""
    weights = {name: (w.T if name == "eh_proj" else w) for name, w in own.items()}
    stack = "attention_layers" if cfg.gated_delta is not None else "layers"  # as the target's stack is named
    stacked = {f"{stack}.{name}": w[None] for name, w in layer.items()}
    prepared = plan.prepare_weights(stacked) if plan is not None else stacked
    weights.update({f"layers.{name.removeprefix(stack + '.')}": w for name, w in prepared.items()})
    placed_cfg = plan.effective_config(cfg) if plan is not None else cfg
    shape = nnx.eval_shape(lambda: MTPHead(placed_cfg, dtype=dtype, own_head="head" in own, own_embed="embed" in own))
    layer_axes = shape.layers.axes()
    graphdef, abstract = nnx.split(shape)

    def placement(path: tuple) -> jax.sharding.Sharding | None:
        if plan is None:
            return None
        return plan.sharding(layer_axes[path[1]]) if path[0] == "layers" else plan.replicated

    placed, used = [], set()
    for path, var in nnx.to_flat_state(abstract):
        name = ".".join(map(str, path))
        if name not in weights:
            raise ConfigError(f"speculative_config.method 'mtp': the MTP layer has no {name!r}")
        w = weights[name]
        if tuple(w.shape) != tuple(var.shape):
            raise ConfigError(f"speculative_config.method 'mtp': the MTP layer's {name!r} has shape "
                              f"{tuple(w.shape)}, expected {tuple(var.shape)}")
        used.add(name)
        placed.append((path, var.replace(jax.device_put(np.asarray(w, dtype=var.dtype), placement(path)))))
    extra = sorted(set(weights) - used)
    if extra:
        raise ConfigError(f"speculative_config.method 'mtp': unexpected MTP layer weights {extra}")
    return nnx.merge(graphdef, nnx.from_flat_state(placed))
