"""Qwen3.5 decoder (Qwen3.5 0.8B-27B and Qwen3.5-MoE 35B-A3B and up, text): groups of Gated DeltaNet
layers, each group ending in a gated attention layer (three to one in every published model).

Per layer (transformers' Qwen3_5DecoderLayer): h + mixer(norm(h)), then h + mlp(norm(h)), the MLP SwiGLU
or (Qwen3.5-MoE) top-k softmax-routed experts beside a sigmoid-gated shared expert.
- An attention layer: q and an output gate from one projection (per head: D values of q, then D of the
  gate), q and k RMS-normed over the head, the first `rotary_dim` dims of each head rotated, GQA over the
  paged pool (its own index there: the pool holds attention layers only), the output times sigmoid(gate).
- A Gated DeltaNet (models/gated_delta.py): q, k and v through a causal depthwise convolution (SiLU),
  the delta rule with decay g = -exp(A_log) softplus(a + dt_bias) and strength beta = sigmoid(b), then
  an RMSNorm of each v head times SiLU(z), and the output projection.
Qwen3.5's RMSNorm multiplies by (1 + w): the loader stores 1 + w (loaders/qwen3_5_hf.py), so every norm
is models/layers.py's; the gated norm of the DeltaNet multiplies by w itself.

The layers are stacked in two stacks, the linear layers' and the attention layers', and scanned group by
group: the group's linear layers, then its attention layer (decoder_stack). On a mesh the stack runs in
models/parallel.py's shard_map: tp splits the attention heads, the DeltaNets' heads (their weights and
their state, sharding/mesh.py ALIASES) and the MLP widths, ep or tp the routed experts; no pipeline.
Layer weights may be kept quantized at load (int8 / fp8 / int4, quant/resident.py: the DeltaNets' and the
attention's projections, the MLPs and experts; in_proj_b / _a stay as they are), each layer's dequantized in
the scan, or read in place by the GPU's quantized matmuls. Compressed weights, LoRA and EAGLE-3 are refused.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from infire_jax.errors import ConfigError
from infire_jax.models.config import ModelConfig
from infire_jax.models.decoder import DecoderModel
from infire_jax.models.gated_delta import (LINEAR_INPUTS_AXES, LINEAR_STATE_AXES, LinearInputs, LinearState,
                                           LinearStep, Rows, delta_net, replay_kept, step_rows)
from infire_jax.models.layers import apply_rope, param, rms_norm, rope_cos_sin, swiglu
from infire_jax.models.moe import route_for, routed_mlp
from infire_jax.models.llama import InPlace, linear
from infire_jax.models.parallel import Reductions, logical_specs, psum, run_sharded
from infire_jax.models.quant_kernels import EXPERT_INPUTS, LayerExperts, layer_stacks
from infire_jax.quant.resident import QuantLayout, dequantize_layer, keep_quantized, quant_layouts
from infire_jax.quant.weight_parts import LayerStacks
from pallas_kernels import cpu_matmul
from pallas_kernels.attention import paged_attention, plan_step
from pallas_kernels.metadata import AttentionMetadata
from sharding.plan import ShardPlan

KVPages = tuple[Array, Array]
# Each projection's input axes (models/quant_kernels.py `layer_stacks`): what the in-place kernels read.
DENSE_INPUTS = {"w_qkv": 1, "w_z": 1, "w_b": 1, "w_a": 1, "w_out": 1, "wq": 1, "wk": 1, "wv": 1, "wo": 2,
                "w_gate_up": 1, "w_down": 1, "w_shared_gate_up": 1, "w_shared_down": 1}


def _mlp_params(layers: LayerStacks, cfg: ModelConfig, n: int, dtype) -> None:
    """The norms and the MLP: SwiGLU, or (MoE) a router, experts in models/llama.py's layout and a shared
    expert with its sigmoid gate."""
    e = cfg.hidden_size
    layers.attn_norm = param((n, e), ("layers", "norm"), dtype, init="ones")
    layers.mlp_norm = param((n, e), ("layers", "norm"), dtype, init="ones")
    if not cfg.is_moe:
        f = cfg.intermediate_size
        layers.w_gate_up = param((n, e, 2, f), ("layers", "embed", "gate_up", "mlp"), dtype)
        layers.w_down = param((n, f, e), ("layers", "mlp", "embed"), dtype)
        return
    x, f, fs = cfg.num_experts, cfg.moe_intermediate_size, cfg.gated_delta.shared_expert_size
    layers.router = param((n, e, x), ("layers", "embed", "router"), dtype)
    layers.w_gate_up = param((n, x, e, 2, f), ("layers", "experts", "embed", "gate_up", "mlp"), dtype)
    layers.w_down = param((n, x, f, e), ("layers", "experts", "mlp", "embed"), dtype)
    layers.w_shared_gate_up = param((n, e, 2, fs), ("layers", "embed", "gate_up", "mlp"), dtype)
    layers.w_shared_down = param((n, fs, e), ("layers", "mlp", "embed"), dtype)
    layers.shared_gate = param((n, e), ("layers", "embed"), dtype)


class AttentionLayers(LayerStacks):
    """The attention layers' weights: q with its gate [E, H, 2, D], k and v [E, Hkv, D], o [H, D, E]."""

    def __init__(self, cfg: ModelConfig, dtype, resident: Mapping[str, QuantLayout]):
        n, e, h, hkv, d = cfg.num_kv_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        _mlp_params(self, cfg, n, dtype)
        self.wq = param((n, e, h, 2, d), ("layers", "embed", "q_heads", "qkv", "head_dim"), dtype)
        self.wk = param((n, e, hkv, d), ("layers", "embed", "kv_heads", "head_dim"), dtype)
        self.wv = param((n, e, hkv, d), ("layers", "embed", "kv_heads", "head_dim"), dtype)
        self.q_norm = param((n, d), ("layers", "norm"), dtype, init="ones")
        self.k_norm = param((n, d), ("layers", "norm"), dtype, init="ones")
        self.wo = param((n, h, d, e), ("layers", "q_heads", "head_dim", "embed"), dtype)
        keep_quantized(self, resident)


