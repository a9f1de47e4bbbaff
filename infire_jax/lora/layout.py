"""The device slots' layout: what the adapters' stacks are, and one adapter's arrays in it (numpy).

Each adapted base weight W (models/llama.py's fused `wqkv`, `wo`, `w_gate_up`, `w_down`) has two
stacks, every slot of every layer at once:

    lora_{W}_a  [L, S, C * R, *in]    rows c * R + j: member c's rank-j row of PEFT's lora_A
    lora_{W}_b  [L, S, R, *out]       row j: each fused output column's rank-j weight of lora_B,
                                      times PEFT's scale (folded in when the adapter is placed)

S = max_loras + 1 slots (slot 0 is the base model: zeros, never written), R = max_lora_rank (an
adapter of lower rank is zero-padded), C the members fused into W (q, k, v; gate, up; or one),
`in` and `out` W's own input and output axes, so A and B shard like W itself (A along W's input
axes, B along its output axes: tensor parallelism splits wqkv and w_gate_up by their outputs,
wo and w_down by their inputs, and the LoRA delta of a split input is a partial sum reduced with
W's). A token's delta is `y[n] = sum_j u[member(n) * R + j] * b[j, n]`, `u = A x` ([C * R]); which
member an output column belongs to follows from W's output shape (`column_members`).
"""

from __future__ import annotations

import numpy as np

from infire_jax.lora.config import LoRAConfig
from infire_jax.lora.peft import PeftAdapter
from infire_jax.models.config import ModelConfig
from sharding.plan import ShardPlan, repeat_kv_heads

# Each adapted weight's members (PEFT module names), in the order of their rows of A.
MEMBERS = {"wqkv": ("q_proj", "k_proj", "v_proj"), "wo": ("o_proj",), "w_gate_up": ("gate_proj", "up_proj"),
           "w_down": ("down_proj",)}
# PEFT's fused modules (checkpoints that fuse them, e.g. Phi-3): one A for every member, B's rows in member order.
FUSED_MODULES = {"qkv_proj": "wqkv", "gate_up_proj": "w_gate_up"}
IN_AXES = {"wqkv": ("embed",), "wo": ("q_heads", "head_dim"), "w_gate_up": ("embed",), "w_down": ("mlp",)}
OUT_AXES = {"wqkv": ("kv_heads", "qkv", "head_dim"), "wo": ("embed",), "w_gate_up": ("gate_up", "mlp"),
            "w_down": ("embed",)}


def adapted_weights(cfg: ModelConfig) -> tuple[str, ...]:
    """The weights with stacks: attention's, and a dense MLP's (a MoE model's experts take none)."""
    return ("wqkv", "wo") if cfg.is_moe else ("wqkv", "wo", "w_gate_up", "w_down")


def in_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    return {"wqkv": (cfg.hidden_size,), "wo": (cfg.num_heads, cfg.head_dim), "w_gate_up": (cfg.hidden_size,),
            "w_down": (cfg.intermediate_size,)}[name]


