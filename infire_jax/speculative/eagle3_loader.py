"""Loads a published EAGLE-3 head: `config.json` and `*.safetensors` in the EAGLE/SpecForge layout, or in
vLLM's speculators layout (Red Hat's `*-speculator.eagle3` heads).

Weights are named as the public EAGLE code saves them (`fc.weight`, `midlayer.self_attn.q_proj.weight`,
..., `norm.weight`, `lm_head.weight`, `d2t`, `t2d`; SpecForge and speculators write `layers.0.` for
`midlayer.`). `embed_tokens.weight` is optional: without it the head shares the target's embedding. `d2t`
may be absent only when the draft vocabulary is the target's. A speculators config holds the decoder
layer's fields in `transformer_layer_config` beside the head's own (`draft_vocab_size`,
`eagle_aux_hidden_state_layer_ids`, ...), and may ask for a norm before `fc` (`norm_before_fc`:
`input_norm.weight` over the three states; `fc_norm`: `fc_norm.{i}.weight` over each), for the
normed state to be passed between drafts (`norm_output`), and for a Qwen3 decoder layer (its q/k
norms). Everything is checked against the target's config first, and a problem names the key or field.
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
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
}
_TOP = {"fc.weight": "fc", "norm.weight": "final_norm", "lm_head.weight": "lm_head", "embed_tokens.weight": "embed",
        "d2t": "d2t", "t2d": "t2d", "input_norm.weight": "fc_input_norm",
        **{f"fc_norm.{i}.weight": f"fc_input_norm_{i}" for i in range(3)}}
# A speculators config's own fields, beside its `transformer_layer_config`.
_SPECULATORS_FIELDS = ("draft_vocab_size", "target_hidden_size", "norm_before_residual", "norm_before_fc", "fc_norm",
                       "norm_output")


def flat_config(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """An EAGLE-3 config.json as one flat dict: a speculators one (`speculators_model_type`) merged into its
    decoder layer's fields; an EAGLE / SpecForge one as it is."""
    if "speculators_model_type" not in raw:
        return raw
    kind = raw["speculators_model_type"]
    if kind != "eagle3":
        raise UnsupportedModelError(f"speculators_model_type {kind!r} is not supported (eagle3)")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise UnsupportedModelError("the speculators config has no transformer_layer_config")
    if layer.get("model_type", "llama") not in ("llama", "qwen3"):
        raise UnsupportedModelError(f"speculators transformer_layer_config.model_type {layer['model_type']!r}: "
                                    "a Llama or Qwen3 decoder layer is supported (llama, qwen3)")
    if layer.get("use_sliding_window") or layer.get("layer_types", ["full_attention"])[0] != "full_attention":
        raise UnsupportedModelError("speculators transformer_layer_config: a sliding-window decoder layer is not "
                                    "supported")
    flat = {**layer, **{k: raw[k] for k in _SPECULATORS_FIELDS if raw.get(k) is not None}}
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    return {**flat, "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}} if ids else flat


def eagle3_config_from_hf(raw: Mapping[str, Any], target: ModelConfig, *, has_embed: bool) -> Eagle3Config:
    """The head's config (EAGLE's, SpecForge's or speculators'), checked against the target it drafts for."""
    raw = flat_config(raw)

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
        rope_theta=float(field("rope_theta", 10000.0)), rope_scaling=rope_scaling_from_hf(raw.get("rope_scaling"),
                                                                     raw.get("max_position_embeddings")),
        aux_layer_ids=None if ids is None else tuple(int(i) for i in ids),
        norm_before_residual=bool(raw.get("norm_before_residual", False)), has_embed=has_embed,
        fc_norm=_fc_norm(raw), norm_output=bool(raw.get("norm_output", False)),
        qk_norm=raw.get("model_type") == "qwen3")
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


