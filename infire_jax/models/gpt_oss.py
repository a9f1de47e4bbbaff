"""gpt-oss decoder (gpt-oss-20b, gpt-oss-120b): GQA attention with attention sinks, sliding-window and
full layers alternating, and a mixture of experts with a clamped SwiGLU, every layer.

Per layer (transformers' GptOssDecoderLayer):
- q/k/v/o projections with biases; YaRN RoPE (models/yarn.py), its attention factor on cos and sin
  as HF applies it; each query head's learned sink logit joins its softmax and is dropped
  (pallas_kernels/reference.py `join_sinks`); layers marked sliding_attention see the last W keys
  (ModelConfig.local_attention, on the hybrid KV cache as Qwen's and Mistral's windows);
- the MoE: router logits with a bias, top-k of them, a softmax over the k chosen; each expert
  computes gate_up = x W + b, the gate clamped above at `limit`, the up projection to +-limit,
  (up + 1) * gate * sigmoid(alpha * gate), then W_down + b. On a GPU the experts run as two grouped
  Pallas matmuls reading the layer's experts in place (`grouped_experts`, MXFP4 or plain), elsewhere
  as moe.py's loop over row tiles (`tiled_experts`); INFIRE_JAX_MOE_GROUPED chooses.

Weights are stacked over layers and scanned as models/llama.py's; q/k/v are one weight grouped by kv
head (`project_qkv`). The checkpoint's MXFP4 experts are dequantized at load, or kept as they are
(`weights_quantization="checkpoint"`, quant/mxfp4.py): the GPU's grouped kernel reads them as they
are, and the loop over row tiles dequantizes each expert alone as its tile reaches it.

On a mesh the stack runs in models/parallel.py's shard_map as Llama 4's: tp splits the heads with their
sinks and q/k/v biases, `wo`'s partial sums are reduced before the o bias is added (once), and the
experts' widths split with their gate/up biases, the down bias added on the first tp shard only;
ep (or tp, 8-tp8-ep.yaml) holds whole experts with their biases, kept MXFP4 parts too; pp stages hold
their layers' window rows. Other quantization, compressed weights and LoRA are refused with a
ConfigError; EAGLE-3's states ride the layer scan as models/llama.py's do.
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from infire_jax.errors import ConfigError
from infire_jax.models import yarn
from infire_jax.models.config import GptOssConfig, ModelConfig
from infire_jax.models.decoder import DecoderModel
from infire_jax.models.layers import layer_loop, local_attention_table, param, rms_norm, rope_tables, with_local_mask
from infire_jax.models.llama import kernel_weights, linear, project_qkv, run_aux_stack, slots_last
from infire_jax.models.moe import Dispatch, Routing, combine, dispatch_local, tiled_experts
from infire_jax.models.panels import INPUT_AXES
from infire_jax.models.parallel import Reductions, psum
from infire_jax.models.quant_kernels import LayerExperts, layer_stacks
from infire_jax.quant.grouped import GroupedLayout, GroupedParams, expert_weight
from infire_jax.quant.weight_parts import LayerStacks
from pallas_kernels.attention import paged_attention, plan_step
from pallas_kernels.metadata import AttentionMetadata
from sharding.plan import ShardPlan

KVPages = tuple[Array, Array]  # (k_pages, v_pages), each [L, num_pages, page_size, kv_heads, head_dim]
KEPT_EXPERTS = ("layers.w_gate_up", "layers.w_down")  # the expert weights a checkpoint stores in MXFP4


class GptOssLayers(LayerStacks):
    """All layers' weights, stacked on a leading `layers` axis. Experts are [X, E, 2, F] (gate, up) as
    moe.py's, their biases [X, 2, F] and [X, E]; `kept` names the expert weights held as the
    checkpoint's MXFP4 parts (`GroupedParams`, "layers.w_gate_up": layout)."""

    def __init__(self, cfg: ModelConfig, dtype, kept: Mapping[str, GroupedLayout]):
        n, e, hkv, d, x, f = (cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.num_experts,
                              cfg.moe_intermediate_size)
        g = cfg.num_heads // hkv
        self.attn_norm = param((n, e), ("layers", "norm"), dtype, init="ones")
        self.wqkv = param((n, e, hkv, g + 2, d), ("layers", "embed", "kv_heads", "qkv", "head_dim"), dtype)
        self.bqkv = param((n, hkv, g + 2, d), ("layers", "kv_heads", "qkv", "head_dim"), dtype, init="zeros")
        self.wo = param((n, cfg.num_heads, d, e), ("layers", "q_heads", "head_dim", "embed"), dtype)
        self.bo = param((n, e), ("layers", "norm"), dtype, init="zeros")
        self.sinks = param((n, cfg.num_heads), ("layers", "q_heads"), dtype, init="zeros")
        self.mlp_norm = param((n, e), ("layers", "norm"), dtype, init="ones")
        self.router = param((n, e, x), ("layers", "embed", "router"), dtype)
        self.router_bias = param((n, x), ("layers", "router"), dtype, init="zeros")
        self.w_gate_up = param((n, x, e, 2, f), ("layers", "experts", "embed", "gate_up", "mlp"), dtype)
        self.b_gate_up = param((n, x, 2, f), ("layers", "experts", "gate_up", "mlp"), dtype, init="zeros")
        self.w_down = param((n, x, f, e), ("layers", "experts", "mlp", "embed"), dtype)
        self.b_down = param((n, x, e), ("layers", "experts", "norm"), dtype, init="zeros")
        for name, layout in kept.items():
            short = name.rpartition(".")[2]
            plain = getattr(self, short)
            setattr(self, short, GroupedParams(name, tuple(plain.shape), plain.axes, layout))