class LinearLayers(LayerStacks):
    """The Gated DeltaNet layers' weights (HF's names: in_proj_qkv as w_qkv [E, C], in_proj_z, _b, _a,
    conv1d [K, C], dt_bias, A_log, norm [Dv], out_proj [Hv * Dv, E])."""

    def __init__(self, cfg: ModelConfig, dtype, resident: Mapping[str, QuantLayout]):
        g, n, e = cfg.gated_delta, cfg.num_linear_layers, cfg.hidden_size
        value = g.num_v_heads * g.v_head_dim
        _mlp_params(self, cfg, n, dtype)
        self.w_qkv = param((n, e, g.conv_dim), ("layers", "embed", "linear_qkv"), dtype)
        self.w_z = param((n, e, value), ("layers", "embed", "linear_value"), dtype)
        self.w_b = param((n, e, g.num_v_heads), ("layers", "embed", "linear_heads"), dtype)
        self.w_a = param((n, e, g.num_v_heads), ("layers", "embed", "linear_heads"), dtype)
        self.conv = param((n, g.conv_kernel, g.conv_dim), ("layers", "conv_kernel", "linear_qkv"), dtype)
        self.dt_bias = param((n, g.num_v_heads), ("layers", "linear_heads"), dtype, init="ones")
        self.a_log = param((n, g.num_v_heads), ("layers", "linear_heads"), dtype, init="zeros")
        self.norm = param((n, g.v_head_dim), ("layers", "norm"), dtype, init="ones")
        self.w_out = param((n, value, e), ("layers", "linear_value", "embed"), dtype)
        keep_quantized(self, resident)


