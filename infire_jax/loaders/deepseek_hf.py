"""HF checkpoints of the DeepSeek-V3 family -> the DeepseekV3 model's stacked weights; and of GLM-4.5
and MiniMax-M2 (their MoE is DeepSeek-V3's, their attention GQA) -> the Glm4Moe model's.

DeepSeek-V3 and Kimi K2 name their weights `model.layers.N...`; Kimi K2.5 prefixes its language
model with `language_model.` and carries a vision tower and projector, which a text model skips.
Multi-token-prediction layers (index >= num_hidden_layers, HF ignores them too) are skipped; MTP
speculative decoding reads its layer with `layer_weights` (speculative/mtp_loader.py).

With `rope_interleave` (HF's default for this family) the rotary part of q and k_pe comes out of
the projections in interleaved pairs (x0, x1), (x2, x3), ...; HF's rotation returns it as
(evens, odds). Permuting the output columns of q_b and kv_a the same way at load makes our
"rotate half" rope produce exactly HF's result, with no runtime shuffle.

The conversion moves only output axes and never assumes an input width, so a quantized weight's
parts (`[out, in / k]`: int4 words, group scales) go through it as the weight does
(loaders/deepseek_quant.py).
"""

from __future__ import annotations

import json
import os
import re
from typing import Iterable

import numpy as np

from infire_jax.errors import UnsupportedModelError
from infire_jax.loaders.weights import from_hf_layout, fuse_projections
from infire_jax.models.config import ModelConfig
from infire_jax.models.deepseek_config import text_config

_LAYER = re.compile(r"(?:language_model\.)?model\.layers\.(\d+)\.(.+)")
# Experts, DeepSeek-V3's and GLM-4.5's names, and MiniMax-M2's (Mixtral's w1 / w3 / w2).
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_SKIPPED = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
_TOP = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
_NORMS = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm",
          "self_attn.q_a_layernorm.weight": "q_a_norm", "self_attn.kv_a_layernorm.weight": "kv_a_norm",
          "mlp.gate.e_score_correction_bias": "router_bias", "block_sparse_moe.e_score_correction_bias": "router_bias"}
_MLP = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_GQA = {"self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
        "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk", "self_attn.v_proj.bias": "bv",
        "self_attn.o_proj.weight": "wo", "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}


def deinterleave(n: int) -> np.ndarray:
    """Column order (0, 2, 4, ..., 1, 3, 5, ...) of an interleaved rotary block of width n."""
    return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])


def _convert(rest: str, w: np.ndarray, cfg: ModelConfig, interleaved: bool, layer: dict) -> None:
    """One HF layer tensor into `layer` under our name (experts by (index, part)): MLA's attention
    (DeepSeek-V3) or GQA's (GLM-4.5, MiniMax-M2: `_convert_gqa`), and DeepSeek-V3's MoE, which all have."""
    em = _EXPERT.fullmatch(rest)
    if rest in _NORMS:
        layer[_NORMS[rest]] = w
    elif em:
        layer.setdefault("experts", {})[(int(em.group(1)), _MLP[em.group(2)])] = w.T
    elif rest in ("mlp.gate.weight", "block_sparse_moe.gate.weight"):
        layer["router"] = w.T
    elif rest.startswith(("mlp.shared_experts.", "mlp.")) and rest.endswith(".weight") \
            and rest.split(".")[-2] in _MLP:
        prefix = "shared_" if rest.startswith("mlp.shared_experts.") else ""
        layer[f"{prefix}{_MLP[rest.split('.')[-2]]}"] = w.T
    elif cfg.mla is None:
        _convert_gqa(rest, w, cfg, layer)
    else:
        _convert_mla(rest, w, cfg, interleaved, layer)


def _convert_gqa(rest: str, w: np.ndarray, cfg: ModelConfig, layer: dict) -> None:
    """GLM-4.5's and MiniMax-M2's attention tensors, in models/llama.py's layouts (fused into q/k/v by
    `_finish`)."""
    short = _GQA.get(rest)
    if short is None:
        raise UnsupportedModelError(f"unexpected weight {rest!r} in a {cfg.architecture} layer")
    layer[short] = from_hf_layout(short, w, cfg)


def _convert_mla(rest: str, w: np.ndarray, cfg: ModelConfig, interleaved: bool, layer: dict) -> None:
    m, h = cfg.mla, cfg.num_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    rope = deinterleave(m.qk_rope_head_dim) if interleaved else np.arange(m.qk_rope_head_dim)
    if rest == "self_attn.q_b_proj.weight":
        q = w.reshape(h, qk, -1)
        q = np.concatenate([q[:, :m.qk_nope_head_dim], q[:, m.qk_nope_head_dim:][:, rope]], axis=1)
        layer["wq_b"] = q.transpose(2, 0, 1)
    elif rest == "self_attn.q_a_proj.weight":
        layer["wq_a"] = w.T
    elif rest == "self_attn.kv_a_proj_with_mqa.weight":
        layer["wkv_a"] = np.concatenate([w[:m.kv_lora_rank], w[m.kv_lora_rank:][rope]]).T
    elif rest == "self_attn.kv_b_proj.weight":
        kv = w.reshape(h, m.qk_nope_head_dim + m.v_head_dim, -1)
        layer["w_uk"] = kv[:, :m.qk_nope_head_dim]
        layer["w_uv"] = kv[:, m.qk_nope_head_dim:].transpose(0, 2, 1)
    elif rest == "self_attn.o_proj.weight":
        layer["wo"] = w.reshape(w.shape[0], h, -1).transpose(1, 2, 0)
    else:
        raise UnsupportedModelError(f"unexpected weight {rest!r} in a DeepSeek-V3 layer")