def out_shape(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    g = cfg.num_heads // cfg.num_kv_heads
    return {"wqkv": (cfg.num_kv_heads, g + 2, cfg.head_dim), "wo": (cfg.hidden_size,),
            "w_gate_up": (2, cfg.intermediate_size), "w_down": (cfg.hidden_size,)}[name]


def stack_key(name: str, part: str) -> str:
    return f"lora_{name}_{part}"


def is_stack(key: str) -> bool:
    return key.startswith("lora_")


def stack_layout(cfg: ModelConfig, lc: LoRAConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """Every stack's shape and logical axes, for `cfg` as placed (a mesh's effective config)."""
    n, s, r = cfg.num_layers, lc.num_slots, lc.max_lora_rank
    out = {}
    for name in adapted_weights(cfg):
        c = len(MEMBERS[name])
        out[stack_key(name, "a")] = ((n, s, c * r, *in_shape(name, cfg)), ("layers", None, None, *IN_AXES[name]))
        out[stack_key(name, "b")] = ((n, s, r, *out_shape(name, cfg)), ("layers", None, None, *OUT_AXES[name]))
    return out


def stack_axes(key: str) -> tuple[str | None, ...]:
    name = key[len("lora_"):-2]
    return ("layers", None, None, *(IN_AXES if key.endswith("_a") else OUT_AXES)[name])


def column_members(name: str, out: tuple[int, ...]) -> np.ndarray:
    """Which member's rows of A each output column of `name` reads, flattened [prod(out)] int32: for
    wqkv [Hkv, G + 2, D] q for the G query heads, then k, then v; for w_gate_up [2, F] gate, up."""
    if name == "wqkv":
        g2 = out[1]
        member = np.clip(np.arange(g2) - (g2 - 3), 0, 2)[None, :, None]
    elif name == "w_gate_up":
        member = np.arange(2)[:, None]
    else:
        member = np.zeros(1, np.int64)
    return np.broadcast_to(member, out).reshape(-1).astype(np.int32)


def _place_b(name: str, b: np.ndarray, member: str, value: np.ndarray, cfg: ModelConfig) -> None:
    """Writes a member's scaled lora_B [out_m, r] into one layer's B [R, *out] (its columns only)."""
    r, hkv, d = value.shape[1], cfg.num_kv_heads, cfg.head_dim
    t = value.T  # [r, out_m]
    if name == "wqkv":
        g = cfg.num_heads // hkv
        if member == "q_proj":
            b[:r, :, :g] = t.reshape(r, hkv, g, d)
        else:
            b[:r, :, g + ("k_proj", "v_proj").index(member)] = t.reshape(r, hkv, d)
    elif name == "w_gate_up":
        b[:r, ("gate_proj", "up_proj").index(member)] = t
    else:
        b[:r] = t


def _members(name: str, adapter: PeftAdapter, layer: int, cfg: ModelConfig):
    """(member index, member name, A [r, in], B [out_m, r]) of the adapter's modules at this weight and layer,
    a fused module split into its members (its A shared, its B's rows in member order)."""
    members = MEMBERS[name]
    for fused, target in FUSED_MODULES.items():
        if target == name and (layer, fused) in adapter.modules:
            a, b = adapter.modules[layer, fused]
            sizes = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim] \
                if name == "wqkv" else [cfg.intermediate_size] * 2
            for c, part in enumerate(np.split(b, np.cumsum(sizes)[:-1], axis=0)):
                yield c, members[c], a, part
            return
    for c, m in enumerate(members):
        if (layer, m) in adapter.modules:
            yield c, m, *adapter.modules[layer, m]


def slot_arrays(adapter: PeftAdapter, cfg: ModelConfig, lc: LoRAConfig, dtype,
                plan: ShardPlan | None = None) -> dict[str, np.ndarray]:
    """One adapter as one slot of every stack: [L, C * R, *in] and [L, R, *out] per adapted weight, in
    `dtype`, zero-padded to the max rank, its scale folded into B. `cfg` is the checkpoint's config;
    with a plan, kv heads are repeated and layers spread over the stage slots as the weights are."""
    rank, n = lc.max_lora_rank, cfg.num_layers
    out = {}
    for name in adapted_weights(cfg):
        c_all = len(MEMBERS[name])
        a = np.zeros((n, c_all * rank, *in_shape(name, cfg)), np.float32)
        b = np.zeros((n, rank, *out_shape(name, cfg)), np.float32)
        for layer in range(n):
            for c, member, la, lb in _members(name, adapter, layer, cfg):
                a[layer, c * rank:c * rank + adapter.rank] = la.reshape(adapter.rank, *in_shape(name, cfg))
                _place_b(name, b[layer], member, adapter.scale * lb, cfg)
        if plan is not None and plan.kv_repeat > 1 and name == "wqkv":
            b = repeat_kv_heads(b, plan.kv_repeat)
        out[f"layers.{stack_key(name, 'a')}"], out[f"layers.{stack_key(name, 'b')}"] = a, b
    if plan is not None:
        out = plan.prepare_weights(out)
    return {k[len("layers."):]: np.ascontiguousarray(v.astype(dtype)) for k, v in out.items()}
