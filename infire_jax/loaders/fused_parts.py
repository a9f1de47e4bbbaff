"""A Llama-architecture layer weight kept quantized as parts (GGUF blocks, GPTQ / AWQ groups, int8
rows): which checkpoint weights each fused weight is made of, and placing the parts (a part takes
the weight's own path into the model's layout, loaders/weights.py `from_hf_layout`). Shared by
loaders/gguf_quant.py and loaders/llama_quant.py.
"""

from __future__ import annotations

import numpy as np

from infire_jax.loaders.weights import LoadedModel, Placed
from infire_jax.models.registry import build_state
from infire_jax.quant.resident import QuantLayout
from sharding.plan import ShardPlan, repeat_kv_heads

# Fused weight -> the checkpoint's layer weights it is made of.
FUSED = {"wqkv": ("wq", "wk", "wv"), "wo": ("wo",), "w_gate_up": ("w_gate", "w_up"), "w_down": ("w_down",)}


def place_parts(loaded: LoadedModel, weights: dict[str, np.ndarray], layouts: dict[str, QuantLayout], dtype,
                plan: ShardPlan | None) -> Placed:
    """The model placed with `weights`' kept parts as `layouts` say, q/k/v's repeated for the plan's
    kv-head repeat as the float weights are."""
    if plan is not None and plan.kv_repeat > 1:
        for k in [k for k in weights if ".wqkv." in k]:  # any stack's (Llama 4 has two)
            weights[k] = repeat_kv_heads(weights[k], plan.kv_repeat)
    graphdef, state = build_state(loaded.config, weights, dtype, plan=plan, quantized=layouts)
    return Placed(loaded, graphdef, state, "quantized weights: checkpoints bypassed")
