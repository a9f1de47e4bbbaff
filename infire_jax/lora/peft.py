"""A PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`), read and
checked against the base model's config (host, numpy; no jax).

PEFT computes a module's output as `base(x) + scale * B(A(x))`, A [r, in], B [out, r], with
`scale = lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`). Adapted modules are the
decoder's projections, by their HF names: q/k/v/o_proj, gate/up/down_proj, and the fused
qkv_proj and gate_up_proj (one A shared by the members, B's rows q, k, v or gate, up in order).
A mixture-of-experts model's MLP has no dense projections: its adapters adapt attention only.
Everything else PEFT can save is refused by name, never half-applied: `modules_to_save`, DoRA,
biases, per-module ranks or alphas, embedding or LM-head adapters, a rank above the engine's
`max_lora_rank`, a module the model lacks, a tensor of the wrong shape, a damaged file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re

import ml_dtypes
import numpy as np
import safetensors

from infire_jax.errors import InvalidRequestError
from infire_jax.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
MLP = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
_TENSOR = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
# adapter_config.json fields that change what the adapter computes, with the value that means "not used".
_UNSUPPORTED = {"modules_to_save": None, "use_dora": False, "bias": "none", "lora_bias": False,
                "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {}, "layer_replication": None,
                "target_parameters": None, "trainable_token_indices": None, "use_qalora": False,
                "alora_invocation_tokens": None, "arrow_config": None, "use_bdlora": None, "kasa_config": None,
                "monteclora_config": None}


class AdapterNotFoundError(InvalidRequestError):
    """No adapter at the path, or no adapter by that name (the server answers 404)."""


@dataclasses.dataclass(frozen=True)
class PeftAdapter:
    """An adapter's tensors in PEFT's layout, float32: (layer, module) -> (A [r, in], B [out, r])."""

    path: str
    rank: int
    scale: float  # PEFT's scaling, applied to B's output
    modules: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    digest: str  # of the config and weights files: what the adapter computes, for the prefix cache

    @property
    def module_names(self) -> set[str]:
        return {m for _, m in self.modules}


def model_modules(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """The modules an adapter may adapt on this model: name -> (parent, in features, out features)."""
    e, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    out = {"q_proj": ("self_attn", e, hq * d), "k_proj": ("self_attn", e, hkv * d),
           "v_proj": ("self_attn", e, hkv * d), "o_proj": ("self_attn", hq * d, e),
           "qkv_proj": ("self_attn", e, (hq + 2 * hkv) * d)}
    if not cfg.is_moe:
        f = cfg.intermediate_size
        out |= {"gate_proj": ("mlp", e, f), "up_proj": ("mlp", e, f), "down_proj": ("mlp", f, e),
                "gate_up_proj": ("mlp", e, 2 * f)}
    return out


def _lacks(name: str, cfg: ModelConfig) -> str:
    if name in MLP and cfg.is_moe:
        return (f"this model ({cfg.architecture}) has no dense {name}: its MLP is a mixture of experts, so "
                f"its adapters may adapt attention only ({', '.join(ATTENTION)})")
    return (f"LoRA adapters may adapt {', '.join(model_modules(cfg))} on this model; {name!r} is not one of "
            f"them (embedding, LM-head and expert adapters are not supported)")


def _fail(path: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {path}: {message}", param="lora_path")


def _read_config(path: str, raw: bytes) -> dict:
    try:
        config = json.loads(raw)
    except ValueError as e:
        raise _fail(path, f"{CONFIG_FILE} is not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise _fail(path, f"{CONFIG_FILE} must hold a JSON object")
    return config


def _check_config(path: str, config: dict, cfg: ModelConfig, max_rank: int) -> tuple[int, float]:
    """(rank, scale) of a supported config; raises naming the first field that is not supported."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _fail(path, f"peft_type {peft_type!r} is not supported (only LORA)")
    for field, unused in _UNSUPPORTED.items():
        value = config.get(field, unused)
        if value != unused and value not in (None, [], {}, False):
            raise _fail(path, f"{field}={value!r} is not supported")
    r, alpha, rslora = config.get("r"), config.get("lora_alpha", 8), config.get("use_rslora", False)  # PEFT's defaults
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _fail(path, f"r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _fail(path, f"lora_alpha must be a number, got {alpha!r}")
    if not isinstance(rslora, bool):
        raise _fail(path, f"use_rslora must be true or false, got {rslora!r}")
    if r > max_rank:
        raise _fail(path, f"its rank {r} is above the engine's max_lora_rank ({max_rank}); start the engine "
                          f"with --max-lora-rank {r} or more")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        known = model_modules(cfg)
        for t in targets:
            name = str(t).rsplit(".", 1)[-1]
            if name not in known:
                raise _fail(path, f"target_modules names {t!r}: {_lacks(name, cfg)}")
    elif targets is not None and not isinstance(targets, str):  # a str is PEFT's regex or "all-linear"
        raise _fail(path, f"target_modules must be a list or a string, got {targets!r}")
    return r, alpha / (math.sqrt(r) if rslora else r)


def _tensors(path: str, raw: bytes) -> dict[str, np.ndarray]:
    try:
        views = safetensors.deserialize(raw)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types on a damaged file
        raise _fail(path, f"{WEIGHTS_FILE} is not a readable safetensors file ({e})") from e
    out = {}
    for name, view in views:
        dtype = _DTYPES.get(view["dtype"])
        if dtype is None:
            raise _fail(path, f"tensor {name} has dtype {view['dtype']}; LoRA weights must be F32, F16, BF16 or F64")
        out[name] = np.frombuffer(view["data"], dtype).reshape(view["shape"]).astype(np.float32)
    return out


def _modules(path: str, tensors: dict[str, np.ndarray], cfg: ModelConfig, rank: int
             ) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    known = model_modules(cfg)
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, w in tensors.items():
        m = _TENSOR.fullmatch(name)
        if m is None:
            raise _fail(path, f"tensor {name} adapts a module other than the decoder's projections: "
                              f"{_lacks(name.split('.lora_')[0].rsplit('.', 1)[-1], cfg)}")
        layer, parent, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if module not in known or known[module][0] != parent:
            raise _fail(path, f"tensor {name}: {_lacks(module, cfg)}")
        if layer >= cfg.num_layers:
            raise _fail(path, f"tensor {name} adapts layer {layer}, but the model has {cfg.num_layers} layers")
        parts.setdefault((layer, module), {})[ab] = w
    if not parts:
        raise _fail(path, f"{WEIGHTS_FILE} holds no LoRA tensors")
    modules = {}
    for (layer, module), ab in sorted(parts.items()):
        _, fan_in, fan_out = known[module]
        where = f"layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise _fail(path, f"{where} has lora_{''.join(ab)} but not lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise _fail(path, f"{where}: lora_A is {list(a.shape)} and lora_B {list(b.shape)}, but rank {rank} on "
                              f"this model needs [{rank}, {fan_in}] and [{fan_out}, {rank}]")
        modules[layer, module] = (a, b)
    fused = {m for _, m in modules} & {"qkv_proj", "gate_up_proj"}
    for f in fused:
        members = ("q_proj", "k_proj", "v_proj") if f == "qkv_proj" else ("gate_proj", "up_proj")
        both = {m for _, m in modules} & set(members)
        if both:
            raise _fail(path, f"it adapts both {f} and {sorted(both)}, which overlap")
    return modules


def read_adapter(path: str, cfg: ModelConfig, max_rank: int) -> PeftAdapter:
    """The adapter at `path`, checked against `cfg` (the checkpoint's config) and `max_rank`.

    Raises AdapterNotFoundError when there is no adapter there, InvalidRequestError naming the
    problem otherwise."""
    config_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(config_path):
        raise AdapterNotFoundError(f"no LoRA adapter at {path!r}: {CONFIG_FILE} not found", param="lora_path")
    if not os.path.isfile(weights_path):
        other = [f for f in ("adapter_model.bin", "adapter_model.pt") if os.path.isfile(os.path.join(path, f))]
        if other:
            raise _fail(path, f"{other[0]} is a pickle; only {WEIGHTS_FILE} is read (save with safe_serialization)")
        raise AdapterNotFoundError(f"no LoRA adapter at {path!r}: {WEIGHTS_FILE} not found", param="lora_path")
    with open(config_path, "rb") as f:
        raw_config = f.read()
    with open(weights_path, "rb") as f:
        raw_weights = f.read()
    rank, scale = _check_config(path, _read_config(path, raw_config), cfg, max_rank)
    modules = _modules(path, _tensors(path, raw_weights), cfg, rank)
    digest = hashlib.sha256(hashlib.sha256(raw_config).digest() + raw_weights).hexdigest()[:32]
    return PeftAdapter(path, rank, scale, modules, digest)