def _fc_norm(raw: Mapping[str, Any]) -> str:
    """Which norm the head puts before fc: none, one over the three states ("concat"), one over each ("each")."""
    if raw.get("norm_before_fc") and raw.get("fc_norm"):
        raise UnsupportedModelError("EAGLE-3 config sets both norm_before_fc and fc_norm; they exclude each other")
    return "concat" if raw.get("norm_before_fc") else "each" if raw.get("fc_norm") else "none"


def _expected_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """HF-layout shapes by our short name."""
    e, hq, hkv, d, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    shapes = {"fc": (e, 3 * cfg.target_hidden_size), "input_norm": (e,), "hidden_norm": (e,), "mlp_norm": (e,),
              "wq": (hq * d, 2 * e), "wk": (hkv * d, 2 * e), "wv": (hkv * d, 2 * e), "wo": (e, hq * d),
              "w_gate": (f, e), "w_up": (f, e), "w_down": (e, f), "final_norm": (e,),
              "lm_head": (cfg.draft_vocab_size, e), "d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)}
    if cfg.has_embed:
        shapes["embed"] = (cfg.vocab_size, e)
    if cfg.qk_norm:
        shapes.update(q_norm=(d,), k_norm=(d,))
    if cfg.fc_norm == "concat":
        shapes["fc_input_norm"] = (3 * cfg.target_hidden_size,)
    elif cfg.fc_norm == "each":
        shapes.update({f"fc_input_norm_{i}": (cfg.target_hidden_size,) for i in range(3)})
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
        if short is None or short not in shapes:
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
    if cfg.fc_norm == "each":
        w["fc_input_norms"] = np.stack([w.pop(f"fc_input_norm_{i}") for i in range(3)])
    return w


def build_eagle3_head(cfg: Eagle3Config, weights: Mapping[str, np.ndarray], *, dtype=jnp.float32,
                      sharding: jax.sharding.Sharding | None = None) -> Eagle3Head:
    """Places the weights (ours, by attribute name) in a head on `sharding` (a mesh's replicated one), or
    the default device."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Eagle3Head(cfg, dtype=dtype)))
    placed = []
    for path, var in nnx.to_flat_state(abstract):
        w = weights[path[0]]
        if tuple(w.shape) != tuple(var.shape):
            raise UnsupportedModelError(f"EAGLE-3 weight {path[0]!r} has shape {tuple(w.shape)}, expected {var.shape}")
        placed.append((path, var.replace(jax.device_put(np.asarray(w, dtype=var.dtype), sharding))))
    return nnx.merge(graphdef, nnx.from_flat_state(placed))


def _files(path: str) -> list[str]:
    """A head directory's safetensors files, once it is known to hold config.json and some."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelNotFoundError(f"{path} has no config.json")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelNotFoundError(f"{path} has no *.safetensors weights (pytorch_model.bin heads must be converted)")
    return files


def head_config(path: str, target: ModelConfig) -> Eagle3Config:
    """The config of the head at `path` for `target`, its tensors' names read from the files' headers only
    (whether it carries its own embedding): what `infire-jax plan` places."""
    from safetensors import safe_open

    names = set()
    for file in _files(path):
        with safe_open(file, framework="numpy") as f:
            names.update(f.keys())
    with open(os.path.join(path, "config.json")) as f:
        return eagle3_config_from_hf(json.load(f), target, has_embed="embed_tokens.weight" in names)


def load_eagle3(path: str, target: ModelConfig, *, dtype=jnp.float32,
                sharding: jax.sharding.Sharding | None = None) -> Eagle3Head:
    """A published EAGLE-3 head directory (config.json + *.safetensors) for `target`, placed on `sharding`."""
    tensors = {name: w for file in _files(path) for name, w in _read_safetensors(file)}
    with open(os.path.join(path, "config.json")) as f:
        cfg = eagle3_config_from_hf(json.load(f), target, has_embed="embed_tokens.weight" in tensors)
    return build_eagle3_head(cfg, eagle3_weights_from_hf(tensors, cfg), dtype=dtype, sharding=sharding)
