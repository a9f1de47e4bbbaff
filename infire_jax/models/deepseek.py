"""DeepSeek-V3-architecture decoder (DeepSeek-V3, Kimi K2, Kimi K2.5's text model): MLA + DeepSeek MoE.

Attention is Multi-head Latent Attention. Per token, the model computes q through its low-rank
path (x W_qa, RMSNorm, W_qb) and one compressed latent c = RMSNorm(x W_kva[:R]) plus one rotary
key k_pe = rope(x W_kva[R:]) shared by all heads. The paged pool stores only c and k_pe
(models/kv_entry.py). Attention runs in the absorbed form: W_uk is folded into the query
(q_lat = q_nope W_uk^T), scores are q_lat . c + q_pe . k_pe, and W_uv is applied to the
attention-weighted latent, so no per-head key or value is ever built from the cache.

The first `first_k_dense_replace` layers have a dense MLP, the rest the DeepSeek MoE MLP, so the
layers are two stacks (`dense_layers`, `moe_layers`), each scanned like llama.py's; the pool's
layer index runs across both. On a mesh (models/parallel.py) heads and MLP widths split over tp
(the latent path is replicated, each device writes the same latent into its copy of the pool),
experts over ep. Pipeline parallelism is refused for this family (sharding/plan.py).

A published quantized checkpoint's linear weights may stay quantized on the device
(`resident`: quant/grouped.py); the scan body dequantizes the current layer's dense ones just before
use, and the grouped matmul (models/moe.py) the routed experts one expert at a time.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from infire_jax.errors import ConfigError
from infire_jax.models.config import ModelConfig
from infire_jax.models.deepseek_moe import deepseek_moe_mlp
from infire_jax.models.kv_entry import kv_entry
from infire_jax.models.layers import apply_rope, head_logits, layer_loop, param, rms_norm, rope_tables
from infire_jax.models.llama import KernelView, dense_mlp, kernel_weights, linear, run_aux_stack, slots_last
from infire_jax.models.parallel import Reductions, psum, run_sharded
from infire_jax.models.quant_kernels import layer_stacks
from infire_jax.models.yarn import cos_sin_factor, inv_freq, softmax_scale
from infire_jax.quant.grouped import ROUTED_EXPERTS, GroupedLayout, GroupedParams, dequantize_kept
from infire_jax.quant.weight_parts import LayerStacks
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.mla import mla_attention, step_form
from sharding.plan import ShardPlan

KVPages = tuple[Array, Array]  # (latent pages [L, N, ps, 1, R], rotary-key pages [L, N, ps, 1, Dr])
# The layer weights that are plain matmuls, with how many leading axes of one layer's weight are inputs
# (W_uk and W_uv are not: the absorbed attention contracts them per head, HEAD_INPUTS).
DENSE_INPUTS = {"wq_a": 1, "wq_b": 1, "wkv_a": 1, "wo": 2, "w_gate_up": 1, "w_down": 1, "w_shared_gate_up": 1,
                "w_shared_down": 1}
HEAD_INPUTS = {"w_uk": 1, "w_uv": 1}


class MLALayers(LayerStacks):
    """`n` stacked decoder layers of one kind: MLA attention and a dense or a DeepSeek MoE MLP.

    The kv_b projection is held as its two halves, W_uk [H, Dn, R] and W_uv [H, R, Dv], the
    operands of the absorbed form, each head's matrix contiguous and laid out as its product reads it
    (q_lat = q_nope W_uk, o = o_lat W_uv), so a kernel reads a layer's heads in place from the stack.
    The router's bias is kept in float32, as HF keeps it. `kept` names the weights held quantized
    (`GroupedParams`), by the stack's weight name.
    """

    def __init__(self, cfg: ModelConfig, n: int, moe: bool, dtype, kept: Mapping[str, GroupedLayout]):
        m, e, h = cfg.mla, cfg.hidden_size, cfg.num_heads
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        self.attn_norm = param((n, e), ("layers", "norm"), dtype, init="ones")
        self.wq_a = param((n, e, m.q_lora_rank), ("layers", "embed", "latent"), dtype)
        self.q_a_norm = param((n, m.q_lora_rank), ("layers", "norm"), dtype, init="ones")
        self.wq_b = param((n, m.q_lora_rank, h, qk), ("layers", "latent", "q_heads", "head_dim"), dtype)
        self.wkv_a = param((n, e, m.kv_lora_rank + m.qk_rope_head_dim), ("layers", "embed", "latent"), dtype)
        self.kv_a_norm = param((n, m.kv_lora_rank), ("layers", "norm"), dtype, init="ones")
        self.w_uk = param((n, h, m.qk_nope_head_dim, m.kv_lora_rank), ("layers", "q_heads", "head_dim", "latent"),
                          dtype)
        self.w_uv = param((n, h, m.kv_lora_rank, m.v_head_dim), ("layers", "q_heads", "latent", "head_dim"), dtype)
        self.wo = param((n, h, m.v_head_dim, e), ("layers", "q_heads", "head_dim", "embed"), dtype)
        self.mlp_norm = param((n, e), ("layers", "norm"), dtype, init="ones")
        if moe:
            add_moe_params(self, cfg, n, dtype)
        else:
            f = cfg.intermediate_size
            self.w_gate_up = param((n, e, 2, f), ("layers", "embed", "gate_up", "mlp"), dtype)
            self.w_down = param((n, f, e), ("layers", "mlp", "embed"), dtype)
        for name, layout in kept.items():
            plain = getattr(self, name.rpartition(".")[2])
            setattr(self, name.rpartition(".")[2], GroupedParams(name, tuple(plain.shape), plain.axes, layout))


def add_moe_params(stack: LayerStacks, cfg: ModelConfig, n: int, dtype) -> None:
    """A stack of `n` DeepSeek-V3 MoE layers' MLP weights (this family's and GLM-4.5's): the router and
    its bias (in float32, as HF keeps it), the routed experts and the shared ones."""
    e, x, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    stack.router = param((n, e, x), ("layers", "embed", "router"), dtype)
    stack.router_bias = param((n, x), ("layers", "router"), jnp.float32, init="zeros")
    stack.w_gate_up = param((n, x, e, 2, f), ("layers", "experts", "embed", "gate_up", "mlp"), dtype)
    stack.w_down = param((n, x, f, e), ("layers", "experts", "mlp", "embed"), dtype)
    fs = f * cfg.deepseek_moe.num_shared_experts
    if fs:
        stack.w_shared_gate_up = param((n, e, 2, fs), ("layers", "embed", "gate_up", "mlp"), dtype)
        stack.w_shared_down = param((n, fs, e), ("layers", "mlp", "embed"), dtype)



def mla_project(cfg: ModelConfig, lp: dict[str, Array], x: Float[Array, "T E"], cos: Array, sin: Array
                ) -> tuple[Array, Array, Array, Array]:
    """(q_nope [T, H, Dn], roped q_pe [T, H, Dr], latent c [T, R], roped k_pe [T, Dr]) as HF's DeepseekV3Attention."""
    m = cfg.mla
    qa = rms_norm(linear(x, lp["wq_a"], "te,er->tr"), lp["q_a_norm"], cfg.rms_norm_eps)
    q = linear(qa, lp["wq_b"], "tr,rhd->thd")
    kv = linear(x, lp["wkv_a"], "te,ec->tc")
    latent = rms_norm(kv[:, :m.kv_lora_rank], lp["kv_a_norm"], cfg.rms_norm_eps)
    k_pe = apply_rope(kv[:, None, m.kv_lora_rank:], cos, sin)[:, 0]
    return q[..., :m.qk_nope_head_dim], apply_rope(q[..., m.qk_nope_head_dim:], cos, sin), latent, k_pe


