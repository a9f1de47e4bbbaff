"""HF checkpoints of Gemma 3 -> the Gemma3 model's stacked weights (`layers.*`).

Text checkpoints (`Gemma3ForCausalLM`: `model.layers.*`) and the multimodal ones' language model
(`Gemma3ForConditionalGeneration`: loaders/weights.py `language_model_name`). The vision tower and its
projector are skipped here: the engine reads them apart to serve images (loaders/vision.py).
Every norm weight is stored as 1 + w, the factor Gemma's RMSNorm multiplies by (models/gemma3.py).
Only output axes move, so a kept 8-bit weight's scales take the weights' path (loaders/kept_8bit.py).
"""

from __future__ import annotations

import re
from typing import Iterable

import numpy as np

from infire_jax.errors import UnsupportedModelError
from infire_jax.loaders.weights import from_hf_layout, language_model_name, stack_layers
from infire_jax.models.config import ModelConfig

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_TOP = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
_PER_LAYER = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "post_attn_norm",
              "pre_feedforward_layernorm.weight": "mlp_norm", "post_feedforward_layernorm.weight": "post_mlp_norm",
              "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
              "self_attn.o_proj.weight": "wo", "self_attn.q_norm.weight": "q_norm",
              "self_attn.k_norm.weight": "k_norm", "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up",
              "mlp.down_proj.weight": "w_down"}
# A linear module's stacked weight (`linear_targets`), by the module's name in its layer.
_LINEAR = {"self_attn.q_proj": "wqkv", "self_attn.k_proj": "wqkv", "self_attn.v_proj": "wqkv", "self_attn.o_proj": "wo",
           "mlp.gate_proj": "w_gate_up", "mlp.up_proj": "w_gate_up", "mlp.down_proj": "w_down"}
NORMS = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "q_norm", "k_norm", "final_norm")


def gemma_norm(w: np.ndarray) -> np.ndarray:
    """1 + w, added in float32 as Gemma's RMSNorm adds it."""
    return w.astype(np.float32) + 1.0


def linear_targets(module: str, cfg: ModelConfig) -> tuple[str, ...]:
    """The stacked weight ("layers.wqkv", ...) that HF linear module `module` (no `.weight`) is part of; ()
    for anything else (the head, the vision tower)."""
    name = language_model_name(f"{module}.weight")
    m = _LAYER.fullmatch(name) if name else None
    short = _LINEAR.get(m.group(2).removesuffix(".weight")) if m and int(m.group(1)) < cfg.num_layers else None
    return (f"layers.{short}",) if short else ()


def gemma3_weights(tensors: Iterable[tuple[str, np.ndarray]], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our parameter paths from the checkpoint's tensor names and float arrays."""
    per_layer: dict[str, list] = {}
    weights: dict[str, np.ndarray] = {}
    for raw, w in tensors:
        name = language_model_name(raw)
        if name is None:
            continue
        top = _TOP.get(name)
        if top is not None:
            if top != "lm_head" or not cfg.tie_word_embeddings:
                weights[top] = gemma_norm(w) if top in NORMS else w
            continue
        m = _LAYER.fullmatch(name)
        short = _PER_LAYER.get(m.group(2)) if m else None
        if short is None or int(m.group(1)) >= cfg.num_layers:
            raise UnsupportedModelError(f"unexpected weight {raw!r} for Gemma 3 ({cfg.num_layers} layers)")
        w = gemma_norm(w) if short in NORMS else from_hf_layout(short, w, cfg)
        per_layer.setdefault(short, [None] * cfg.num_layers)[int(m.group(1))] = w
    weights.update(stack_layers(per_layer, cfg))
    return weights
