"""HF checkpoints of Llama 4 -> the Llama4 model's stacked weights (`dense_layers.*`, `moe_layers.*`).

Two layouts: `Llama4ForCausalLM` (`model.layers.N...`, `lm_head`) and the published multimodal
`Llama4ForConditionalGeneration` (the same under `language_model.`, with `vision_model.` and
`multi_modal_projector.` beside them). The vision tower is not part of the text model: the engine
reads it apart (loaders/vision.py) to serve images.

Per layer: q/k/v/o, the dense MLP's gate/up/down (`feed_forward.*_proj`), or the MoE's router
[X, E], fused experts `experts.gate_up_proj` [X, E, 2F] (gate columns first) and `experts.down_proj`
[X, F, E], and the shared expert. Published 8-bit checkpoints (Llama 4 Maverick's FP8) hold each expert
as its own linear modules instead, `experts.N.{gate,up,down}_proj.weight` in HF's `[out, in]` layout;
they are stacked into the same two weights. Only output axes move (the experts' transposes aside, whose
input axis stays whole), so a kept 8-bit weight's scales take the same path (loaders/kept_8bit.py). Llama 4 rotates adjacent pairs of q and k; each head's rows of
q_proj and k_proj are reordered (even dimensions, then odd) into the "rotate half" layout the model
rotates, on q and k alike, so every q.k is what the checkpoint computes (v and o are untouched).
"""

from __future__ import annotations

import logging
import re
from typing import Iterable

import numpy as np

from infire_jax.errors import UnsupportedModelError
from infire_jax.loaders.deepseek_hf import deinterleave
from infire_jax.loaders.weights import fuse_projections, from_hf_layout
from infire_jax.models.config import ModelConfig

log = logging.getLogger(__name__)

_LAYER = re.compile(r"(?:language_model\.)?model\.layers\.(\d+)\.(.+)")
_TOP = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm", "lm_head.weight": "lm_head"}
_SKIPPED = ("vision_model.", "multi_modal_projector.")
_PLAIN = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm",
          "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
          "self_attn.o_proj.weight": "wo"}
_DENSE = {"feed_forward.gate_proj.weight": "w_gate", "feed_forward.up_proj.weight": "w_up",
          "feed_forward.down_proj.weight": "w_down"}
