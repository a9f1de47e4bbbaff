"""HF checkpoints of Qwen3.5 -> the Qwen3_5 model's two layer stacks (models/qwen3_5.py).

Text checkpoints (`Qwen3_5ForCausalLM`: `model.layers.*`) and the multimodal ones' language model
(`Qwen3_5ForConditionalGeneration`: `model.language_model.*`, loaders/weights.py `language_model_name`);
the vision tower (`model.visual.*`) and the multi-token-prediction layer (`mtp.*`) are skipped. Layer i
goes to the attention stack (its index there: i // interval) when it attends, else to the linear stack.
Every RMSNorm weight but the DeltaNet's gated norm is stored as 1 + w, the factor Qwen3.5's multiplies by.
"""

from __future__ import annotations

import re
from typing import Iterable

import numpy as np

from infire_jax.errors import UnsupportedModelError
from infire_jax.loaders.gemma3_hf import gemma_norm
from infire_jax.loaders.weights import language_model_name
from infire_jax.models.config import ModelConfig

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_TOP = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
_SKIPPED = ("model.visual.", "mtp.")
_SHARED = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm",
           "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down"}
_ATTENTION = {"self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
              "self_attn.o_proj.weight": "wo", "self_attn.q_norm.weight": "q_norm",
              "self_attn.k_norm.weight": "k_norm"}
_LINEAR = {"linear_attn.in_proj_qkv.weight": "w_qkv", "linear_attn.in_proj_z.weight": "w_z",
           "linear_attn.in_proj_b.weight": "w_b", "linear_attn.in_proj_a.weight": "w_a",
           "linear_attn.conv1d.weight": "conv", "linear_attn.dt_bias": "dt_bias", "linear_attn.A_log": "a_log",
           "linear_attn.norm.weight": "norm", "linear_attn.out_proj.weight": "w_out"}
_ONE_PLUS_W = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm")


def _layout(short: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """One layer weight from HF's (out, in) layout to the model's."""
    e, h, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if short in _ONE_PLUS_W:
        return gemma_norm(w)
    if short == "wq":  # per head: D rows of q, then D of its gate
        return w.reshape(h, 2, d, e).transpose(3, 0, 1, 2)
    if short in ("wk", "wv"):
        return w.reshape(hkv, d, e).transpose(2, 0, 1)
    if short == "wo":
        return w.reshape(e, h, d).transpose(1, 2, 0)
    if short == "conv":  # [C, 1, K] -> [K, C]
        return w[:, 0, :].T
    if w.ndim == 2:  # the other projections: [out, in] -> [in, out]
        return w.T
    return w


def qwen3_5_weights(tensors: Iterable[tuple[str, np.ndarray]], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our parameter paths from the checkpoint's tensor names and float arrays."""
    interval = cfg.gated_delta.interval
    stacks = {"attention_layers": [dict() for _ in range(cfg.num_kv_layers)],
              "linear_layers": [dict() for _ in range(cfg.num_linear_layers)]}
    weights: dict[str, np.ndarray] = {}
    for raw, w in tensors:
        if raw.startswith(_SKIPPED):
            continue
        name = language_model_name(raw)
        top = _TOP.get(name or "")
        if top is not None:
            if top != "lm_head" or not cfg.tie_word_embeddings:
                weights[top] = gemma_norm(w) if top == "final_norm" else w
            continue
        m = _LAYER.fullmatch(name or "")
        i = int(m.group(1)) if m else cfg.num_layers
        attends = (i + 1) % interval == 0
        short = _SHARED.get(m.group(2)) or (_ATTENTION if attends else _LINEAR).get(m.group(2)) if m else None
        if short is None or i >= cfg.num_layers:
            raise UnsupportedModelError(f"unexpected weight {raw!r} for Qwen3.5 ({cfg.num_layers} layers)")
        stack = "attention_layers" if attends else "linear_layers"
        stacks[stack][i // interval if attends else i - i // interval][short] = _layout(short, w, cfg)
    for stack, layers in stacks.items():
        names = set().union(*layers)
        for short in sorted(names):
            missing = [j for j, layer in enumerate(layers) if short not in layer]
            if missing:
                raise UnsupportedModelError(f"weight {short!r} is missing for {stack} {missing}")
            weights[f"{stack}.{short}"] = np.stack([layer[short] for layer in layers])
        if {"w_gate", "w_up"} <= names:
            weights[f"{stack}.w_gate_up"] = np.stack([weights.pop(f"{stack}.w_gate"),
                                                      weights.pop(f"{stack}.w_up")], axis=-2)
    return weights
