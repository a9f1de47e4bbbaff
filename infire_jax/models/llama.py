"""Llama-architecture decoder (Llama 2/3.x, SmolLM2/3, Mistral, Qwen2/2.5, Qwen3, Phi-3/4, and their MoE kin).

Layer weights are stacked along a leading `layers` axis and the forward scans over them: one
compiled layer body keeps compile time flat in depth, and the stacked axis is what pipeline
parallelism shards. Attention reads and writes the paged KV pool through `pallas_kernels`. On a
mesh, `models.parallel` runs the same layer body on each device's shard of the weights.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from infire_jax.compression.resident import PaletteParams, ResidentLayout, decode_layer
from infire_jax.errors import ConfigError
from infire_jax.lora.batched import LayerLoRA, LoRAStep, LoRAWeight, split_stacks
from infire_jax.lora.layout import stack_axes
from infire_jax.models.config import ModelConfig
from infire_jax.models.layers import (apply_rope, final_logits, layer_loop, local_attention_table, nope_table, param,
                                      rms_norm, rope_cos_sin, swiglu, with_local_mask)
from infire_jax.models.moe import moe_mlp
from infire_jax.models.palette_kernels import KernelPaletteParams, KernelPaletteWeight
from infire_jax.models.panels import INPUT_AXES, PanelParams, PanelWeight, stack_view_shape
from infire_jax.models.parallel import Reductions, StackFn, psum, run_sharded
from infire_jax.models.quant_kernels import (KernelQuantWeight, LayerExperts, LayerHeads, layer_stacks, residual_norm,
                                             swiglu_mlp)
from infire_jax.quant.resident import QuantLayout, QuantParams, dequantize_layer
from infire_jax.quant.weight_parts import LayerStacks, WeightParts
from pallas_kernels import cpu_matmul
from pallas_kernels.attention import paged_attention, plan_step
from pallas_kernels.metadata import AttentionMetadata
from sharding.plan import KV_POOL_AXES, ShardPlan

KVPages = tuple[Array, Array]  # (k_pages, v_pages), each [L, num_pages, page_size, kv_heads, head_dim]


class DecoderLayers(LayerStacks):
    """All decoder layers' weights, stacked: every array has a leading `layers` axis.

    q/k/v are one weight and gate/up another, so each is one GEMM. The q/k/v weight is grouped by
    kv head, `[E, Hkv, G + 2, D]`: kv head j's G query heads, then its k and v. Splitting the
    `kv_heads` axis over tp therefore hands every device whole GQA groups, as separate q/k/v
    weights split by heads did. gate/up is `[E, 2, F]`, so splitting F keeps each device's gate and
    up columns paired.

    `resident` names weights kept palette-compressed (`PaletteParams`) or quantized (`QuantParams`),
    decoded in the layer body, or palette-compressed for a matmul kernel that decodes them itself
    (`KernelPaletteParams`, models/palette_kernels.py). On CPU the model runner may repack plain
    ones into the matmul kernel's panels (`PanelParams`, models/panels.py).
    """

    takes_panels = True  # the layer body reads repacked weights (models/panels.py)
    PARTS = (WeightParts, PanelParams)

    def __init__(self, cfg: ModelConfig, dtype, resident: dict[str, ResidentLayout | QuantLayout] | None = None):
        n, e, hkv, d = cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
        g = cfg.num_heads // hkv
        self.attn_norm = param((n, e), ("layers", "norm"), dtype, init="ones")
        self.wqkv = param((n, e, hkv, g + 2, d), ("layers", "embed", "kv_heads", "qkv", "head_dim"), dtype)
        self.wo = param((n, cfg.num_heads, d, e), ("layers", "q_heads", "head_dim", "embed"), dtype)
        if cfg.attention_bias:
            self.bqkv = param((n, hkv, g + 2, d), ("layers", "kv_heads", "qkv", "head_dim"), dtype, init="zeros")
        if cfg.qk_norm:
            self.q_norm = param((n, d), ("layers", "norm"), dtype, init="ones")
            self.k_norm = param((n, d), ("layers", "norm"), dtype, init="ones")
        self.mlp_norm = param((n, e), ("layers", "norm"), dtype, init="ones")
        if cfg.is_moe:  # the experts' weights, and a router whose expert axis stays replicated
            x, f = cfg.num_experts, cfg.moe_intermediate_size
            self.router = param((n, e, x), ("layers", "embed", "router"), dtype)
            self.w_gate_up = param((n, x, e, 2, f), ("layers", "experts", "embed", "gate_up", "mlp"), dtype)
            self.w_down = param((n, x, f, e), ("layers", "experts", "mlp", "embed"), dtype)
        else:
            f = cfg.intermediate_size
            self.w_gate_up = param((n, e, 2, f), ("layers", "embed", "gate_up", "mlp"), dtype)
            self.w_down = param((n, f, e), ("layers", "mlp", "embed"), dtype)
        for short, layout in (resident or {}).items():
            plain = getattr(self, short)
            if isinstance(layout, QuantLayout):
                setattr(self, short, QuantParams(short, tuple(plain.shape), plain.axes, layout))
            elif layout.kernel:
                setattr(self, short, KernelPaletteParams(short, tuple(plain.shape), layout))
            else:
                setattr(self, short, PaletteParams(tuple(plain.shape), plain.axes, layout))


@dataclasses.dataclass(frozen=True)
class InPlace:
    """A layer's weight as the whole stack plus the layer index, so a matmul kernel reads the
    layer's slice in place (scanning over the stack copies each slice): the stack viewed as
    [L, K, N] or its panels (`cpu_matmul.pack_panels`, models/panels.py) for the CPU kernel, or
    coded for a kernel that decodes it (palette, or quantized on a GPU)."""

    stacked: Float[Array, "L K N"] | Float[Array, "L P R C"] | KernelPaletteWeight | KernelQuantWeight
    layer: Int[Array, ""]
    shape: tuple[int, ...]  # one layer's weight, as the einsums see it


def _kernel_view(name: str, stacked: Array | PanelWeight, tokens: int) -> Array | None:
    """A stack of `name` weights [L, ...] viewed as [L, K, N] (or its panels, or palette-coded for a
    kernel) if a matmul kernel of this backend takes it, else None."""
    if isinstance(stacked, KernelPaletteWeight):
        return stacked if stacked.applies(tokens) else None
    if isinstance(stacked, PanelWeight):
        return stacked.panels if stacked.panels.ndim == 4 and cpu_matmul.panel_kernel(stacked.panels.dtype) else None
    view_shape = stack_view_shape(name, stacked.shape) if isinstance(stacked, jax.Array) else None
    if view_shape is None:
        return None
    view = stacked.reshape(view_shape)
    return view if cpu_matmul.applies(tokens, view) else None


KernelView = Array | KernelPaletteWeight | KernelQuantWeight  # what `InPlace.stacked` holds


def in_place_weights(cfg: ModelConfig, weights: dict[str, Array], tokens: int, red: Reductions
                     ) -> dict[str, tuple[KernelView, tuple]]:
    """The stacked layer weights that a step of `tokens` tokens multiplies with a kernel reading its
    layer of the stack, as (the stack as the kernel reads it, one layer's shape): quantized ones and
    MoE experts with the quantized matmul kernels (models/quant_kernels.py; the GPU's on a mesh too,
    per shard), and off a mesh the dense ones the CPU matmul kernel takes (`cpu_matmul.applies`)."""
    out = layer_stacks(weights, tokens, INPUT_AXES, cfg.is_moe, one_device=red == Reductions())
    if red != Reductions():
        return out
    if "wo" in out and out["wo"][0].fuses and "mlp_norm" in weights:  # read in place by the fused residual norm
        out["mlp_norm"] = (weights["mlp_norm"], tuple(weights["mlp_norm"].shape[1:]))
    for name in INPUT_AXES:
        w = weights.get(name)
        view = None if name in out or w is None or isinstance(w, dict) else _kernel_view(name, w, tokens)
        if view is not None:
            out[name] = (view, w.shape if isinstance(w, (PanelWeight, KernelPaletteWeight)) else tuple(w.shape[1:]))
    return out


def kernel_weights(lp: dict, in_place: dict[str, tuple[KernelView, tuple]], layer: Array, tokens: int,
                   cpu: bool) -> dict:
    """One layer's weights with the kernels' ones as `InPlace` (a MoE layer's experts as
    `LayerExperts`, per-head stacks as `LayerHeads`): the stacked ones read in place, and, for the CPU
    kernel (`cpu`), ones decoded in the layer body (compressed or quantized) as a stack of one, so a
    step computes the same sums whether its weights were stored plain or compressed. Panels the kernel
    does not take this step are unpacked to the plain weight."""
    lp = {k: v.plain() if isinstance(v, (PanelWeight, KernelPaletteWeight)) else v for k, v in lp.items()}
    out = dict(lp)
    for name, (view, shape) in in_place.items():
        grouped = isinstance(view, KernelQuantWeight) and view.experts
        out[name] = (LayerHeads(view, layer) if grouped and view.heads else LayerExperts(view, layer) if grouped
                     else InPlace(view, layer, shape))
    for name in INPUT_AXES if cpu else ():
        if name not in in_place and name in lp:
            view = _kernel_view(name, lp[name][None], tokens)
            if view is not None:
                out[name] = InPlace(view, jnp.int32(0), tuple(lp[name].shape))
    return out


def linear(x: Array, w: Array | InPlace | LoRAWeight, spec: str) -> Array:
    """x (tokens first) times a layer's weight: the einsum `spec`, or a kernel for an `InPlace`
    weight, whose [T, N] result takes the einsum's output shape; plus each token's LoRA adapter's
    delta for a `LoRAWeight` (infire_jax/lora/batched.py)."""
    if isinstance(w, LoRAWeight):
        return linear(x, w.base, spec) + w.delta(x)
    if not isinstance(w, InPlace):
        return jnp.einsum(spec, x, w)
    x2 = x.reshape(x.shape[0], -1)
    if isinstance(w.stacked, (KernelPaletteWeight, KernelQuantWeight)):
        y = w.stacked.matmul(x2, w.layer)
    else:  # panels, or [L, K, N]
        y = (cpu_matmul.panel_matmul if w.stacked.ndim == 4 else cpu_matmul.skinny_matmul)(x2, w.stacked, w.layer)
    return y.reshape(x.shape[0], *w.shape[x.ndim - 1:]).astype(x.dtype)


def _fuses(w) -> bool:
    """Whether `w` is a weight the Pallas matmul reads in place whose partials a fused epilogue takes."""
    return isinstance(w, InPlace) and isinstance(w.stacked, KernelQuantWeight) and w.stacked.fuses


def dense_mlp(lp: dict[str, Array], x: Float[Array, "T E"]) -> Float[Array, "T E"]:
    if _fuses(lp["w_gate_up"]) and _fuses(lp["w_down"]):
        return swiglu_mlp(x, lp["w_gate_up"].stacked, lp["w_down"].stacked, lp["w_down"].layer).astype(x.dtype)
    gate_up = linear(x, lp["w_gate_up"], "te,ecf->tcf")
    return linear(swiglu(gate_up[:, 0], gate_up[:, 1]), lp["w_down"], "tf,fe->te")


def project_qkv(lp: dict[str, Array], x: Float[Array, "T E"], bias: bool,
                rope: tuple[Array, Array] | None = None) -> tuple[Array, Array, Array]:
    """One GEMM for q, k and v: q [T, Hq, D] (head j*G + i is kv head j's i-th), k and v [T, Hkv, D].
    With `rope` (cos, sin), q and k come out rotated by one rotation of their common slice of the
    GEMM's output: one rotation's ops a layer (its concatenate and converts), not two."""
    qkv = linear(x, lp["wqkv"], "te,ekgd->tkgd")
    if bias:
        qkv = qkv + lp["bqkv"]
    t, hkv, g2, d = qkv.shape
    qk = qkv[:, :, :g2 - 1] if rope is None else apply_rope(qkv[:, :, :g2 - 1], *rope)
    return qk[:, :, :g2 - 2].reshape(t, hkv * (g2 - 2), d), qk[:, :, g2 - 2], qkv[:, :, g2 - 1]


def make_layer_fn(cfg: ModelConfig, cos: Array, sin: Array, meta: AttentionMetadata, attn_impl: str,
                  red: Reductions, in_place: dict[str, tuple[KernelView, tuple]] | None = None,
                  lora: LayerLoRA | None = None, nope: Int[Array, "L"] | None = None) -> Callable:
    """The body of the layer scan: (h, k_pages, v_pages), (layer weights, layer index, the layer's row
    of `local_attention_table` or None) -> carry.

    Head and MLP counts come from the weights' shapes, so the same body runs on a shard of them.
    `in_place` weights (`in_place_weights`) are not scanned: the body reads its layer of them, and
    so of the LoRA adapters' stacks (`lora`), whose deltas `linear` adds to the projections. A layer
    flagged in `nope` (`nope_table`, SmolLM3's NoPE layers) rotates by nothing: cos 1, sin 0.
    """
    scale = cfg.head_dim ** -0.5

    def mlp(lp: dict, x: Float[Array, "T E"]) -> Float[Array, "T E"]:
        if not cfg.is_moe:
            return dense_mlp(lp, x)
        return moe_mlp(lp, x, cfg=cfg, expert_axis=red.expert_axis, logits=linear(x, lp["router"], "te,ex->tx"))

    def layer(carry, xs):
        h, k_pages, v_pages = carry
        lp, idx, local = xs
        layer_meta = with_local_mask(meta, local)
        rotates = True if nope is None else nope[idx] == 0
        c, s = (cos, sin) if nope is None else (jnp.where(rotates, cos, 1.0), jnp.where(rotates, sin, 0.0))
        lp = decode_layer(dequantize_layer(lp, h.dtype))  # this layer's compressed / quantized weights, decoded
        lp = kernel_weights(lp, in_place or {}, idx, h.shape[0], cpu=red == Reductions())
        if lora is not None:
            lp = lora.attach(lp, idx)
        x = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
        if cfg.qk_norm:  # q and k normed, each with its own weight, before their rotations
            q, k, v = project_qkv(lp, x, cfg.attention_bias)
            q = apply_rope(rms_norm(q, lp["q_norm"], cfg.rms_norm_eps), c, s)
            k = apply_rope(rms_norm(k, lp["k_norm"], cfg.rms_norm_eps), c, s)
        else:
            q, k, v = project_qkv(lp, x, cfg.attention_bias, (c, s))
        o, k_pages, v_pages = paged_attention(q, k, v, k_pages, v_pages, idx, layer_meta, scale=scale,
                                              impl=attn_impl, cpu_kernel=red == Reductions())
        wo, norm = lp["wo"], lp["mlp_norm"]
        if _fuses(wo) and isinstance(norm, InPlace):  # h + o @ wo and its norm, one kernel
            h, x = residual_norm(h, o.reshape(o.shape[0], -1), wo.stacked, idx, norm.stacked, cfg.rms_norm_eps)
        else:
            h = h + psum(linear(o, wo, "thd,hde->te"), red.attn)
            x = rms_norm(h, norm.stacked[norm.layer] if isinstance(norm, InPlace) else norm, cfg.rms_norm_eps)
        h = h + psum(mlp(lp, x), red.mlp)
        return (h, k_pages, v_pages), None

    return layer


def decoder_stack(cfg: ModelConfig, attn_impl: str, red: Reductions, weights: dict[str, Array],
                  h: Float[Array, "T E"], k_pages: Array, v_pages: Array, meta: AttentionMetadata, cos: Array,
                  sin: Array, lora_slots: Int[Array, "T"] | None = None) -> tuple[Float[Array, "T E"], Array, Array]:
    """Scans the stacked layers; the KV pool is a loop carry so its updates stay in place. With
    `lora_slots`, `weights` also hold the LoRA adapters' stacks (read per layer, not scanned)."""
    weights, lora = split_stacks(weights, lora_slots, kernel=red == Reductions())
    in_place = in_place_weights(cfg, weights, h.shape[0], red)
    meta = plan_step(meta, attn_impl, h.shape[0], cfg.num_heads // cfg.num_kv_heads)
    num = jax.tree.leaves(weights)[0].shape[0]
    layer = make_layer_fn(cfg, cos, sin, meta, attn_impl, red, in_place, lora, nope_table(cfg, num))
    scanned = {name: w for name, w in weights.items() if name not in in_place}
    xs = (scanned, np.arange(num, dtype=np.int32), local_attention_table(cfg, num))
    return layer_loop(layer, (h, k_pages, v_pages), xs, num, h.shape[0])


def check_aux_layers(aux_layers: tuple[int, ...], num_layers: int) -> None:
    ascending = bool(aux_layers) and list(aux_layers) == sorted(set(aux_layers))
    if not ascending or not 0 <= aux_layers[0] <= aux_layers[-1] <= num_layers:
        raise ConfigError(f"aux_layers must be strictly increasing hidden-state indices in [0, {num_layers}] "
                          f"(i: the input of layer i, {num_layers}: the last layer's output); got {aux_layers}")


def decoder_stack_aux(cfg: ModelConfig, attn_impl: str, slot_of_output: np.ndarray, red: Reductions,
                      weights: dict[str, Array], h: Float[Array, "T E"], k_pages: Array, v_pages: Array,
                      meta: AttentionMetadata, cos: Array, sin: Array, aux: Float[Array, "N1 T E"],
                      lora_slots: Int[Array, "T"] | None = None
                      ) -> tuple[Float[Array, "T E"], Array, Array, Float[Array, "N1 T E"]]:
    """`decoder_stack` that also keeps the residual stream in `aux`, the slots `aux_slots` made (a
    StackFn with state, models/parallel.py: on a mesh the slots ride the shard_map replicated, as h).

    The scan carries one [T, E] slot per requested state plus a scratch slot: layer i writes its
    output in place (one dynamic-update-slice of T x E) into the slot `slot_of_output[i]` (of index
    i + 1, or the scratch slot), so no layer's states but the requested ones are ever kept.
    """
    weights, lora = split_stacks(weights, lora_slots, kernel=red == Reductions())
    in_place = in_place_weights(cfg, weights, h.shape[0], red)
    meta = plan_step(meta, attn_impl, h.shape[0], cfg.num_heads // cfg.num_kv_heads)
    n = cfg.num_layers
    layer = make_layer_fn(cfg, cos, sin, meta, attn_impl, red, in_place, lora, nope_table(cfg, n))

    def body(carry, xs):
        lp, idx, local, slot = xs
        (h, k_pages, v_pages), _ = layer(carry[:3], (lp, idx, local))
        return (h, k_pages, v_pages, jax.lax.dynamic_update_index_in_dim(carry[3], h, slot, 0)), None

    scanned = {name: w for name, w in weights.items() if name not in in_place}
    xs = (scanned, np.arange(n, dtype=np.int32), local_attention_table(cfg, n), slot_of_output)
    return layer_loop(body, (h, k_pages, v_pages, aux), xs, n, h.shape[0])


def run_aux_stack(stack_of: Callable[[np.ndarray], StackFn], aux_layers: tuple[int, ...], num_layers: int,
                  plan: ShardPlan | None, weights: dict, axes: dict, h: Float[Array, "T E"], kv: KVPages,
                  meta: AttentionMetadata, cos: Array, sin: Array, token_args: tuple[Array, ...] = (),
                  kv_axes: tuple[str | None, ...] = KV_POOL_AXES
                  ) -> tuple[Float[Array, "T E"], KVPages, Float[Array, "T N"]]:
    """A stack that keeps the residual stream at `aux_layers` (`stack_of(slot_of_output)`, a StackFn whose
    state is `aux_slots`' slots), on one device or inside a tp / ep mesh's shard_map, where the slots ride
    replicated as h does: (h, the pool, the states [T, len(aux_layers) * E]); `kv_axes` the pool's logical
    axes (models/kv_entry.py). Not across pipeline stages, whose layers' states would live on different
    devices."""
    check_aux_layers(aux_layers, num_layers)
    aux, slot_of_output = aux_slots(aux_layers, num_layers, h)
    stack = stack_of(slot_of_output)
    if plan is None:
        h, k_pages, v_pages, aux = stack(Reductions(), weights, h, *kv, meta, cos, sin, aux, *token_args)
    elif plan.num_stages > 1:
        raise ConfigError("aux hidden states (EAGLE-3) are kept on one device or a mesh without pipeline stages "
                          "(tp, ep), not across stages")
    else:
        h, (k_pages, v_pages), aux = run_sharded(stack, plan, weights, axes, h, kv, meta, cos, sin, kv_axes=kv_axes,
                                                 token_args=token_args, state=aux, state_axes=(None, None, None))
    return h, (k_pages, v_pages), aux_features(aux, len(aux_layers))


def slots_last(stack: Callable) -> Callable[[np.ndarray], StackFn]:
    """For `run_aux_stack`: a stack that takes `aux=(slots, slot_of_output)` after its StackFn arguments (Llama 4's,
    gpt-oss's), as a StackFn whose state is the slots."""
    def stack_of(slot_of_output: np.ndarray) -> StackFn:
        return lambda red, weights, h, k, v, meta, cos, sin, slots: stack(red, weights, h, k, v, meta, cos, sin,
                                                                           (slots, slot_of_output))

    return stack_of


def aux_slots(aux_layers: tuple[int, ...], num_layers: int, h: Float[Array, "T E"]
              ) -> tuple[Float[Array, "N1 T E"], np.ndarray]:
    """The layer scan's carry for `aux_layers` (`decoder_stack_aux`): one [T, E] slot per requested
    state, the input `h` already in the first if index 0 is requested, plus a scratch slot; and the
    slot each layer's output goes to (layer i's output is hidden-state index i + 1; the scratch slot
    for an index not requested)."""
    count = len(aux_layers)
    slot_of_output = np.full(num_layers, count, np.int32)
    for j, a in enumerate(aux_layers):
        if a > 0:
            slot_of_output[a - 1] = j
    aux = jnp.zeros((count + 1, *h.shape), h.dtype)
    if aux_layers[0] == 0:
        aux = aux.at[0].set(h)
    return aux, slot_of_output


def aux_features(aux: Float[Array, "N1 T E"], count: int) -> Float[Array, "T N"]:
    """The requested states of `aux_slots`' carry, concatenated along the features: [T, count * E]."""
    return jnp.moveaxis(aux[:count], 0, 1).reshape(aux.shape[1], count * aux.shape[2])


class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32,
                 resident: dict[str, ResidentLayout | QuantLayout] | None = None):
        self.cfg = cfg
        self.embed = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        self.layers = DecoderLayers(cfg, dtype, resident)
        self.final_norm = param((cfg.hidden_size,), ("norm",), dtype, init="ones")
        if not cfg.tie_word_embeddings:  # [V, E] like the embedding, so both heads are one code path
            self.lm_head = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)

    def embed_tokens(self, tokens: Int[Array, "T"]) -> Float[Array, "T E"]:
        return self.embed[...][tokens]

    def run_layers(
        self,
        h: Float[Array, "T E"],
        kv: KVPages,
        meta: AttentionMetadata,
        *,
        attn_impl: str,
        plan: ShardPlan | None = None,
        aux_layers: tuple[int, ...] | None = None,
        lora: LoRAStep | None = None,
    ) -> tuple[Float[Array, "T E"], KVPages] | tuple[Float[Array, "T E"], KVPages, Float[Array, "T N"]]:
        """Applies every decoder layer, on one device or (with a plan) across the mesh.

        With `aux_layers` (static; see `decoder_stack_aux`) the residual-stream states at those
        indices come back too, as [T, len(aux_layers) * E]: EAGLE-3's low/middle/high features.
        With `lora`, each token's LoRA adapter adds its delta to the projections it adapts.
        """
        cos, sin = rope_cos_sin(self.cfg, meta.positions)
        weights, axes, slots = self.layers.arrays(), self.layers.axes(), None
        if lora is not None:  # split like the weights they adapt (lora/layout.py)
            weights, slots = {**weights, **lora.stacks}, lora.slots
            axes = {**axes, **{k: stack_axes(k) for k in lora.stacks}}
        token_args = () if slots is None else (slots,)
        if aux_layers is not None:
            return run_aux_stack(functools.partial(functools.partial, decoder_stack_aux, self.cfg, attn_impl),
                                 aux_layers, self.cfg.num_layers, plan, weights, axes, h, kv, meta, cos, sin,
                                 token_args)
        stack = functools.partial(decoder_stack, self.cfg, attn_impl)
        if plan is None:
            h, k_pages, v_pages = stack(Reductions(), weights, h, *kv, meta, cos, sin, *token_args)
            return h, (k_pages, v_pages)
        return run_sharded(stack, plan, weights, axes, h, kv, meta, cos, sin, token_args=token_args)

    def logits(self, h: Float[Array, "S E"], plan: ShardPlan | None = None) -> Float[Array, "S V"]:
        head = self.embed[...] if self.cfg.tie_word_embeddings else self.lm_head[...]
        return final_logits(h, self.final_norm[...], head, self.cfg.rms_norm_eps, plan is None)

    def __call__(
        self,
        tokens: Int[Array, "T"],
        kv: KVPages,
        meta: AttentionMetadata,
        logits_indices: Int[Array, "S"],
        *,
        attn_impl: str,
        plan: ShardPlan | None = None,
        aux_layers: tuple[int, ...] | None = None,
        lora: LoRAStep | None = None,
    ) -> tuple[Float[Array, "S V"], KVPages] | tuple[Float[Array, "S V"], KVPages, Float[Array, "T N"]]:
        """Logits of each row's `logits_indices` token and the updated pool; with `aux_layers`, also
        every token's residual-stream states at those indices (`run_layers`); with `lora`, each
        token's LoRA adapter applied."""
        h = self.embed_tokens(tokens)
        if aux_layers is None:
            h, kv = self.run_layers(h, kv, meta, attn_impl=attn_impl, plan=plan, lora=lora)
            return self.logits(h[logits_indices], plan), kv
        h, kv, aux = self.run_layers(h, kv, meta, attn_impl=attn_impl, plan=plan, aux_layers=aux_layers, lora=lora)
        return self.logits(h[logits_indices], plan), kv, aux
