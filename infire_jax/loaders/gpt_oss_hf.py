"""HF checkpoints of gpt-oss (`GptOssForCausalLM`) -> the GptOss model's stacked weights (`layers.*`).

Per layer: q/k/v/o with biases, the sinks, the router [X, E] with its bias, and the experts:
`gate_up_proj` [X, E, 2F] with the gate and up columns interleaved (gate at even columns, as
transformers' `_apply_gate` reads them), here split into [X, E, 2, F], its bias [X, 2F] likewise, and
`down_proj` [X, F, E] with its bias [X, E]. The published checkpoints store the two expert weights as
MXFP4 (`*_blocks`, `*_scales`, loaders/mxfp4.py), dequantized here to bfloat16, exactly, or kept as
they are (`weights_quantization="checkpoint"`, loaders/gpt_oss_quant.py); a float checkpoint
(transformers' `save_pretrained` of a dequantized model) stores them plain.
"""

from __future__ import annotations

import re
from typing import Iterable

import numpy as np

from infire_jax.errors import UnsupportedModelError
from infire_jax.loaders.mxfp4 import dequantize_experts
from infire_jax.loaders.weights import from_hf_layout, stack_layers
from infire_jax.models.config import ModelConfig
from infire_jax.quant.mxfp4 import kept_from_hf

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_TOP = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
_PLAIN = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm",
          "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
          "self_attn.o_proj.weight": "wo", "self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk",
          "self_attn.v_proj.bias": "bv", "self_attn.o_proj.bias": "bo", "self_attn.sinks": "sinks",
          "mlp.router.weight": "router", "mlp.router.bias": "router_bias",
          "mlp.experts.gate_up_proj": "w_gate_up", "mlp.experts.gate_up_proj_bias": "b_gate_up",
          "mlp.experts.down_proj": "w_down", "mlp.experts.down_proj_bias": "b_down"}
_MXFP4 = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales)")


def split_gate_up(w: np.ndarray) -> np.ndarray:
    """[..., 2F] with gate and up interleaved -> [..., 2, F] (gate, then up)."""
    return np.swapaxes(w.reshape(*w.shape[:-1], w.shape[-1] // 2, 2), -1, -2)


def _convert(short: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """One HF layer tensor in our layout."""
    if short in ("w_gate_up", "b_gate_up"):
        return split_gate_up(w)
    if short in ("w_down", "b_down", "bo", "sinks", "router_bias", "attn_norm", "mlp_norm"):
        return w
    return from_hf_layout(short, w, cfg)


def gpt_oss_weights(tensors: Iterable[tuple[str, np.ndarray]], cfg: ModelConfig, keep_mxfp4: bool = False
                    ) -> dict[str, np.ndarray]:
    """Our parameter paths from the checkpoint's tensor names and arrays (float or MXFP4 experts; with
    `keep_mxfp4`, the MXFP4 ones as their kept parts "layers.w_gate_up.fp4", "....scale")."""
    per_layer: dict[str, list] = {}
    packed: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    weights: dict[str, np.ndarray] = {}
    for name, w in tensors:
        top = _TOP.get(name)
        m = _LAYER.fullmatch(name)
        if top is not None:
            if top != "lm_head" or not cfg.tie_word_embeddings:
                weights[top] = w
            continue
        if m is None or int(m.group(1)) >= cfg.num_layers:
            raise UnsupportedModelError(f"unexpected weight {name!r} for gpt-oss ({cfg.num_layers} layers)")
        layer, rest = int(m.group(1)), m.group(2)
        q = _MXFP4.fullmatch(rest)
        if q is not None:
            parts = packed.setdefault((layer, q.group(1)), {})
            parts[q.group(2)] = w
            if len(parts) < 2:
                continue
            del packed[(layer, q.group(1))]
            if keep_mxfp4:
                short = _PLAIN[f"mlp.experts.{q.group(1)}"]
                for part, a in kept_from_hf(q.group(1), parts["blocks"], parts["scales"]).items():
                    per_layer.setdefault(f"{short}.{part}", [None] * cfg.num_layers)[layer] = a
                continue
            rest, w = f"mlp.experts.{q.group(1)}", dequantize_experts(parts["blocks"], parts["scales"])
        short = _PLAIN.get(rest)
        if short is None:
            raise UnsupportedModelError(f"unexpected weight {name!r} in a gpt-oss layer")
        per_layer.setdefault(short, [None] * cfg.num_layers)[layer] = _convert(short, w, cfg)
    if packed:
        (layer, proj), parts = next(iter(packed.items()))
        raise UnsupportedModelError(f"layer {layer}'s MXFP4 {proj} has its {list(parts)} but not both "
                                    f"blocks and scales")
    weights.update(stack_layers(per_layer, cfg))
    return weights