def _glu(gate_up: Float[Array, "B 2 F"], gc: GptOssConfig) -> Float[Array, "B F"]:
    """transformers' GptOssExperts `_apply_gate`: the gate clamped above, up to +-limit, and
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate_up[:, 0], gc.swiglu_limit)
    up = jnp.clip(gate_up[:, 1], -gc.swiglu_limit, gc.swiglu_limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * gc.swiglu_alpha))


def clamped_swiglu(lp: dict[str, Array], gc: GptOssConfig, x: Float[Array, "B E"], g: Int[Array, ""]
                   ) -> Float[Array, "B E"]:
    """Expert g of the layer on rows x; a kept MXFP4 expert is dequantized alone (`expert_weight`)."""
    w_gate_up, w_down = (expert_weight(lp[k], g, k, x.dtype) for k in ("w_gate_up", "w_down"))
    gate_up = jnp.einsum("me,ecf->mcf", x, w_gate_up) + lp["b_gate_up"][g]
    return _glu(gate_up, gc) @ w_down + lp["b_down"][g]


def grouped_experts(lp: dict[str, Array | LayerExperts], d: Dispatch, gc: GptOssConfig) -> Float[Array, "M E"]:
    """Every sorted row through its expert by two grouped-kernel calls that read the layer's experts in
    place (MXFP4 or plain; pallas_kernels/quant_matmul.py), each row's biases added and the clamped
    SwiGLU between them."""
    m, f = d.x.shape[0], lp["b_gate_up"].shape[-1]
    expert = jnp.repeat(jnp.arange(d.group_sizes.shape[0], dtype=jnp.int32), d.group_sizes, total_repeat_length=m)
    gate_up = lp["w_gate_up"].grouped(d.x, d.group_sizes).astype(d.x.dtype).reshape(m, 2, f)
    glu = _glu(gate_up + lp["b_gate_up"][expert], gc)
    return lp["w_down"].grouped(glu, d.group_sizes).astype(d.x.dtype) + lp["b_down"][expert]


def route(lp: dict[str, Array], x: Float[Array, "T E"], k: int) -> Routing:
    """GptOssTopKRouter: logits with the bias, in the activations' dtype; top-k of them; a softmax over
    the k chosen (in float32, cast back as HF's softmax in the logits' dtype)."""
    logits = linear(x, lp["router"], "te,ex->tx") + lp["router_bias"]
    top, experts = jax.lax.top_k(logits, k)
    weights = jax.nn.softmax(top.astype(jnp.float32), axis=-1).astype(x.dtype)
    return Routing(weights, experts.astype(jnp.int32))


def moe(lp: dict[str, Array], x: Float[Array, "T E"], cfg: ModelConfig, red: Reductions
        ) -> Float[Array, "T E"]:
    """The layer's experts on each token's top-k, summed with the routing weights (moe.py's dispatch,
    grouped loop and combine). On a mesh (`red`), this device's partial sum: its experts' rows only
    (`expert_axis`), or its share of every expert's width, where the down bias counts on the first
    shard alone so that the reduction adds it once."""
    routing = route(lp, x, cfg.num_experts_per_tok)
    width = red.dense[0] if red.dense and red.dense[0] != red.expert_axis else None  # experts' widths split
    if width is not None:
        first = (jax.lax.axis_index(width) == 0).astype(lp["b_down"].dtype)
        lp = {**lp, "b_down": lp["b_down"] * first}
    d, routing = dispatch_local(x, routing, lp["w_gate_up"], red.expert_axis)
    if isinstance(lp["w_gate_up"], LayerExperts):
        ys = grouped_experts(lp, d, cfg.gpt_oss)
    else:
        ys = tiled_experts(d.x, d.group_sizes, functools.partial(clamped_swiglu, lp, cfg.gpt_oss))
    return combine(ys, d, routing, x.dtype)


def decoder_stack(cfg: ModelConfig, attn_impl: str, red: Reductions, weights: dict[str, Array],
                  h: Float[Array, "T E"], k_pages: Array, v_pages: Array, meta: AttentionMetadata, cos: Array,
                  sin: Array, aux: tuple[Float[Array, "N1 T E"], np.ndarray] | None = None
                  ) -> tuple[Float[Array, "T E"], Array, Array] | tuple[Float[Array, "T E"], Array, Array, Array]:
    """Scans the stacked layers (a pipeline stage's, inside the mesh's shard_map); the KV pool is a loop
    carry, each layer's (chunk, window) row of `local_attention_table` scanned beside its weights (None:
    every layer global). `red`: the mesh's reductions (none on one device). With `aux` (EAGLE-3's states:
    models/llama.py's `aux_slots`, the slots and each layer's slot; no pipeline stages) the slots are
    carried too, each layer writing its output into its slot, and come back as a fourth element."""
    tokens, n, one_device = h.shape[0], weights["attn_norm"].shape[0], red == Reductions()
    meta = plan_step(meta, attn_impl, tokens, cfg.num_heads // cfg.num_kv_heads)
    # On a GPU, the stacks the Pallas matmuls read in place: the experts, and in decode-sized steps
    # q/k/v, o and the router (XLA's GEMM would copy each layer's slice out of the stack first:
    # docs/PERFORMANCE.md).
    in_place = layer_stacks(weights, tokens, {k: INPUT_AXES[k] for k in ("wqkv", "wo")}, True,
                            one_device=one_device)

    def layer(carry, xs):
        h, k_pages, v_pages, *slots = carry
        lp, idx, local, *slot = xs
        lp = kernel_weights(lp, in_place, idx, tokens, cpu=False)
        q, k, v = project_qkv(lp, rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps), True, (cos, sin))
        o, k_pages, v_pages = paged_attention(q, k, v, k_pages, v_pages, idx, with_local_mask(meta, local),
                                              scale=cfg.head_dim ** -0.5, impl=attn_impl, cpu_kernel=one_device,
                                              sinks=lp["sinks"])
        h = h + (psum(linear(o, lp["wo"], "thd,hde->te"), red.attn) + lp["bo"])
        h = h + psum(moe(lp, rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps), cfg, red), red.mlp)
        if slots:
            return (h, k_pages, v_pages, jax.lax.dynamic_update_index_in_dim(slots[0], h, slot[0], 0)), None
        return (h, k_pages, v_pages), None

    scanned = {name: w for name, w in weights.items() if name not in in_place}
    xs = (scanned, np.arange(n, dtype=np.int32), local_attention_table(cfg, n))
    carry = (h, k_pages, v_pages)
    if aux is not None:
        carry, xs = (*carry, aux[0]), (*xs, aux[1])
    return layer_loop(layer, carry, xs, n, tokens)


def rope_cos_sin(cfg: ModelConfig, positions: Int[Array, "T"]) -> tuple[Float[Array, "T half"], Float[Array, "T half"]]:
    """cos and sin of YaRN's frequencies (or plain RoPE's), times YaRN's attention factor as HF's
    GptOssRotaryEmbedding multiplies them."""
    cos, sin = rope_tables(yarn.inv_freq(cfg, cfg.head_dim), positions)
    factor = yarn.cos_sin_factor(cfg.rope_scaling)
    return cos * factor, sin * factor


class GptOss(DecoderModel):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, resident: Mapping[str, GroupedLayout] | None = None):
        """`resident`: the checkpoint's MXFP4 experts kept as such (weights_quantization="checkpoint")."""
        resident = dict(resident or {})
        if any(not isinstance(layout, GroupedLayout) or name not in KEPT_EXPERTS for name, layout in resident.items()):
            raise ConfigError("gpt-oss keeps only its checkpoint's MXFP4 experts quantized (weights_quantization="
                              "'checkpoint'); other quantization and weights_compression are not supported for it")
        self.cfg = cfg
        self.embed = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        self.layers = GptOssLayers(cfg, dtype, resident)
        self.final_norm = param((cfg.hidden_size,), ("norm",), dtype, init="ones")
        if not cfg.tie_word_embeddings:
            self.lm_head = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)

    def run_layers(self, h: Float[Array, "T E"], kv: KVPages, meta: AttentionMetadata, *, attn_impl: str,
                   plan: ShardPlan | None = None, aux_layers: tuple[int, ...] | None = None
                   ) -> tuple[Float[Array, "T E"], KVPages]:
        """Applies every decoder layer, on one device or (with a plan) across the mesh; with `aux_layers`
        (EAGLE-3's, as models/llama.py's `run_layers`; no pipeline stages) the residual stream at those
        indices comes back too, [T, len(aux_layers) * E]."""
        cos, sin = rope_cos_sin(self.cfg, meta.positions)
        stack = functools.partial(decoder_stack, self.cfg, attn_impl)
        weights, axes = self.layers.arrays(), self.layers.axes()
        if aux_layers is not None:
            return run_aux_stack(slots_last(stack), aux_layers, self.cfg.num_layers, plan, weights, axes, h, kv,
                                 meta, cos, sin)
        return self.run_stack(stack, weights, axes, h, kv, meta, cos, sin, plan)
