"""HF model directories: `config.json`, `*.safetensors` (float, or a quantized scheme that
loaders/hf_quantized.py reads), `tokenizer.json`."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from typing import Callable, Iterable, Iterator

import jax
import ml_dtypes
import numpy as np
import safetensors
from safetensors import safe_open

from infire_jax.errors import ModelNotFoundError, UnsupportedModelError
from infire_jax.loaders.deepseek_hf import deepseek_weights, rope_interleaved
from infire_jax.loaders.gemma3_hf import gemma3_weights
from infire_jax.loaders.gemma4_hf import gemma4_weights
from infire_jax.loaders.qwen3_5_hf import qwen3_5_weights
from infire_jax.loaders.gpt_oss_hf import gpt_oss_weights
from infire_jax.loaders.hf_quantized import dequantized, quant_scheme
from infire_jax.loaders.kv_scales_hf import is_kv_scale
from infire_jax.loaders.llama4_hf import llama4_weights
from infire_jax.loaders.weights import LoadedModel, from_hf_layout, language_model_name, stack_layers
from infire_jax.models.config import ModelConfig
from infire_jax.models.hf_config import config_from_hf
from infire_jax.loaders.tokenizer import Tokenizer

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")

_DENSE = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "self_attn.q_proj.bias": "bq",
    "self_attn.k_proj.bias": "bk",
    "self_attn.v_proj.bias": "bv",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
    "block_sparse_moe.gate.weight": "router",
    "mlp.gate.weight": "router",
}
# Phi-3 / Phi-4's fused projections: q, k, v rows of one weight, and gate then up rows of another.
_FUSED = {"self_attn.qkv_proj.weight": ("wq", "wk", "wv"), "mlp.gate_up_proj.weight": ("w_gate", "w_up")}
# Expert projections: Mixtral's w1/w3/w2 and Qwen3-MoE's gate/up/down.
_EXPERT_NAMES = {"w1": "w_gate", "gate_proj": "w_gate", "w3": "w_up", "up_proj": "w_up",
                 "w2": "w_down", "down_proj": "w_down"}


def _read_safetensors(path: str, keep: Callable[[str], bool] | None = None):
    """Yields (name, array) from a safetensors file (only the names `keep` accepts, if given); bf16
    comes back as ml_dtypes bfloat16. The numpy and flax readers have no fp8 dtype, so fp8 tensors
    (DeepSeek-V3's weights) come from safetensors' raw views, after the others."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]), safe_open(path, framework="flax") as f:
        names = [n for n in f.keys() if keep is None or keep(n)]
        fp8 = {n for n in names if f.get_slice(n).get_dtype() == "F8_E4M3"}
        for name in names:
            if name not in fp8:
                yield name, np.asarray(f.get_tensor(name))
    if fp8:
        with open(path, "rb") as raw:
            views = safetensors.deserialize(raw.read())
        for name, view in views:
            if name in fp8:
                yield name, np.frombuffer(view["data"], ml_dtypes.float8_e4m3fn).reshape(view["shape"])


def checkpoint_tensors(path: str, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the directory's `*.safetensors` files (or those `keep` accepts), file by file."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelNotFoundError(f"{path} has no *.safetensors weights")
    for file in files:
        yield from _read_safetensors(file, keep)


def read_hf_config(path: str) -> ModelConfig:
    """config.json, with generation_config.json's eos ids added (Llama 3 lists several there)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelNotFoundError(f"{path} has no config.json")
    with open(cfg_path) as f:
        try:
            hf = json.load(f)
        except ValueError as e:
            raise UnsupportedModelError(f"{cfg_path} is not valid JSON: {e}") from e
    if not isinstance(hf, dict):
        raise UnsupportedModelError(f"{cfg_path} must hold a JSON object")
    cfg = config_from_hf(hf)
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        extra = [eos] if isinstance(eos, int) else list(eos or [])
        cfg = dataclasses.replace(cfg, eos_token_ids=tuple(dict.fromkeys([*cfg.eos_token_ids, *extra])))
    return cfg


def load_hf_dir(path: str) -> LoadedModel:
    cfg = read_hf_config(path)
    if not glob.glob(os.path.join(path, "*.safetensors")):
        raise ModelNotFoundError(f"{path} has no *.safetensors weights")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ModelNotFoundError(f"{path} has no tokenizer.json")

    with open(os.path.join(path, "config.json")) as f:
        scheme = None if cfg.gpt_oss is not None else quant_scheme(json.load(f))  # gpt-oss: MXFP4 experts
    tensors = dequantized(checkpoint_tensors(path), scheme)
    if cfg.mla is not None:  # the DeepSeek-V3 family
        weights = deepseek_weights(tensors, cfg, rope_interleaved(path))
    elif cfg.glm4 is not None:  # DeepSeek-V3's MoE, GQA attention
        weights = deepseek_weights(tensors, cfg, False)
    elif cfg.gpt_oss is not None:
        weights = gpt_oss_weights(tensors, cfg)
    elif cfg.llama4 is not None:
        weights = llama4_weights(tensors, cfg)
    elif cfg.gemma3 is not None:
        weights = gemma3_weights(tensors, cfg)
    elif cfg.gemma4 is not None:
        weights = gemma4_weights(tensors, cfg)
    elif cfg.gated_delta is not None:
        weights = qwen3_5_weights(tensors, cfg)
    else:
        weights = llama_weights(tensors, cfg)
    return LoadedModel(config=cfg, tokenizer=Tokenizer.from_dir(path), name=os.path.basename(os.path.normpath(path)),
                       weights=weights)


def layer_weight(name: str, cfg: ModelConfig) -> tuple[int, str] | None:
    """(layer, model weight name) of a dense layer's HF tensor ("model.layers.3.mlp.up_proj.weight"
    -> (3, "w_up")); None for any other tensor."""
    m = _LAYER.fullmatch(name)
    if m is None or (cfg.is_moe and _EXPERT.fullmatch(m.group(2))):
        return None
    short = _DENSE.get(m.group(2))
    return (int(m.group(1)), short) if short else None


def expert_weight(name: str, cfg: ModelConfig) -> tuple[int, int, str] | None:
    """(layer, expert, model weight name) of a MoE layer's expert tensor ("model.layers.3.mlp.experts.7
    .up_proj.weight" -> (3, 7, "w_up"); Mixtral's w1 / w3 / w2 alike); None for any other tensor."""
    m = _LAYER.fullmatch(name)
    em = _EXPERT.fullmatch(m.group(2)) if m and cfg.is_moe else None
    short = _EXPERT_NAMES.get(em.group(2)) if em else None
    return (int(m.group(1)), int(em.group(1)), short) if short else None


def _fused_rows(name: str, cfg: ModelConfig) -> list[int]:
    """Where each member of a fused Phi-3 weight ends, in rows (HF's (out, in) layout)."""
    if name == "mlp.gate_up_proj.weight":
        return [cfg.intermediate_size, 2 * cfg.intermediate_size]
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [q, q + kv, q + 2 * kv]


def llama_weights(tensors: Iterable[tuple[str, np.ndarray]], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """A Llama-architecture checkpoint's float tensors as the model's weights (stacked, fused)."""
    n, x = cfg.num_layers, cfg.num_experts
    per_layer: dict[str, list] = {}
    experts: dict[str, list[list]] = {}
    weights: dict[str, np.ndarray] = {}
    for raw, w in tensors:
        name = language_model_name(raw)  # a multimodal checkpoint's text weights (Mistral 3); no vision tower
        if name is None or is_kv_scale(name):  # fp8 KV-cache scales: read by the engine, not model weights
            continue
        m = _LAYER.fullmatch(name)
        if m:
            layer, rest = int(m.group(1)), m.group(2)
            em = _EXPERT.fullmatch(rest)
            if em and cfg.is_moe:
                short = _EXPERT_NAMES[em.group(2)]
                experts.setdefault(short, [[None] * x for _ in range(n)])[layer][int(em.group(1))] = w.T
                continue
            if rest in _FUSED:
                for short, part in zip(_FUSED[rest], np.split(w, _fused_rows(rest, cfg)[:-1], axis=0)):
                    per_layer.setdefault(short, [None] * n)[layer] = from_hf_layout(short, part, cfg)
                continue
            short = _DENSE.get(rest)
            if short is None:
                if rest.endswith("rotary_emb.inv_freq"):
                    continue
                raise UnsupportedModelError(f"unexpected weight {name!r} for {cfg.architecture}")
            per_layer.setdefault(short, [None] * n)[layer] = from_hf_layout(short, w, cfg)
        elif name == "model.embed_tokens.weight":
            weights["embed"] = w
        elif name == "model.norm.weight":
            weights["final_norm"] = w
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                weights["lm_head"] = w  # [V, E], as the embedding
        else:
            raise UnsupportedModelError(f"unexpected weight {name!r}")
    for short, by_layer in experts.items():
        for i, layer in enumerate(by_layer):
            if any(w is None for w in layer):
                raise UnsupportedModelError(f"expert weights {short!r} are incomplete in layer {i}")
        per_layer[short] = [np.stack(layer) for layer in by_layer]
    weights.update(stack_layers(per_layer, cfg))
    return weights
