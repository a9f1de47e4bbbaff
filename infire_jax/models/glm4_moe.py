"""GLM-4.5 / GLM-4.6 (GLM-4.5-Air too) and MiniMax-M2 decoders: GQA attention and DeepSeek-V3's MoE.

Per layer (transformers' Glm4MoeDecoderLayer): q/k/v with biases (`attention_bias`), q and k RMS-normed
over the head where `use_qk_norm` (GLM-4.5, not Air), then rotated on their first `rotary_dim`
dimensions only (HF's partial_rotary_factor, a half) in the "rotate half" layout, the rest passed
through; the first `first_k_dense_replace` layers have a dense SwiGLU MLP, the rest DeepSeek-V3's
grouped sigmoid router with score-correction bias, routed experts and shared experts
(models/deepseek_moe.py). MiniMax-M2 differs only in its q/k norms, each over all heads at once
(`Glm4Config.qk_norm_whole`), and in its MoE's settings: every layer, no groups, no shared expert, no
bias on q/k/v. The layers are two stacks (`dense_layers`, `moe_layers`) scanned in turn as
models/deepseek.py's, the KV pool's layer index running across both; q/k/v are one weight grouped by kv
head as models/llama.py's.

On a mesh (models/parallel.py) tp splits the heads and the MLP widths, ep the experts; pipeline
parallelism is refused (sharding/plan.py), as for the DeepSeek-V3 family. MiniMax-M2's norms over every
head are split with the heads, their mean squares summed over tp (`qk_norm`); tp beyond its kv heads
(which would repeat them) is refused. Layer weights may be kept quantized at load (int8 / fp8 / int4,
quant/resident.py: attention, MLPs, routed and shared experts), each layer's dequantized in the scan, or read
in place by the GPU's quantized matmuls. EAGLE-3's states ride both stacks' scans (models/deepseek.py
`scan_stacks`). Palette-compressed weights and LoRA are refused with a ConfigError.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from infire_jax.models.config import ModelConfig
from infire_jax.models.decoder import DecoderModel
from infire_jax.models.deepseek import add_moe_params, scan_stacks
from infire_jax.models.deepseek_moe import deepseek_moe_mlp
from infire_jax.models.layers import apply_rope, param, rms_norm, rope_cos_sin
from infire_jax.models.llama import dense_mlp, kernel_weights, linear, project_qkv, run_aux_stack, slots_last
from infire_jax.models.parallel import Reductions, psum
from infire_jax.quant.resident import QuantLayout, dequantize_layer, keep_quantized, quant_layouts
from infire_jax.quant.weight_parts import LayerStacks
from pallas_kernels.attention import paged_attention, plan_step
from pallas_kernels.metadata import AttentionMetadata
from sharding.plan import ShardPlan

KVPages = tuple[Array, Array]  # (k_pages, v_pages), each [L, num_pages, page_size, kv_heads, head_dim]
# The layer weights that are plain matmuls, with how many leading axes of one layer's weight are inputs.
DENSE_INPUTS = {"wqkv": 1, "wo": 2, "w_gate_up": 1, "w_down": 1, "w_shared_gate_up": 1, "w_shared_down": 1}


class Glm4Layers(LayerStacks):
    """`n` stacked layers of one kind: GQA attention, and a dense MLP or DeepSeek-V3's MoE. The router's
    bias is kept in float32, as HF keeps it."""

    def __init__(self, cfg: ModelConfig, n: int, moe: bool, dtype, resident: Mapping[str, QuantLayout]):
        e, hkv, d = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
        g = cfg.num_heads // hkv
        self.attn_norm = param((n, e), ("layers", "norm"), dtype, init="ones")
        self.wqkv = param((n, e, hkv, g + 2, d), ("layers", "embed", "kv_heads", "qkv", "head_dim"), dtype)
        if cfg.attention_bias:
            self.bqkv = param((n, hkv, g + 2, d), ("layers", "kv_heads", "qkv", "head_dim"), dtype, init="zeros")
        if cfg.qk_norm:  # over a head, or over all heads at once (then split over tp with the heads)
            if cfg.glm4.qk_norm_whole:
                self.q_norm = param((n, d * cfg.num_heads), ("layers", "q_heads"), dtype, init="ones")
                self.k_norm = param((n, d * hkv), ("layers", "kv_heads"), dtype, init="ones")
            else:
                self.q_norm = param((n, d), ("layers", "norm"), dtype, init="ones")
                self.k_norm = param((n, d), ("layers", "norm"), dtype, init="ones")
        self.wo = param((n, cfg.num_heads, d, e), ("layers", "q_heads", "head_dim", "embed"), dtype)
        self.mlp_norm = param((n, e), ("layers", "norm"), dtype, init="ones")
        if not moe:
            f = cfg.intermediate_size
            self.w_gate_up = param((n, e, 2, f), ("layers", "embed", "gate_up", "mlp"), dtype)
            self.w_down = param((n, f, e), ("layers", "mlp", "embed"), dtype)
        else:
            add_moe_params(self, cfg, n, dtype)
        keep_quantized(self, resident)


def qk_norm(x: Float[Array, "T H D"], weight: Array, eps: float, whole: bool, axes: tuple[str, ...] = ()
            ) -> Float[Array, "T H D"]:
    """RMSNorm over each head, or over all of a token's heads at once (`whole`; head h at [h*D, h*D + D)
    of the weight, as HF's flat projection). With tp (`axes`: the heads and the weight split over them),
    the sums of squares of each device's heads are added over the devices (one [T, 1] all-reduce each)."""
    if not whole:
        return rms_norm(x, weight, eps)
    if not axes:
        return rms_norm(x.reshape(x.shape[0], -1), weight, eps).reshape(x.shape)
    xf = x.reshape(x.shape[0], -1).astype(jnp.float32)
    total = jax.lax.psum(jnp.sum(xf * xf, axis=-1, keepdims=True), axes)
    width = jax.lax.psum(xf.shape[-1], axes)
    xf = xf * jax.lax.rsqrt(total / width + eps)
    return (weight.astype(jnp.float32) * xf).astype(x.dtype).reshape(x.shape)


