"""What every loader returns (on the host, and placed on the devices), and the native on-disk form
(safetensors with our own names).

Weights use the model's parameter paths ("embed", "layers.wqkv", ...) with the layer axis stacked
and the projections fused as the model holds them, so a native checkpoint loads with no renaming,
restacking or concatenation: read, cast, place.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Mapping, NamedTuple

import numpy as np
from flax import nnx

from infire_jax.errors import UnsupportedModelError
from infire_jax.models.config import ModelConfig, RopeScaling
from infire_jax.loaders.tokenizer import Tokenizer

NATIVE_FORMAT_VERSION = 3  # 2: fused q/k/v and gate/up, LM head [V, E]; 3: MLA's W_uk [H, Dn, R], W_uv [H, R, Dv]
_WEIGHTS_FILE = "model.safetensors"
_CONFIG_FILE = "infire_config.json"


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    tokenizer: Tokenizer
    name: str
    # Host arrays by parameter path; None for `dummy:` models, whose weights are drawn on the device;
    # empty for a model restored from a checkpoint straight onto the devices (loaders/checkpoint.py).
    weights: Mapping[str, np.ndarray] | None
    random_seed: int = 0


class Placed(NamedTuple):
    """A model on the devices, as loaders/load.py's placing loaders return it."""

    loaded: LoadedModel  # weights empty when restored: they exist only on the devices
    graphdef: nnx.GraphDef
    state: nnx.State
    built_because: str | None  # None when restored from a checkpoint, else why it was (re)built


# A multimodal checkpoint's language-model prefixes (as published: `language_model.model.*`; as
# transformers 4.52 to 4.57 saved it: `model.language_model.*`), as the text model names its tensors,
# and its vision tower's and projector's, which a text model skips.
_LANGUAGE_MODEL = (("language_model.model.", "model."), ("model.language_model.", "model."),
                   ("language_model.lm_head.", "lm_head."))
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def rotating_as(placed: Placed, rope_scaling: RopeScaling | None) -> Placed:
    """`placed` rotating q and k by `rope_scaling` (LongRoPE's factors as the served context chooses
    them, config.served_rope) in its config and its modules' (the RoPE tables are computed from those
    in the step); the weights do not depend on it."""
    if placed.loaded.config.rope_scaling == rope_scaling:
        return placed
    model = nnx.merge(placed.graphdef, placed.state)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and isinstance(getattr(node, "cfg", None), ModelConfig):
            node.cfg = dataclasses.replace(node.cfg, rope_scaling=rope_scaling)
    graphdef, state = nnx.split(model)
    loaded = dataclasses.replace(placed.loaded, config=dataclasses.replace(placed.loaded.config,
                                                                           rope_scaling=rope_scaling))
    return placed._replace(loaded=loaded, graphdef=graphdef, state=state)


def language_model_name(name: str) -> str | None:
    """The text model's name of a checkpoint tensor (a text checkpoint's as it is); None for a
    multimodal checkpoint's vision tower and projector (Gemma 3's, Mistral 3's)."""
    if name.startswith(_VISION):
        return None
    for prefix, text in _LANGUAGE_MODEL:
        if name.startswith(prefix):
            return text + name[len(prefix):]
    return name