def make_layer_fn(cfg: ModelConfig, moe: bool, cos: Array, sin: Array, meta: AttentionMetadata, attn_impl: str,
                  red: Reductions, in_place: dict[str, tuple[KernelView, tuple]], first: int):
    """The scan body of one stack: (h, latent pages, rope pages), (layer weights, pool layer index) -> carry.
    `in_place` weights are not scanned: the body reads its layer (pool index - `first`) of them."""
    scale = softmax_scale(cfg, cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim)
    tp = tuple(a for a in red.mlp if a != red.expert_axis)  # dense and shared MLPs are replicated over ep

    def layer(carry, xs):
        h, latent_pages, rope_pages = carry
        lp, idx = xs
        # this layer's kept dense weights, and only this layer's; routed experts stay parts, per tile
        lp = dequantize_kept(lp, h.dtype, per_expert=ROUTED_EXPERTS if moe else ())
        lp = kernel_weights(lp, in_place, idx - first, h.shape[0], cpu=False)
        x = rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps)
        q_nope, q_pe, latent, k_pe = mla_project(cfg, lp, x, cos, sin)
        o, latent_pages, rope_pages = mla_attention(q_nope, q_pe, latent, k_pe, lp["w_uk"], lp["w_uv"], latent_pages,
                                                    rope_pages, idx, meta, scale=scale, impl=attn_impl,
                                                    form=step_form(h.shape[0]))
        h = h + psum(linear(o, lp["wo"], "thv,hve->te"), red.attn)
        x = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
        if moe:
            routed, shared = deepseek_moe_mlp(lp, x, cfg=cfg, expert_axis=red.expert_axis)
            h = h + psum(routed, red.mlp) + (0 if shared is None else psum(shared, tp))
        else:
            h = h + psum(dense_mlp(lp, x), tp)
        return (h, latent_pages, rope_pages), None

    return layer


