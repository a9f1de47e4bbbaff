"""HF checkpoints of Gemma 4 -> the Gemma4 model's two stacks (`sliding_layers.*`, `full_layers.*`).

Text checkpoints (`Gemma4ForCausalLM`: `model.layers.*`) and the multimodal ones' language model
(`Gemma4ForConditionalGeneration`: `model.language_model.*`, loaders/weights.py `language_model_name`);
the vision and audio towers and their embedders are skipped: the model takes text.
Norms are stored as they are (Gemma 4's RMSNorm multiplies by w). q/k/v are fused per kv head as
models/llama.py's (a full layer with k_eq_v: q and k only); the experts' gate_up_proj [X, 2F, E]
(gate rows first) and down_proj [X, E, F] are turned to our [X, E, 2, F] and [X, F, E].
"""

from __future__ import annotations

import re
from typing import Iterable

import numpy as np

from infire_jax.errors import UnsupportedModelError
from infire_jax.loaders.weights import language_model_name
from infire_jax.models.config import ModelConfig, gemma4_stacks

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_TOP = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
_SKIPPED = ("model.embed_vision.", "model.embed_audio.", "model.audio_tower.", "audio_tower.", "embed_vision.",
            "embed_audio.")
# A linear module's stacked weight in its stack (`linear_targets`)
_LINEAR = {"self_attn.q_proj": "wqkv", "self_attn.k_proj": "wqkv", "self_attn.v_proj": "wqkv", "self_attn.o_proj": "wo",
           "mlp.gate_proj": "w_gate_up", "mlp.up_proj": "w_gate_up", "mlp.down_proj": "w_down"}
_PER_LAYER = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "post_attn_norm",
              "pre_feedforward_layernorm.weight": "mlp_norm", "post_feedforward_layernorm.weight": "post_mlp_norm",
              "post_feedforward_layernorm_1.weight": "post_mlp_norm_1",
              "pre_feedforward_layernorm_2.weight": "moe_norm",
              "post_feedforward_layernorm_2.weight": "post_moe_norm", "layer_scalar": "layer_scalar",
              "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
              "self_attn.o_proj.weight": "wo", "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
              "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down",
              "router.proj.weight": "router", "router.scale": "router_scale", "router.per_expert_scale": "expert_scale",
              "experts.gate_up_proj": "w_experts_gate_up", "experts.down_proj": "w_experts_down"}


def linear_targets(module: str, cfg: ModelConfig) -> tuple[str, ...]:
    """The stacked weight ("sliding_layers.wqkv", ...) that HF linear module `module` (no `.weight`) is part
    of; () for anything else (the router, the experts' fused tensors, the head, the towers)."""
    name = language_model_name(f"{module}.weight")
    m = _LAYER.fullmatch(name or "")
    if m is None or int(m.group(1)) >= cfg.num_layers:
        return ()
    kind = "full" if (int(m.group(1)) + 1) % cfg.gemma4.period == 0 else "sliding"
    short = _LINEAR.get(m.group(2).removesuffix(".weight"))
    return (f"{kind}_layers.{short}",) if short else ()


def _layer_weights(w: dict[str, np.ndarray], cfg: ModelConfig, hkv: int, d: int) -> dict[str, np.ndarray]:
    """One layer's HF tensors (by our short names) in our layout; its kind has `hkv` kv heads of `d`. Only
    output axes are split (the projections' inputs stay whole), so a kept 8-bit projection's scales
    `[out, in / group]` take the same path (loaders/kept_8bit.py); what a layer lacks is left out."""
    e, g = cfg.hidden_size, cfg.num_heads // hkv
    out = {}
    if "wq" in w:
        heads = [w.pop("wq").reshape(hkv, g, d, -1), w.pop("wk").reshape(hkv, 1, d, -1)]
        if "wv" in w:
            heads.append(w.pop("wv").reshape(hkv, 1, d, -1))
        out["wqkv"] = np.concatenate(heads, axis=1).transpose(3, 0, 1, 2)
    if "wo" in w:
        out["wo"] = w.pop("wo").reshape(e, cfg.num_heads, -1).transpose(1, 2, 0)
    if "w_gate" in w:
        out["w_gate_up"] = np.stack([w.pop("w_gate").T, w.pop("w_up").T], axis=1)
    if "w_down" in w:
        out["w_down"] = w.pop("w_down").T
    if "router" in w:
        x = cfg.num_experts
        out["router"] = w.pop("router").T
        out["w_experts_gate_up"] = w.pop("w_experts_gate_up").reshape(x, 2, -1, e).transpose(0, 3, 1, 2)
        out["w_experts_down"] = w.pop("w_experts_down").transpose(0, 2, 1)
    return {**out, **w}


def gemma4_weights(tensors: Iterable[tuple[str, np.ndarray]], cfg: ModelConfig, parts: bool = False
                   ) -> dict[str, np.ndarray]:
    """Our parameter paths from the checkpoint's tensor names and float arrays (either layout). `parts`: the
    tensors are some projections' kept scales (loaders/kept_8bit.py), stacked where present, their shapes
    the weights' with the input axis shortened."""
    p = cfg.gemma4.period
    layers: list[dict[str, np.ndarray]] = [{} for _ in range(cfg.num_layers)]
    weights: dict[str, np.ndarray] = {}
    for raw, w in tensors:
        name = language_model_name(raw)
        if name is None or name.startswith(_SKIPPED):
            continue
        top = _TOP.get(name)
        if top is not None:
            if top != "lm_head" or not cfg.tie_word_embeddings:
                weights[top] = w
            continue
        m = _LAYER.fullmatch(name)
        short = _PER_LAYER.get(m.group(2)) if m else None
        if short is None or int(m.group(1)) >= cfg.num_layers:
            raise UnsupportedModelError(f"unexpected weight {raw!r} for Gemma 4 ({cfg.num_layers} layers)")
        layers[int(m.group(1))][short] = w
    stacks = gemma4_stacks(cfg)
    for kind, index in (("sliding", [i for i in range(cfg.num_layers) if (i + 1) % p]),
                        ("full", [i for i in range(cfg.num_layers) if (i + 1) % p == 0])):
        _, _, hkv, _, d = next(t.shape for t in stacks[kind] if t.name == "wqkv")
        try:
            per_layer = [_layer_weights(dict(layers[i]), cfg, hkv, d) for i in index]
        except (KeyError, ValueError) as e:
            raise UnsupportedModelError(f"a Gemma 4 {kind} layer's weights do not fit its config: {e}") from e
        for t in stacks[kind]:
            if parts and all(t.name not in lw for lw in per_layer):
                continue
            if any(t.name not in lw for lw in per_layer):
                raise UnsupportedModelError(f"weight {t.name!r} is missing for some {kind} layers of {index}")
            stacked = np.stack([lw.pop(t.name) for lw in per_layer])
            if stacked.shape != t.shape and not parts:
                raise UnsupportedModelError(f"Gemma 4's {kind} layers' {t.name} has shape {stacked.shape[1:]}, "
                                            f"its config makes it {t.shape[1:]}")
            weights[f"{kind}_layers.{t.name}"] = stacked
        extra = sorted({k for lw in per_layer for k in lw})
        if extra:
            raise UnsupportedModelError(f"unexpected weights {extra} in Gemma 4's {kind} layers")
    return weights