def make_layer_fn(cfg: ModelConfig, moe: bool, cos: Array, sin: Array, meta: AttentionMetadata, attn_impl: str,
                  red: Reductions, in_place: dict, first: int):
    """The scan body of one stack: (h, k pages, v pages), (layer weights, pool layer index) -> carry.
    `in_place` weights are not scanned: the body reads its layer (pool index - `first`) of them."""
    eps, one_device = cfg.rms_norm_eps, red == Reductions()
    tp = tuple(a for a in red.mlp if a != red.expert_axis)  # dense and shared MLPs are replicated over ep

    def layer(carry, xs):
        h, k_pages, v_pages = carry
        lp, idx = xs
        lp = kernel_weights(dequantize_layer(lp, h.dtype), in_place, idx - first, h.shape[0], cpu=False)
        q, k, v = project_qkv(lp, rms_norm(h, lp["attn_norm"], eps), cfg.attention_bias)
        if cfg.qk_norm:
            q, k = (qk_norm(x, lp[name], eps, cfg.glm4.qk_norm_whole, red.attn)
                    for x, name in ((q, "q_norm"), (k, "k_norm")))
        o, k_pages, v_pages = paged_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, k_pages,
                                              v_pages, idx, meta, scale=cfg.head_dim ** -0.5, impl=attn_impl,
                                              cpu_kernel=one_device)
        h = h + psum(linear(o, lp["wo"], "thd,hde->te"), red.attn)
        x = rms_norm(h, lp["mlp_norm"], eps)
        if moe:
            routed, shared = deepseek_moe_mlp(lp, x, cfg=cfg, expert_axis=red.expert_axis)
            h = h + psum(routed, red.mlp) + (0 if shared is None else psum(shared, tp))
        else:
            h = h + psum(dense_mlp(lp, x), tp)
        return (h, k_pages, v_pages), None

    return layer


def decoder_stack(cfg: ModelConfig, attn_impl: str, red: Reductions, weights: dict[str, dict[str, Array]],
                  h: Float[Array, "T E"], k_pages: Array, v_pages: Array, meta: AttentionMetadata, cos: Array,
                  sin: Array, aux: tuple[Float[Array, "N1 T E"], np.ndarray] | None = None) -> tuple:
    """Scans the dense stack, then the MoE stack (models/deepseek.py `scan_stacks`): (h, the pool), and with
    `aux` (EAGLE-3's slots) the slots."""
    meta = plan_step(meta, attn_impl, h.shape[0], cfg.num_heads // cfg.num_kv_heads)
    return scan_stacks(weights, (h, k_pages, v_pages), DENSE_INPUTS, red, lambda moe, in_place, first:
                       make_layer_fn(cfg, moe, cos, sin, meta, attn_impl, red, in_place, first), aux)


def glm4_rope(cfg: ModelConfig, positions: Int[Array, "T"]) -> tuple[Float[Array, "T R"], Float[Array, "T R"]]:
    """The rotary tables of the tokens' positions over the first `rotary_dim` dimensions (`decoder_stack`'s)."""
    rotary = dataclasses.replace(cfg, head_dim=cfg.glm4.rotary_dim)  # its frequencies span R dims
    return rope_cos_sin(rotary, positions)


class Glm4Moe(DecoderModel):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, resident: Mapping | None = None):
        """`resident`: layer weights kept quantized, by weight name (`wqkv`, `w_gate_up`, ...: in both stacks)."""
        resident = quant_layouts(cfg.architecture, resident)
        self.cfg = cfg
        dense = cfg.deepseek_moe.first_k_dense_replace
        self.embed = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        if dense:
            self.dense_layers = Glm4Layers(cfg, dense, False, dtype, resident)
        if cfg.num_layers > dense:
            self.moe_layers = Glm4Layers(cfg, cfg.num_layers - dense, True, dtype, resident)
        self.final_norm = param((cfg.hidden_size,), ("norm",), dtype, init="ones")
        if not cfg.tie_word_embeddings:
            self.lm_head = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)

    def _stacks(self) -> dict[str, Glm4Layers]:
        return {kind: getattr(self, f"{kind}_layers") for kind in ("dense", "moe") if hasattr(self, f"{kind}_layers")}

    def run_layers(self, h: Float[Array, "T E"], kv: KVPages, meta: AttentionMetadata, *, attn_impl: str,
                   plan: ShardPlan | None = None, aux_layers: tuple[int, ...] | None = None
                   ) -> tuple[Float[Array, "T E"], KVPages]:
        """Applies every decoder layer, on one device or (with a plan) across the mesh; with `aux_layers`
        (EAGLE-3's, models/llama.py `run_aux_stack`) the residual stream at those hidden-state indices
        comes back too, [T, len(aux_layers) * E]."""
        cos, sin = glm4_rope(self.cfg, meta.positions)
        stacks = self._stacks()
        stack = functools.partial(decoder_stack, self.cfg, attn_impl)
        weights = {kind: st.arrays() for kind, st in stacks.items()}
        axes = {kind: st.axes() for kind, st in stacks.items()}
        if aux_layers is not None:
            return run_aux_stack(slots_last(stack), aux_layers, self.cfg.num_layers, plan, weights, axes, h, kv,
                                 meta, cos, sin)
        return self.run_stack(stack, weights, axes, h, kv, meta, cos, sin, plan)