def gated_rms_norm(x: Float[Array, "T H D"], z: Float[Array, "T H D"], weight: Float[Array, "D"],
                   eps: float) -> Float[Array, "T H D"]:
    """RMSNorm of each head times w (in x's dtype, as HF's Qwen3_5RMSNormGated), then times SiLU(z) in float32."""
    normed = rms_norm(x, weight, eps)
    return (normed.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


def linear_mixer(cfg: ModelConfig, lp: dict[str, Array], x: Float[Array, "T E"], state: LinearState,
                 layer: Int[Array, ""], rows: Rows, token_slots: Int[Array, "T"]
                 ) -> tuple[Float[Array, "T E"], LinearState, tuple[Array, Array, Array]]:
    """One Gated DeltaNet (linear layer `layer`) over the step's tokens: its output (a partial sum over the
    heads on a mesh), the updated state, and what the tokens put into it (a verifying step's `LinearInputs`
    for this layer). The heads are this device's."""
    g, t = cfg.gated_delta, x.shape[0]
    f32 = jnp.float32
    qkv = linear(x, lp["w_qkv"], "te,ec->tc")
    beta = jax.nn.sigmoid(linear(x, lp["w_b"], "te,eh->th").astype(f32))
    decay = -jnp.exp(lp["a_log"].astype(f32)) * jax.nn.softplus(linear(x, lp["w_a"], "te,eh->th").astype(f32)
                                                                + lp["dt_bias"].astype(f32))
    out, state = delta_net(qkv, decay, beta, lp["conv"], state, layer, rows, token_slots, g)
    z = linear(x, lp["w_z"], "te,ev->tv").reshape(t, -1, g.v_head_dim)
    y = gated_rms_norm(out.astype(x.dtype), z, lp["norm"], cfg.rms_norm_eps)
    return linear(y.reshape(t, -1), lp["w_out"], "tv,ve->te"), state, (qkv, decay, beta)


def attention_mixer(cfg: ModelConfig, lp: dict[str, Array], x: Float[Array, "T E"], k_pages: Array, v_pages: Array,
                    idx: Int[Array, ""], meta: AttentionMetadata, cos: Array, sin: Array, attn_impl: str,
                    one_device: bool) -> tuple[Float[Array, "T E"], Array, Array]:
    """The gated attention of this device's heads: its output (a partial sum over the heads on a mesh)."""
    eps = cfg.rms_norm_eps
    qg = linear(x, lp["wq"], "te,ehcd->thcd")
    q = apply_rope(rms_norm(qg[:, :, 0], lp["q_norm"], eps), cos, sin)
    k = apply_rope(rms_norm(linear(x, lp["wk"], "te,ekd->tkd"), lp["k_norm"], eps), cos, sin)
    v = linear(x, lp["wv"], "te,ekd->tkd")
    o, k_pages, v_pages = paged_attention(q, k, v, k_pages, v_pages, idx, meta, scale=cfg.head_dim ** -0.5,
                                          impl=attn_impl, cpu_kernel=one_device)
    gated = (o.astype(jnp.float32) * jax.nn.sigmoid(qg[:, :, 1].astype(jnp.float32))).astype(x.dtype)
    return linear(gated, lp["wo"], "thd,hde->te"), k_pages, v_pages


def _swiglu_mlp(x: Float[Array, "T E"], w_gate_up: Array | InPlace, w_down: Array | InPlace) -> Float[Array, "T E"]:
    gate_up = linear(x, w_gate_up, "te,ecf->tcf")
    return linear(swiglu(gate_up[:, 0], gate_up[:, 1]), w_down, "tf,fe->te")


def _mlp(cfg: ModelConfig, red: Reductions, lp: dict[str, Array], h: Float[Array, "T E"]) -> Float[Array, "T E"]:
    """h plus the MLP of norm(h): SwiGLU, or the routed experts (models/moe.py) plus the shared expert times
    sigmoid(its gate), as HF's Qwen3_5MoeSparseMoeBlock. On a mesh each sums its device's share: the
    routed experts over their axis and the MLP width's, the SwiGLUs over the width's."""
    x = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
    if not cfg.is_moe:
        return h + psum(_swiglu_mlp(x, lp["w_gate_up"], lp["w_down"]), red.dense)
    routed = routed_mlp(lp, x, route_for(cfg, linear(x, lp["router"], "te,ex->tx")), expert_axis=red.expert_axis)
    shared = _swiglu_mlp(x, lp["w_shared_gate_up"], lp["w_shared_down"])
    gate = jax.nn.sigmoid((x @ lp["shared_gate"][:, None]).astype(jnp.float32)).astype(x.dtype)
    return h + psum(routed, red.mlp) + psum(gate * shared, red.dense)


def attention_block(cfg: ModelConfig, attn_impl: str, red: Reductions, lp: dict[str, Array], h: Float[Array, "T E"],
                    k_pages: Array, v_pages: Array, idx: Int[Array, ""], meta: AttentionMetadata, cos: Array,
                    sin: Array) -> tuple[Float[Array, "T E"], Array, Array]:
    """An attention layer (pool index `idx`) and its MLP: h + attention(norm(h)), then h + mlp(norm(h))."""
    y, k_pages, v_pages = attention_mixer(cfg, lp, rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps), k_pages, v_pages,
                                          idx, meta, cos, sin, attn_impl, red == Reductions())
    return _mlp(cfg, red, lp, h + psum(y, red.attn)), k_pages, v_pages