_EXPERT = re.compile(r"feed_forward\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
# A linear module's stacked weight (`linear_targets`), by the module's name in its layer.
_LINEAR = {"self_attn.q_proj": "wqkv", "self_attn.k_proj": "wqkv", "self_attn.v_proj": "wqkv", "self_attn.o_proj": "wo",
           "feed_forward.gate_proj": "w_gate_up", "feed_forward.up_proj": "w_gate_up", "feed_forward.down_proj": "w_down",
           "feed_forward.shared_expert.gate_proj": "w_shared_gate_up",
           "feed_forward.shared_expert.up_proj": "w_shared_gate_up",
           "feed_forward.shared_expert.down_proj": "w_shared_down"}
_MOE = {"feed_forward.router.weight": "router", "feed_forward.experts.gate_up_proj": "w_gate_up",
        "feed_forward.experts.down_proj": "w_down", "feed_forward.shared_expert.gate_proj.weight": "w_shared_gate",
        "feed_forward.shared_expert.up_proj.weight": "w_shared_up",
        "feed_forward.shared_expert.down_proj.weight": "w_shared_down"}


def stack_position(cfg: ModelConfig, layer: int) -> tuple[str, int]:
    """("moe_layers" or "dense_layers", index in that stack) of layer `layer` (models/llama4.py's order)."""
    p = cfg.llama4.moe_step
    if cfg.llama4.is_moe_layer(layer):
        return "moe_layers", layer // p
    return "dense_layers", layer - layer // p


def linear_targets(module: str, cfg: ModelConfig) -> tuple[str, ...]:
    """The stacked weight ("moe_layers.w_gate_up", ...) that HF linear module `module` (no `.weight`) is
    part of; () for anything else (the router, the head, the vision tower)."""
    m = _LAYER.fullmatch(f"{module}.weight")
    if m is None or int(m.group(1)) >= cfg.num_layers:
        return ()
    stack, _ = stack_position(cfg, int(m.group(1)))
    expert = _EXPERT.fullmatch(m.group(2))
    short = ("w_down" if expert.group(2) == "down_proj" else "w_gate_up") if expert else \
        _LINEAR.get(m.group(2).removesuffix(".weight"))
    return (f"{stack}.{short}",) if short else ()


def _rotate_half_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """q_proj / k_proj [heads * D, E] with each head's rows in the order (0, 2, 4, ..., 1, 3, 5, ...)."""
    d = w.shape[0] // heads
    return w.reshape(heads, d, -1)[:, deinterleave(d)].reshape(w.shape)


def _convert(rest: str, w: np.ndarray, cfg: ModelConfig, moe: bool) -> tuple[str, np.ndarray]:
    """(our short name, the tensor in our layout) of one HF layer tensor."""
    if rest in _PLAIN:
        short = _PLAIN[rest]
        if short in ("wq", "wk"):
            w = _rotate_half_rows(w, cfg.num_heads if short == "wq" else cfg.num_kv_heads)
        return short, from_hf_layout(short, w, cfg)
    if not moe and rest in _DENSE:
        return _DENSE[rest], w.T
    expert = _EXPERT.fullmatch(rest) if moe else None
    if expert:  # [out, in] -> [in, out], as the fused weights hold each expert
        return f"expert.{expert.group(1)}.{expert.group(2)}", w.T
    if moe and rest in _MOE:
        short = _MOE[rest]
        if short == "w_gate_up":  # [X, E, 2F]: the gate's F columns, then the up projection's
            return short, w.reshape(*w.shape[:2], 2, -1)
        return short, w if short == "w_down" else w.T
    raise UnsupportedModelError(f"unexpected weight {rest!r} in a Llama 4 {'MoE' if moe else 'dense'} layer")


def llama4_weights(tensors: Iterable[tuple[str, np.ndarray]], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our parameter paths from HF tensor names and arrays (either layout)."""
    sizes = {f"{kind}_layers": n for kind, n in cfg.llama4.stack_sizes.items()}
    per_stack: dict[str, dict[str, list]] = {stack: {} for stack in sizes}
    weights: dict[str, np.ndarray] = {}
    skipped = 0
    for name, w in tensors:
        if name.startswith(_SKIPPED):
            skipped += 1
            continue
        m = _LAYER.fullmatch(name)
        top = _TOP.get(name.removeprefix("language_model."))
        if top is not None:
            if top != "lm_head" or not cfg.tie_word_embeddings:
                weights[top] = w
        elif m and m.group(2).endswith("rotary_emb.inv_freq"):
            continue
        elif m and int(m.group(1)) < cfg.num_layers:
            stack, index = stack_position(cfg, int(m.group(1)))
            short, value = _convert(m.group(2), w, cfg, stack == "moe_layers")
            per_stack[stack].setdefault(short, [None] * sizes[stack])[index] = value
        else:
            raise UnsupportedModelError(f"unexpected weight {name!r} for Llama 4 ({cfg.num_layers} layers)")
    if skipped:
        log.info("Llama 4: the vision tower and projector (%d tensors) are not text weights: the engine reads "
                 "them apart to serve images (loaders/vision.py)", skipped)
    for stack, per_layer in per_stack.items():
        _stack_experts(per_layer, cfg, stack)
        stacked = {}
        for short, arrays in per_layer.items():
            missing = [i for i, a in enumerate(arrays) if a is None]
            if missing:
                raise UnsupportedModelError(f"weight {short!r} is missing for {stack} {missing}")
            stacked[short] = np.stack(arrays)
        if ("w_shared_gate" in stacked) != ("w_shared_up" in stacked):
            raise UnsupportedModelError("the checkpoint has only one of the shared expert's gate and up projections")
        if "w_shared_gate" in stacked:
            stacked["w_shared_gate_up"] = np.stack([stacked.pop("w_shared_gate"), stacked.pop("w_shared_up")], axis=-2)
        weights.update({f"{stack}.{k}": v for k, v in fuse_projections(stacked, cfg).items()})
    return weights


def _stack_experts(per_layer: dict[str, list], cfg: ModelConfig, stack: str) -> None:
    """A stack's experts held one module each ("expert.3.gate_proj" [E, F]) as the fused weights: w_gate_up
    [X, E, 2, F] (gate, then up) and w_down [X, F, E]; UnsupportedModelError naming a missing one."""
    found = {k for k in per_layer if k.startswith("expert.")}
    if not found:
        return
    beyond = sorted(k for k in found if int(k.split(".")[1]) >= cfg.num_experts)
    if beyond:
        raise UnsupportedModelError(f"{stack}: {beyond[0]} is beyond the config's {cfg.num_experts} experts")
    if "w_gate_up" in per_layer or "w_down" in per_layer:
        raise UnsupportedModelError(f"{stack}: the checkpoint holds its experts both fused and one by one")
    parts = {"w_gate_up": ("gate_proj", "up_proj"), "w_down": ("down_proj",)}
    for fused, names in parts.items():
        layers = []
        for i in range(len(next(iter(per_layer.values())))):
            experts = []
            for j in range(cfg.num_experts):
                arrays = [per_layer.get(f"expert.{j}.{n}", [None] * (i + 1))[i] for n in names]
                if any(a is None for a in arrays):
                    raise UnsupportedModelError(f"{stack} {i}: expert {j}'s {' / '.join(names)} is missing")
                experts.append(np.stack(arrays, axis=-2) if fused == "w_gate_up" else arrays[0])
            layers.append(np.stack(experts))
        per_layer[fused] = layers
    for k in found:
        del per_layer[k]