_LINEAR = {"self_attn.q_proj": ("wqkv",), "self_attn.k_proj": ("wqkv",), "self_attn.v_proj": ("wqkv",),  # GQA's
           "self_attn.q_a_proj": ("wq_a",), "self_attn.q_b_proj": ("wq_b",),
           "self_attn.kv_a_proj_with_mqa": ("wkv_a",), "self_attn.kv_b_proj": ("w_uk", "w_uv"),
           "self_attn.o_proj": ("wo",), "mlp.gate_proj": ("w_gate_up",), "mlp.up_proj": ("w_gate_up",),
           "mlp.down_proj": ("w_down",), "mlp.shared_experts.gate_proj": ("w_shared_gate_up",),
           "mlp.shared_experts.up_proj": ("w_shared_gate_up",), "mlp.shared_experts.down_proj": ("w_shared_down",)}


def linear_targets(module: str, cfg: ModelConfig) -> tuple[str, ...]:
    """The stacked weights ("moe_layers.w_gate_up", ...) that HF linear module `module` (no `.weight`)
    is part of; () for anything else (top-level tensors, skipped layers and towers)."""
    m = _LAYER.fullmatch(f"{module}.weight")
    if m is None or int(m.group(1)) >= cfg.num_layers:
        return ()
    stack = "dense_layers" if int(m.group(1)) < cfg.deepseek_moe.first_k_dense_replace else "moe_layers"
    em = _EXPERT.fullmatch(m.group(2))
    shorts = (("w_down" if _MLP[em.group(2)] == "down" else "w_gate_up",) if em
              else _LINEAR.get(m.group(2).removesuffix(".weight"), ()))
    return tuple(f"{stack}.{s}" for s in shorts)


def _finish(i: int, layer: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Fuses gate/up pairs (and a GQA layer's q/k/v) and stacks the experts of one layer."""
    out = {k: v for k, v in layer.items() if k not in ("experts", "gate", "up", "down", "shared_gate",
                                                       "shared_up", "shared_down")}
    for prefix, name in (("", "w_gate_up"), ("shared_", "w_shared_gate_up")):
        if f"{prefix}gate" in layer:
            out[name] = np.stack([layer[f"{prefix}gate"], layer[f"{prefix}up"]], axis=-2)
            out[name.replace("gate_up", "down")] = layer[f"{prefix}down"]
    if "experts" in layer:
        got = layer["experts"]
        for j in range(cfg.num_experts):
            for part in ("gate", "up", "down"):
                if (j, part) not in got:
                    raise UnsupportedModelError(f"expert {j}'s {part}_proj is missing in layer {i}")
        out["w_gate_up"] = np.stack([np.stack([got[j, "gate"], got[j, "up"]], axis=-2) for j in range(cfg.num_experts)])
        out["w_down"] = np.stack([got[j, "down"] for j in range(cfg.num_experts)])
    return fuse_projections(out, cfg)


def layer_weights(tensors: Iterable[tuple[str, np.ndarray]], cfg: ModelConfig, interleaved: bool,
                  index: int) -> dict[str, np.ndarray]:
    """One decoder layer's tensors (HF names inside the layer, `self_attn.*`, `mlp.*`, ...) as a layer of our
    stacks, unstacked: the multi-token-prediction layer's (speculative/mtp_loader.py)."""
    layer: dict = {}
    for rest, w in tensors:
        _convert(rest, w, cfg, interleaved, layer)
    return _finish(index, layer, cfg)


def deepseek_weights(tensors: Iterable[tuple[str, np.ndarray]], cfg: ModelConfig,
                     interleaved: bool) -> dict[str, np.ndarray]:
    """Our parameter paths (`dense_layers.*`, `moe_layers.*`, ...) from HF tensor names and arrays."""
    layers: list[dict] = [{} for _ in range(cfg.num_layers)]
    weights: dict[str, np.ndarray] = {}
    for name, w in tensors:
        if name.startswith(_SKIPPED) or name.endswith("rotary_emb.inv_freq"):
            continue
        top = _TOP.get(name.removeprefix("language_model."))
        m = _LAYER.fullmatch(name)
        if top is not None:
            if top != "lm_head" or not cfg.tie_word_embeddings:
                weights[top] = w
        elif m:
            if int(m.group(1)) < cfg.num_layers:  # beyond: multi-token-prediction layers
                _convert(m.group(2), w, cfg, interleaved, layers[int(m.group(1))])
        else:
            raise UnsupportedModelError(f"unexpected weight {name!r}")
    dense = cfg.deepseek_moe.first_k_dense_replace
    per_layer = [_finish(i, layer, cfg) for i, layer in enumerate(layers)]
    for stack, part in (("dense_layers", per_layer[:dense]), ("moe_layers", per_layer[dense:])):
        if not part:
            continue
        names = set().union(*part)
        for key in sorted(names):
            missing = [dense * (stack == "moe_layers") + i for i, p in enumerate(part) if key not in p]
            if missing:
                raise UnsupportedModelError(f"weight {key!r} is missing for layers {missing}")
            weights[f"{stack}.{key}"] = np.stack([p[key] for p in part])
    return weights


def rope_interleaved(path: str) -> bool:
    """HF's `rope_interleave` of the checkpoint at `path` (default true for this family)."""
    with open(os.path.join(path, "config.json")) as f:
        return bool(text_config(json.load(f)).get("rope_interleave", True))
