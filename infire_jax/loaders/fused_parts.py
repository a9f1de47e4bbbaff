"""A Llama-architecture layer weight kept quantized as parts (GGUF blocks, GPTQ / AWQ groups, int8
rows): which checkpoint weights each fused weight is made of, the path a part takes into the
model's layout, and placing the parts. Shared by loaders/gguf_quant.py and loaders/llama_quant.py.
"""

from __future__ import annotations

import numpy as np

from infire_jax.loaders.weights import LoadedModel, Placed
from infire_jax.models.config import ModelConfig
from infire_jax.models.registry import build_state
from infire_jax.quant.resident import QuantLayout
from sharding.plan import ShardPlan, repeat_kv_heads

# Fused weight -> the checkpoint's layer weights it is made of.
FUSED = {"wqkv": ("wq", "wk", "wv"), "wo": ("wo",), "w_gate_up": ("w_gate", "w_up"), "w_down": ("w_down",)}


def part_to_layout(short: str, p: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """One part `[out, n]` (n: the input axis in quants or blocks) to the model's layout, as
    `from_hf_layout` moves the weight itself."""
    e, hq, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if short == "wq":
        return p.reshape(hq, d, -1).transpose(2, 0, 1)
    if short in ("wk", "wv"):
        return p.reshape(hkv, d, -1).transpose(2, 0, 1)
    if short == "wo":  # [E, Hq * n'] -> [Hq, n', E]: blocks never cross a head (checked)
        return p.reshape(e, hq, -1).transpose(1, 2, 0)
    return p.T  # w_gate, w_up, w_down


def place_parts(loaded: LoadedModel, weights: dict[str, np.ndarray], layouts: dict[str, QuantLayout], dtype,
                plan: ShardPlan | None) -> Placed:
    """The model placed with `weights`' kept parts as `layouts` say, q/k/v's repeated for the plan's
    kv-head repeat as the float weights are."""
    if plan is not None and plan.kv_repeat > 1:
        for k in [k for k in weights if ".wqkv." in k]:  # any stack's (Llama 4 has two)
            weights[k] = repeat_kv_heads(weights[k], plan.kv_repeat)
    graphdef, state = build_state(loaded.config, weights, dtype, plan=plan, quantized=layouts)
    return Placed(loaded, graphdef, state, "quantized weights: checkpoints bypassed")