def mtp_stack(cfg: ModelConfig, attn_impl: str, red: Reductions, weights: dict[str, dict[str, Array]],
              h: Float[Array, "T E"], k_pages: Array, v_pages: Array, meta: AttentionMetadata, cos: Array,
              sin: Array) -> tuple[Float[Array, "T E"], Array, Array]:
    """The multi-token-prediction layer (speculative/mtp.py): one attention layer and its MLP, a stack of one
    (`weights["attention_layers"]`), over its one-layer pool (models/parallel.py's StackFn)."""
    meta = plan_step(meta, attn_impl, h.shape[0], cfg.num_heads // cfg.num_kv_heads)
    lp = dequantize_layer({name: jax.tree.map(lambda a: a[0], w) for name, w in weights["attention_layers"].items()},
                          h.dtype)
    return attention_block(cfg, attn_impl, red, lp, h, k_pages, v_pages, jnp.int32(0), meta, cos, sin)


def rotary_tables(cfg: ModelConfig, positions: Int[Array, "T"]) -> tuple[Array, Array]:
    """cos and sin of the positions over the first `rotary_dim` dims of a head."""
    return rope_cos_sin(dataclasses.replace(cfg, head_dim=cfg.gated_delta.rotary_dim), positions)


def decoder_stack(cfg: ModelConfig, attn_impl: str, record: bool, red: Reductions,
                  weights: dict[str, dict[str, Array]], h: Float[Array, "T E"], k_pages: Array, v_pages: Array,
                  meta: AttentionMetadata, cos: Array, sin: Array, state: LinearState, token_slots: Int[Array, "T"]
                  ) -> tuple[Float[Array, "T E"], Array, Array, LinearState | LinearInputs]:
    """Scans the groups (models/parallel.py's StackFn, with the linear state after the pool; on a mesh, inside
    its shard_map with this device's heads, state and experts): each group's linear layers, unrolled over the
    group's slice of the linear stack, then its attention layer. The pool and the linear state ride in the
    carry, each layer updating its own rows in place. With `record` (a verifying step) the state is left as
    found and the linear layers' inputs come back in its place (gated_delta.LinearInputs). Never unrolled
    over the groups (models/layers.py `layer_loop`'s GPU decode form): compiled for an H100, the 27b's
    unrolled decode burst copied its attention layers' weights out of their stacks, 21 GB a step, and
    peaked at 95 GB (`bench gpu-compile`, docs/PERFORMANCE.md)."""
    tokens, groups, per_group = h.shape[0], cfg.num_kv_layers, cfg.gated_delta.interval - 1
    eps, one_device = cfg.rms_norm_eps, red == Reductions()
    linear, attention = weights["linear_layers"], weights["attention_layers"]
    meta = plan_step(meta, attn_impl, tokens, cfg.num_heads // cfg.num_kv_heads)
    rows = step_rows(meta, token_slots, state.conv.shape[1] - 1)
    # Kernels read decode-sized steps' weights (a GPU: any step's experts too) in place from the whole stack.
    lin_in_place, attn_in_place = (_in_place(w, tokens, cfg, one_device) for w in (linear, attention))

    def group(carry, xs):
        h, k_pages, v_pages, state = carry
        lin, lp, idx = xs
        inputs = []
        for j in range(per_group):
            layer = idx * per_group + j
            lj = {**dequantize_layer({name: jax.tree.map(lambda a: a[j], w) for name, w in lin.items()}, h.dtype),
                  **lin_in_place(layer)}
            y, after, layer_inputs = linear_mixer(cfg, lj, rms_norm(h, lj["attn_norm"], eps), state, layer, rows,
                                                  token_slots)
            state = state if record else after
            inputs.append(layer_inputs)
            h = _mlp(cfg, red, lj, h + psum(y, red.attn))
        lp = {**dequantize_layer(lp, h.dtype), **attn_in_place(idx)}
        h, k_pages, v_pages = attention_block(cfg, attn_impl, red, lp, h, k_pages, v_pages, idx, meta, cos, sin)
        recorded = LinearInputs(*(jnp.stack(a) for a in zip(*inputs))) if record else None
        return (h, k_pages, v_pages, state), recorded

    linear = {name: w for name, w in linear.items() if name not in lin_in_place.stacks}
    attention = {name: w for name, w in attention.items() if name not in attn_in_place.stacks}
    by_group = jax.tree.map(lambda w: w.reshape(groups, per_group, *w.shape[1:]), linear)
    xs = (by_group, attention, np.arange(groups, dtype=np.int32))
    (h, k_pages, v_pages, state), recorded = jax.lax.scan(group, (h, k_pages, v_pages, state), xs)
    if record:  # [groups, per group, ...] -> [linear layers, ...], in the stack's order
        return h, k_pages, v_pages, jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), recorded)
    return h, k_pages, v_pages, state