def stack_layers(per_layer: Mapping[str, list[np.ndarray | None]], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Stacks each per-layer weight along a leading layer axis, then fuses the projections."""
    stacked = {}
    for short, arrays in per_layer.items():
        missing = [i for i, a in enumerate(arrays) if a is None]
        if missing:
            raise UnsupportedModelError(f"weight {short!r} is missing for layers {missing}")
        stacked[short] = np.stack(arrays)
    return {f"layers.{k}": v for k, v in fuse_projections(stacked, cfg).items()}


def fuse_projections(w: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """wq/wk/wv -> wqkv [L, E, Hkv, G + 2, D] (bq/bk/bv likewise), w_gate/w_up -> w_gate_up [..., 2, F].

    The q heads of kv head j (j*G .. j*G + G - 1, the GQA grouping) sit beside j's k and v.
    """
    w = dict(w)
    hkv = cfg.num_kv_heads
    for names, fused in ((("wq", "wk", "wv"), "wqkv"), (("bq", "bk", "bv"), "bqkv")):
        present = [n for n in names if n in w]
        if not present:
            continue
        if len(present) != 3:
            raise UnsupportedModelError(f"the checkpoint has {present} but not all of {list(names)}")
        q, k, v = (w.pop(n) for n in names)
        q = q.reshape(*q.shape[:-2], hkv, q.shape[-2] // hkv, q.shape[-1])
        w[fused] = np.concatenate([q, k[..., None, :], v[..., None, :]], axis=-2)
    if ("w_gate" in w) != ("w_up" in w):
        raise UnsupportedModelError("the checkpoint has only one of the MLP's gate and up projections")
    if "w_gate" in w:
        w["w_gate_up"] = np.stack([w.pop("w_gate"), w.pop("w_up")], axis=-2)
    return w


def from_hf_layout(short: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """One layer weight from HF's (out, in) layout to ours (the layout the model's einsums take). Only
    output axes are split, never the input axis, so a quantized weight's parts `[out, n]` (n: its input
    axis in packed words, blocks or groups) take the same path as the weight itself; a wrong input
    width shows at placement (models/registry.py `build_state`)."""
    try:
        return _from_hf_layout(short, w, cfg)
    except ValueError as e:  # a reshape the config's head counts do not fit
        raise UnsupportedModelError(
            f"weight {short!r} has shape {w.shape}, which does not fit the config's {cfg.num_heads} attention heads, "
            f"{cfg.num_kv_heads} KV heads of {cfg.head_dim} and hidden size {cfg.hidden_size}") from e


def _from_hf_layout(short: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    e, hq, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rows = {"wq": hq * d, "wk": hkv * d, "wv": hkv * d, "wo": e}.get(short)
    if rows is not None and w.shape[0] != rows:  # the output axis, whole in a part too
        raise ValueError(f"{w.shape[0]} output rows, not {rows}")
    if short == "wq":
        return w.reshape(hq, d, -1).transpose(2, 0, 1)
    if short in ("wk", "wv"):
        return w.reshape(hkv, d, -1).transpose(2, 0, 1)
    if short == "wo":  # [E, Hq * n] -> [Hq, n, E]: a part's blocks never cross a head (its loader checks)
        return w.reshape(e, hq, -1).transpose(1, 2, 0)
    if short == "bq":
        return w.reshape(hq, d)
    if short in ("bk", "bv"):
        return w.reshape(hkv, d)
    if short in ("w_gate", "w_up", "w_down", "router"):
        return w.T
    return w


def is_native_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, _CONFIG_FILE))


def save_native(model: LoadedModel, path: str) -> None:
    """Writes the model in native form, atomically (a temp dir renamed into place)."""
    from safetensors.numpy import save_file

    tmp = f"{path}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in model.weights.items()}, os.path.join(tmp, _WEIGHTS_FILE))
    model.tokenizer.save(tmp)
    with open(os.path.join(tmp, _CONFIG_FILE), "w") as f:
        json.dump({"format_version": NATIVE_FORMAT_VERSION, "name": model.name,
                   "config": model.config.to_dict()}, f)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    try:
        os.rename(tmp, path)
    except OSError:  # another process won the race; keep its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _native_meta(path: str) -> dict:
    with open(os.path.join(path, _CONFIG_FILE)) as f:
        meta = json.load(f)
    if meta.get("format_version") != NATIVE_FORMAT_VERSION:
        raise UnsupportedModelError(f"{path} has native format {meta.get('format_version')}, "
                                    f"expected {NATIVE_FORMAT_VERSION}")
    return meta


def read_native_config(path: str) -> ModelConfig:
    return ModelConfig.from_dict(_native_meta(path)["config"])


def load_native(path: str) -> LoadedModel:
    from safetensors.numpy import load_file

    meta = _native_meta(path)
    return LoadedModel(config=ModelConfig.from_dict(meta["config"]), tokenizer=Tokenizer.from_dir(path),
                       name=meta["name"], weights=load_file(os.path.join(path, _WEIGHTS_FILE)))
