"""Loads a published EAGLE-3 head: `config.json` and `*.safetensors` in the EAGLE/SpecForge layout.

Weights are named as the public EAGLE code saves them (`fc.weight`, `midlayer.self_attn.q_proj.weight`,
..., `norm.weight`, `lm_head.weight`, `d2t`, `t2d`; SpecForge writes `layers.0.` for `midlayer.`).
`embed_tokens.weight` is optional: without it the head shares the target's embedding. `d2t` may be
absent only when the draft vocabulary is the target's. Everything is checked against the target's
config first, and a problem names the key or field.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from infire_jax.errors import ModelNotFoundError, UnsupportedModelError
from infire_jax.loaders.hf import _read_safetensors
from infire_jax.loaders.weights import fuse_projections
from infire_jax.models.config import ModelConfig
from infire_jax.models.llama_config import rope_scaling_from_hf
from infire_jax.speculative.eagle3 import Eagle3Config, Eagle3Head

# HF names inside the decoder layer -> ours (before the q/k/v and gate/up fusion).
_LAYER = {
    "input_layernorm.weight": "input_norm",
    "hidden_norm.weight": "hidden_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
_TOP = {"fc.weight": "fc", "norm.weight": "final_norm", "lm_head.weight": "lm_head", "embed_tokens.weight": "embed",
        "d2t": "d2t", "t2d": "t2d"}


def eagle3_config_from_hf(raw: Mapping[str, Any], target: ModelConfig, *, has_embed: bool) -> Eagle3Config:
    """The head's config, checked against the target it drafts for."""
    def field(name, default=None):
        if name not in raw and default is None:
            raise UnsupportedModelError(f"EAGLE-3 config.json has no {name!r}")
        value = raw.get(name)
        return default if value is None else value

    if int(field("num_hidden_layers", 1)) != 1:
        raise UnsupportedModelError(
            f"EAGLE-3 heads with num_hidden_layers={raw['num_hidden_layers']} are not supported (only 1)")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise UnsupportedModelError(f"EAGLE-3 config.json sets {flag}; only bias-free heads are supported")
    if field("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"EAGLE-3 hidden_act {raw['hidden_act']!r} is not supported (silu)")
    eagle = raw.get("eagle_config") or {}
    if not eagle.get("use_aux_hidden_state", True):
        raise UnsupportedModelError("EAGLE-3 config.json sets use_aux_hidden_state=false (EAGLE-1/2 style heads)")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
    hidden = int(field("hidden_size"))
    heads = int(field("num_attention_heads"))
    vocab = int(field("vocab_size"))
    cfg = Eagle3Config(
        hidden_size=hidden, num_heads=heads, num_kv_heads=int(field("num_key_value_heads", heads)),
        head_dim=int(field("head_dim", hidden // heads)), intermediate_size=int(field("intermediate_size")),
        vocab_size=vocab, draft_vocab_size=int(field("draft_vocab_size", vocab)),
        target_hidden_size=int(field("target_hidden_size", hidden)), rms_norm_eps=float(field("rms_norm_eps", 1e-6)),
        rope_theta=float(field("rope_theta", 10000.0)), rope_scaling=rope_scaling_from_hf(raw.get("rope_scaling")),
        aux_layer_ids=None if ids is None else tuple(int(i) for i in ids),
        norm_before_residual=bool(raw.get("norm_before_residual", False)), has_embed=has_embed)
    checks = [("vocab_size", cfg.vocab_size, target.vocab_size),
              ("target_hidden_size", cfg.target_hidden_size, target.hidden_size)]
    if not has_embed:  # the target's embedding feeds the head
        checks.append(("hidden_size (no embed_tokens: the target's embedding is used)", hidden, target.hidden_size))
    for name, ours, theirs in checks:
        if ours != theirs:
            raise UnsupportedModelError(f"EAGLE-3 {name} is {ours}, the target's is {theirs}")
    if cfg.num_heads % cfg.num_kv_heads or cfg.draft_vocab_size > cfg.vocab_size:
        raise UnsupportedModelError(f"EAGLE-3 config is inconsistent: {cfg.num_heads} heads / {cfg.num_kv_heads} kv "
                                    f"heads, draft vocabulary {cfg.draft_vocab_size} of {cfg.vocab_size}")
    layers = cfg.aux_layers(target.num_layers)
    if len(layers) != 3 or list(layers) != sorted(set(layers)) or not 0 <= layers[0] <= layers[-1] <= target.num_layers:
        raise UnsupportedModelError(f"EAGLE-3 aux layer ids {cfg.aux_layer_ids} do not fit the target's "
                                    f"{target.num_layers} layers (three increasing ids, each < {target.num_layers})")
    return cfg


def _expected_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """HF-layout shapes by our short name."""
    e, hq, hkv, d, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    shapes = {"fc": (e, 3 * cfg.target_hidden_size), "input_norm": (e,), "hidden_norm": (e,), "mlp_norm": (e,),
              "wq": (hq * d, 2 * e), "wk": (hkv * d, 2 * e), "wv": (hkv * d, 2 * e), "wo": (e, hq * d),
              "w_gate": (f, e), "w_up": (f, e), "w_down": (e, f), "final_norm": (e,),
              "lm_head": (cfg.draft_vocab_size, e), "d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)}
    if cfg.has_embed:
        shapes["embed"] = (cfg.vocab_size, e)
    return shapes


def _short_name(name: str) -> str | None:
    for prefix in ("midlayer.", "layers.0."):
        if name.startswith(prefix):
            return _LAYER.get(name[len(prefix):])
    return _TOP.get(name)


def eagle3_weights_from_hf(tensors: Mapping[str, np.ndarray], cfg: Eagle3Config) -> dict[str, np.ndarray]:
    """HF-layout tensors -> the head's parameters by attribute name, shapes and d2t checked."""
    shapes = _expected_shapes(cfg)
    w: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        short = _short_name(name)
        if short is None:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise UnsupportedModelError(f"unexpected weight {name!r} in the EAGLE-3 checkpoint")
        if tuple(array.shape) != shapes[short]:
            raise UnsupportedModelError(f"EAGLE-3 weight {name!r} has shape {tuple(array.shape)}, "
                                        f"expected {shapes[short]}")
        w[short] = np.asarray(array)
    if "d2t" not in w and cfg.draft_vocab_size == cfg.vocab_size:
        w["d2t"] = np.zeros(cfg.draft_vocab_size, np.int64)
    missing = sorted(set(shapes) - set(w) - {"t2d"})
    if missing:
        raise UnsupportedModelError(f"the EAGLE-3 checkpoint lacks {missing}")
    target = np.arange(cfg.draft_vocab_size) + w["d2t"]
    if target.min() < 0 or target.max() >= cfg.vocab_size or len(np.unique(target)) != len(target):
        raise UnsupportedModelError("EAGLE-3 d2t does not map the draft vocabulary one-to-one into the target's")
    t2d = w.pop("t2d", None)
    if t2d is not None and (int(t2d.astype(bool).sum()) != cfg.draft_vocab_size or not t2d.astype(bool)[target].all()):
        raise UnsupportedModelError("EAGLE-3 t2d disagrees with d2t")

    e, d = cfg.hidden_size, cfg.head_dim
    for qkv in ("wq", "wk", "wv"):  # (heads * D, 2E) -> (2E, heads, D)
        w[qkv] = w[qkv].reshape(-1, d, 2 * e).transpose(2, 0, 1)
    w["wo"] = w["wo"].reshape(e, cfg.num_heads, d).transpose(1, 2, 0)
    for name in ("fc", "w_gate", "w_up", "w_down"):
        w[name] = w[name].T
    w = fuse_projections(w, cfg.layer_config)
    w["d2t"] = w["d2t"].astype(np.int32)
    return w


def build_eagle3_head(cfg: Eagle3Config, weights: Mapping[str, np.ndarray], *, dtype=jnp.float32) -> Eagle3Head:
    """Places the weights (ours, by attribute name) in a head on the default device."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Eagle3Head(cfg, dtype=dtype)))
    placed = []
    for path, var in nnx.to_flat_state(abstract):
        w = weights[path[0]]
        if tuple(w.shape) != tuple(var.shape):
            raise UnsupportedModelError(f"EAGLE-3 weight {path[0]!r} has shape {tuple(w.shape)}, expected {var.shape}")
        placed.append((path, var.replace(jax.device_put(np.asarray(w, dtype=var.dtype)))))
    return nnx.merge(graphdef, nnx.from_flat_state(placed))


def load_eagle3(path: str, target: ModelConfig, *, dtype=jnp.float32) -> Eagle3Head:
    """A published EAGLE-3 head directory (config.json + *.safetensors) for `target`."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelNotFoundError(f"{path} has no config.json")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelNotFoundError(f"{path} has no *.safetensors weights (pytorch_model.bin heads must be converted)")
    tensors = {name: w for file in files for name, w in _read_safetensors(file)}
    with open(cfg_path) as f:
        cfg = eagle3_config_from_hf(json.load(f), target, has_embed="embed_tokens.weight" in tensors)
    return build_eagle3_head(cfg, eagle3_weights_from_hf(tensors, cfg), dtype=dtype)
