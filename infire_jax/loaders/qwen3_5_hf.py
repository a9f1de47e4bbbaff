"""HF checkpoints of Qwen3.5, Qwen3.5-MoE and Qwen3-Next -> the Qwen3_5 model's two layer stacks
(models/qwen3_5.py).

Text checkpoints (`Qwen3_5ForCausalLM`: `model.layers.*`) and the multimodal ones' language model
(`Qwen3_5ForConditionalGeneration`: `model.language_model.*`, loaders/weights.py `language_model_name`);
the vision tower (`model.visual.*`) and the multi-token-prediction layer (`mtp.*`, read for speculation by
speculative/mtp_loader.py, which converts its decoder layer here as a one-group model's attention layer)
are skipped. Layer i goes to the attention stack (its index there: i // interval) when it attends, else
to the linear stack.
Experts come fused (`mlp.experts.gate_up_proj`, as transformers 5 saves them) or one by one.
Every RMSNorm weight but the DeltaNet's gated norm is stored as 1 + w, the factor Qwen3.5's multiplies by.
The convolution's channels (`in_proj_qkv`'s outputs, `conv1d`'s) are reordered by k head
(models/gated_delta.py `qkv_order`), so that a mesh splits them by head.
"""

from __future__ import annotations

import re
from typing import Iterable

import numpy as np

from infire_jax.errors import UnsupportedModelError
from infire_jax.loaders.gemma3_hf import gemma_norm
from infire_jax.loaders.kv_scales_hf import is_kv_scale
from infire_jax.loaders.weights import language_model_name
from infire_jax.models.config import ModelConfig
from infire_jax.models.gated_delta import qkv_order

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_TOP = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
_SKIPPED = ("model.visual.", "mtp.")
_SHARED = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm",
           "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down",
           # Qwen3.5-MoE: the router, the experts fused (as transformers 5 saves them) and the shared expert
           "mlp.gate.weight": "router", "mlp.experts.gate_up_proj": "w_gate_up", "mlp.experts.down_proj": "w_down",
           "mlp.shared_expert.gate_proj.weight": "w_shared_gate", "mlp.shared_expert.up_proj.weight": "w_shared_up",
           "mlp.shared_expert.down_proj.weight": "w_shared_down", "mlp.shared_expert_gate.weight": "shared_gate"}
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")  # one expert's, as 4.x saved
_ATTENTION = {"self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
              "self_attn.o_proj.weight": "wo", "self_attn.q_norm.weight": "q_norm",
              "self_attn.k_norm.weight": "k_norm"}
_LINEAR = {"linear_attn.in_proj_qkv.weight": "w_qkv", "linear_attn.in_proj_z.weight": "w_z",
           "linear_attn.in_proj_b.weight": "w_b", "linear_attn.in_proj_a.weight": "w_a",
           "linear_attn.conv1d.weight": "conv", "linear_attn.dt_bias": "dt_bias", "linear_attn.A_log": "a_log",
           "linear_attn.norm.weight": "norm", "linear_attn.out_proj.weight": "w_out",
           # Qwen3-Next's: q, k, v and z (and b and a) in one projection, grouped by k head (`_split_grouped`)
           "linear_attn.in_proj_qkvz.weight": "qkvz", "linear_attn.in_proj_ba.weight": "ba"}
# A linear module's stacked weight in its stack (`linear_targets`): Qwen3-Next's in_proj_qkvz and in_proj_ba,
# split between weights, and the small in_proj_b / in_proj_a load dequantized.
_KEPT = {"self_attn.q_proj": "wq", "self_attn.k_proj": "wk", "self_attn.v_proj": "wv", "self_attn.o_proj": "wo",
         "linear_attn.in_proj_qkv": "w_qkv", "linear_attn.in_proj_z": "w_z", "linear_attn.out_proj": "w_out",
         "mlp.gate_proj": "w_gate_up", "mlp.up_proj": "w_gate_up", "mlp.down_proj": "w_down",
         "mlp.shared_expert.gate_proj": "w_shared_gate_up", "mlp.shared_expert.up_proj": "w_shared_gate_up",
         "mlp.shared_expert.down_proj": "w_shared_down"}