def scan_stacks(weights: dict[str, dict[str, Array]], carry: tuple, dense_inputs: dict[str, int], red: Reductions,
                make_layer: Callable[[bool, dict, int], Callable],
                aux: tuple[Float[Array, "N1 T E"], np.ndarray] | None = None) -> tuple:
    """Scans the dense stack, then the MoE stack (this family's and GLM-4.5's layout); the pool is in the
    loop carry (its first entry the residual stream), indexed across both. `make_layer(moe, in_place,
    first)`: the scan body of a stack whose first layer is pool layer `first`. With `aux` (EAGLE-3's states:
    models/llama.py's `aux_slots`, the slots and each layer's slot) the slots ride the carry too, each layer
    writing its output into its slot, and come back as its last entry."""
    start, tokens = 0, carry[0].shape[0]
    if aux is not None:
        carry = (*carry, aux[0])
    for kind in ("dense", "moe"):
        if kind not in weights:
            continue
        n = jax.tree.leaves(weights[kind])[0].shape[0]
        in_place = layer_stacks(weights[kind], tokens, dense_inputs, kind == "moe", one_device=red == Reductions(),
                                head_inputs=HEAD_INPUTS)
        scanned = {name: w for name, w in weights[kind].items() if name not in in_place}
        body, xs = make_layer(kind == "moe", in_place, start), (scanned, start + np.arange(n, dtype=np.int32))
        if aux is not None:
            body, xs = _writing_slot(body), (*xs, aux[1][start:start + n])
        carry = layer_loop(body, carry, xs, n, tokens)
        start += n
    return carry


def _writing_slot(layer: Callable) -> Callable:
    """A scan body that also writes the layer's output (its carry's first entry) into the layer's slot of the
    slots (the carry's last entry; the slot the xs' last entry)."""
    def body(carry, xs):
        (*inner, slots), (*inner_xs, slot) = carry, xs
        out, _ = layer(tuple(inner), tuple(inner_xs))
        return (*out, jax.lax.dynamic_update_index_in_dim(slots, out[0], slot, 0)), None

    return body


def decoder_stack(cfg: ModelConfig, attn_impl: str, red: Reductions, weights: dict[str, dict[str, Array]],
                  h: Float[Array, "T E"], latent_pages: Array, rope_pages: Array, meta: AttentionMetadata, cos: Array,
                  sin: Array, aux: tuple[Float[Array, "N1 T E"], np.ndarray] | None = None) -> tuple:
    """Scans the dense stack, then the MoE stack (`scan_stacks`): (h, latent pages, rope pages), and with
    `aux` the slots."""
    return scan_stacks(weights, (h, latent_pages, rope_pages), DENSE_INPUTS, red, lambda moe, in_place, first:
                       make_layer_fn(cfg, moe, cos, sin, meta, attn_impl, red, in_place, first), aux)