class _InPlace(NamedTuple):
    """A stack's weights a kernel reads in place (name -> (the stack as read, one layer's shape)): layer i's
    as models/llama.py's `InPlace` for a dense matmul, `LayerExperts` for the grouped one."""

    stacks: dict

    def __call__(self, layer: Int[Array, ""]) -> dict[str, InPlace | LayerExperts]:
        return {name: LayerExperts(kw, layer) if getattr(kw, "experts", False) else InPlace(kw, layer, shape)
                for name, (kw, shape) in self.stacks.items()}


def _in_place(weights: dict[str, Array], tokens: int, cfg: ModelConfig, one_device: bool) -> _InPlace:
    """What kernels read in place in a step of `tokens` tokens. On a GPU (on a mesh, each device its
    shards): the plain projections in decode-sized steps (quant_kernels.MAX_PLAIN_ROWS), a MoE stack's
    experts always. On one CPU: the dense projections its matmul kernel takes (`cpu_matmul.applies`, as
    models/llama.py's), each viewed as [L, inputs, outputs]; scanned slices were copied out every layer,
    so a decode step moved its weights three times (0.8b's decode: 18% of the copy bandwidth)."""
    stacks = layer_stacks(weights, tokens, DENSE_INPUTS, cfg.is_moe, one_device=one_device)
    for name, inputs in DENSE_INPUTS.items() if one_device else ():
        w = weights.get(name)
        if name in stacks or not isinstance(w, jax.Array) or (cfg.is_moe and name in EXPERT_INPUTS):
            continue
        view = w.reshape(w.shape[0], math.prod(w.shape[1:1 + inputs]), math.prod(w.shape[1 + inputs:]))
        if cpu_matmul.applies(tokens, view):
            stacks[name] = (view, tuple(w.shape[1:]))
    return _InPlace(stacks)