_ONE_PLUS_W = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "final_norm")


def _layout(short: str, w: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """One layer weight from HF's (out, in) layout to the model's; only output axes are split, so a kept
    8-bit projection's scales `[out, in / group]` take the same path (loaders/kept_8bit.py)."""
    e, h, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if short in _ONE_PLUS_W:
        return gemma_norm(w)
    if short == "wq":  # per head: D rows of q, then D of its gate
        return w.reshape(h, 2, d, -1).transpose(3, 0, 1, 2)
    if short in ("wk", "wv"):
        return w.reshape(hkv, d, -1).transpose(2, 0, 1)
    if short == "wo":
        return w.reshape(e, h, -1).transpose(1, 2, 0)
    if short == "conv":  # [C, 1, K] -> [K, C], the channels grouped by k head
        return w[:, 0, :].T[:, qkv_order(cfg)]
    if short == "w_qkv":  # [C, E] -> [E, C], likewise
        return w.T[:, qkv_order(cfg)]
    if short == "w_gate_up" and w.ndim == 3:  # experts [X, 2F, E] -> [X, E, 2, F]
        return w.reshape(w.shape[0], 2, -1, w.shape[-1]).transpose(0, 3, 1, 2)
    if short == "w_down" and w.ndim == 3:  # experts [X, E, F] -> [X, F, E]
        return w.transpose(0, 2, 1)
    if short == "shared_gate":  # [1, E] -> [E]
        return w[0]
    if w.ndim == 2:  # the other projections: [out, in] -> [in, out]
        return w.T
    return w


def linear_targets(module: str, cfg: ModelConfig) -> tuple[str, ...]:
    """The stacked weight ("linear_layers.w_qkv", ...) that HF linear module `module` (no `.weight`) is part
    of; () for anything else (the router, the head, the vision tower, the MTP layer)."""
    name = language_model_name(f"{module}.weight") if not module.startswith(_SKIPPED) else None
    m = _LAYER.fullmatch(name or "")
    if m is None or int(m.group(1)) >= cfg.num_layers:
        return ()
    stack = "linear_layers" if cfg.kv_layer(int(m.group(1))) is None else "attention_layers"
    expert = _EXPERT.fullmatch(m.group(2))
    short = ("w_down" if expert.group(2) == "down_proj" else "w_gate_up") if expert else \
        _KEPT.get(m.group(2).removesuffix(".weight"))
    return (f"{stack}.{short}",) if short else ()


def _split_grouped(short: str, w: np.ndarray, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Qwen3-Next's fused projections as Qwen3.5's ([out, in] each): `in_proj_qkvz` holds, for each k head,
    its q and k rows, then the v and z rows of its v heads; `in_proj_ba` its v heads' b rows, then their a
    rows (transformers' `fix_query_key_value_ordering`). Qwen3.5's `in_proj_qkv` is every head's q, then
    every k, then every v."""
    g, e = cfg.gated_delta, w.shape[-1]
    per = g.num_v_heads // g.num_k_heads
    grouped = w.reshape(g.num_k_heads, -1, e)
    if short == "ba":
        return {"w_b": grouped[:, :per].reshape(-1, e), "w_a": grouped[:, per:].reshape(-1, e)}
    dk, dv = g.k_head_dim, per * g.v_head_dim
    q, k = grouped[:, :dk], grouped[:, dk:2 * dk]
    v, z = grouped[:, 2 * dk:2 * dk + dv], grouped[:, 2 * dk + dv:]
    return {"w_qkv": np.concatenate([q.reshape(-1, e), k.reshape(-1, e), v.reshape(-1, e)]), "w_z": z.reshape(-1, e)}


def qwen3_5_weights(tensors: Iterable[tuple[str, np.ndarray]], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our parameter paths from the checkpoint's tensor names and float arrays."""
    stacks = {"attention_layers": [dict() for _ in range(cfg.num_kv_layers)],
              "linear_layers": [dict() for _ in range(cfg.num_linear_layers)]}
    weights: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}  # (layer, projection) -> expert -> [in, out]
    for raw, w in tensors:
        if raw.startswith(_SKIPPED):
            continue
        name = language_model_name(raw)
        if name is not None and is_kv_scale(name):  # fp8 KV-cache scales: read by the engine, not model weights
            continue
        m = _LAYER.fullmatch(name or "")
        expert = _EXPERT.fullmatch(m.group(2)) if m else None
        if expert is not None and int(m.group(1)) < cfg.num_layers and cfg.is_moe:
            experts.setdefault((int(m.group(1)), expert.group(2)), {})[int(expert.group(1))] = w.T
            continue
        top = _TOP.get(name or "")
        if top is not None:
            if top != "lm_head" or not cfg.tie_word_embeddings:
                weights[top] = gemma_norm(w) if top == "final_norm" else w
            continue
        i = int(m.group(1)) if m else cfg.num_layers
        attends = cfg.kv_layer(i) is not None
        short = _SHARED.get(m.group(2)) or (_ATTENTION if attends else _LINEAR).get(m.group(2)) if m else None
        if short is None or i >= cfg.num_layers:
            raise UnsupportedModelError(f"unexpected weight {raw!r} for Qwen3.5 ({cfg.num_layers} layers)")
        layer = _layer(stacks, i, cfg)
        for part, value in (_split_grouped(short, w, cfg) if short in ("qkvz", "ba") else {short: w}).items():
            layer[part] = _layout(part, value, cfg)
    for (i, projection), by_expert in experts.items():
        if sorted(by_expert) != list(range(cfg.num_experts)):
            raise UnsupportedModelError(f"layer {i}'s experts' {projection} are incomplete for {cfg.num_experts} "
                                        "experts")
        _layer(stacks, i, cfg)[projection] = np.stack([by_expert[x] for x in range(cfg.num_experts)])
    for layer in (*stacks["attention_layers"], *stacks["linear_layers"]):
        if "gate_proj" in layer or "up_proj" in layer:  # per-expert checkpoints: [X, E, F] each
            if not {"gate_proj", "up_proj"} <= set(layer):
                raise UnsupportedModelError("the checkpoint has only one of the experts' gate_proj and up_proj")
            layer["w_gate_up"] = np.stack([layer.pop("gate_proj"), layer.pop("up_proj")], axis=-2)
        if "down_proj" in layer:
            layer["w_down"] = layer.pop("down_proj")
    for stack, layers in stacks.items():
        names = set().union(*layers)
        for short in sorted(names):
            missing = [j for j, layer in enumerate(layers) if short not in layer]
            if missing:
                raise UnsupportedModelError(f"weight {short!r} is missing for {stack} {missing}")
            weights[f"{stack}.{short}"] = np.stack([layer[short] for layer in layers])
        for gate, up, fused in (("w_gate", "w_up", "w_gate_up"), ("w_shared_gate", "w_shared_up", "w_shared_gate_up")):
            if {gate, up} <= names:
                weights[f"{stack}.{fused}"] = np.stack([weights.pop(f"{stack}.{gate}"), weights.pop(f"{stack}.{up}")],
                                                       axis=-2)
    return weights


def _layer(stacks: dict[str, list[dict]], i: int, cfg: ModelConfig) -> dict:
    """Layer i's weights: the attention stack's entry (its index in the pool), or the linear stack's."""
    attention = cfg.kv_layer(i)
    if attention is not None:
        return stacks["attention_layers"][attention]
    return stacks["linear_layers"][i - i // cfg.gated_delta.interval]