def mla_rope(cfg: ModelConfig, positions: Int[Array, "T"]) -> tuple[Float[Array, "T R"], Float[Array, "T R"]]:
    """The rotary tables of the tokens' positions, YaRN's cos/sin factor applied (`decoder_stack`'s cos, sin)."""
    cos, sin = rope_tables(inv_freq(cfg, cfg.mla.qk_rope_head_dim), positions)
    factor = cos_sin_factor(cfg.rope_scaling)
    return cos * factor, sin * factor


class DeepseekV3(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, resident: Mapping[str, GroupedLayout] | None = None):
        """`resident`: the checkpoint's quantized weights kept as such ("moe_layers.w_gate_up": layout)."""
        resident = dict(resident or {})
        if not all(isinstance(layout, GroupedLayout) for layout in resident.values()):
            raise ConfigError("weights_compression is not supported for the DeepSeek-V3 family")
        self.cfg = cfg
        dense = cfg.deepseek_moe.first_k_dense_replace

        def kept(stack: str) -> dict[str, GroupedLayout]:
            return {name: layout for name, layout in resident.items() if name.startswith(f"{stack}.")}

        self.embed = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        if dense:
            self.dense_layers = MLALayers(cfg, dense, False, dtype, kept("dense_layers"))
        if cfg.num_layers > dense:
            self.moe_layers = MLALayers(cfg, cfg.num_layers - dense, True, dtype, kept("moe_layers"))
        self.final_norm = param((cfg.hidden_size,), ("norm",), dtype, init="ones")
        if not cfg.tie_word_embeddings:
            self.lm_head = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)

    def _stacks(self) -> dict[str, MLALayers]:
        return {kind: getattr(self, f"{kind}_layers") for kind in ("dense", "moe") if hasattr(self, f"{kind}_layers")}

    def run_layers(self, h: Float[Array, "T E"], kv: KVPages, meta: AttentionMetadata, *, attn_impl: str,
                   plan: ShardPlan | None = None, aux_layers: tuple[int, ...] | None = None
                   ) -> tuple[Float[Array, "T E"], KVPages]:
        """Applies every decoder layer, on one device or (with a plan) across the mesh; with `aux_layers`
        (EAGLE-3's, models/llama.py `run_aux_stack`) the residual stream at those hidden-state indices
        comes back too, [T, len(aux_layers) * E]."""
        cfg = self.cfg
        cos, sin = mla_rope(cfg, meta.positions)
        weights = {kind: stack.arrays() for kind, stack in self._stacks().items()}
        axes = {kind: stack.axes() for kind, stack in self._stacks().items()}
        stack = functools.partial(decoder_stack, cfg, attn_impl)
        if aux_layers is not None:
            return run_aux_stack(slots_last(stack), aux_layers, cfg.num_layers, plan, weights, axes, h, kv, meta,
                                 cos, sin, kv_axes=kv_entry(cfg).pool_axes)
        if plan is None:
            h, latent_pages, rope_pages = stack(Reductions(), weights, h, *kv, meta, cos, sin)
            return h, (latent_pages, rope_pages)
        return run_sharded(stack, plan, weights, axes, h, kv, meta, cos, sin, kv_axes=kv_entry(cfg).pool_axes)

    def embed_tokens(self, tokens: Int[Array, "T"]) -> Float[Array, "T E"]:
        return self.embed[...][tokens]

    def logits(self, h: Float[Array, "S E"], plan: ShardPlan | None = None) -> Float[Array, "S V"]:
        """Final norm and LM head; `plan` as `Llama.logits` takes it (XLA's dot here on any mesh)."""
        h = rms_norm(h, self.final_norm[...], self.cfg.rms_norm_eps)
        head = self.embed[...] if self.cfg.tie_word_embeddings else self.lm_head[...]
        return head_logits(h, head)

    def __call__(self, tokens: Int[Array, "T"], kv: KVPages, meta: AttentionMetadata, logits_indices: Int[Array, "S"],
                 *, attn_impl: str, plan: ShardPlan | None = None) -> tuple[Float[Array, "S V"], KVPages]:
        """Logits of each row's `logits_indices` token and the updated pool."""
        h, kv = self.run_layers(self.embed_tokens(tokens), kv, meta, attn_impl=attn_impl, plan=plan)
        return self.logits(h[logits_indices]), kv