class Qwen3_5(DecoderModel):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, resident: Mapping | None = None):
        """`resident`: layer weights kept quantized, by weight name (`w_qkv`, `wq`, `w_gate_up`, ...)."""
        resident = quant_layouts("Qwen3.5", resident)
        self.cfg = cfg
        self.embed = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        self.linear_layers = LinearLayers(cfg, dtype, resident)
        self.attention_layers = AttentionLayers(cfg, dtype, resident)
        self.final_norm = param((cfg.hidden_size,), ("norm",), dtype, init="ones")
        if not cfg.tie_word_embeddings:
            self.lm_head = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)

    def run_layers(self, h: Float[Array, "T E"], kv: KVPages, meta: AttentionMetadata, *, attn_impl: str,
                   plan: ShardPlan | None = None, aux_layers: tuple[int, ...] | None = None,
                   linear: LinearStep | None = None, record: bool = False
                   ) -> tuple[Float[Array, "T E"], KVPages, LinearState | LinearInputs]:
        """Applies every decoder layer, on one device or (with a plan) across the mesh: the updated pool and
        linear state; with `record` (a verifying step), the state as found and, in its place, what the step's
        tokens would put into it (`commit_kept` puts the verifier's kept ones)."""
        if aux_layers is not None or linear is None:
            raise ConfigError("Qwen3.5 runs with its linear state and without EAGLE-3 aux states")
        cos, sin = rotary_tables(self.cfg, meta.positions)
        stack = functools.partial(decoder_stack, self.cfg, attn_impl, record)
        weights = {"linear_layers": self.linear_layers.arrays(), "attention_layers": self.attention_layers.arrays()}
        if plan is None:
            h, k_pages, v_pages, state = stack(Reductions(), weights, h, *kv, meta, cos, sin, *linear)
            return h, (k_pages, v_pages), state
        axes = {"linear_layers": self.linear_layers.axes(), "attention_layers": self.attention_layers.axes()}
        return run_sharded(stack, plan, weights, axes, h, kv, meta, cos, sin, token_args=(linear.token_slots,),
                           state=linear.state, state_axes=LINEAR_STATE_AXES,
                           state_out_axes=LINEAR_INPUTS_AXES if record else None)

    def commit_kept(self, state: LinearState, inputs: LinearInputs, meta: AttentionMetadata,
                    token_slots: Int[Array, "T"], kept: Bool[Array, "T"], plan: ShardPlan | None = None
                    ) -> LinearState:
        """After a verifying step (`run_layers(record=True)`): the linear state advanced over the tokens the
        verifier kept, a prefix of each row (gated_delta.replay_kept); on a mesh each device its own heads'."""
        replay = functools.partial(replay_kept, g=self.cfg.gated_delta)
        conv = self.linear_layers.conv[...]
        if plan is None:
            return replay(inputs, conv, state, meta, token_slots, kept)
        replicated = jax.sharding.PartitionSpec()
        state_specs = logical_specs(plan, LINEAR_STATE_AXES)
        return jax.shard_map(replay, mesh=plan.mesh, check_vma=False,
                             in_specs=(logical_specs(plan, LINEAR_INPUTS_AXES),
                                       plan.spec(self.linear_layers.axes()["conv"]), state_specs,
                                       jax.tree.map(lambda _: replicated, meta), replicated, replicated),
                             out_specs=state_specs)(inputs, conv, state, meta, token_slots, kept)
