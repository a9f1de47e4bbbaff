"""Gemma 3 decoder (gemma-3-1b/4b/12b/27b, text): windowed and global layers (five to one), sandwich norms.

Per layer (transformers' Gemma3DecoderLayer):
- h + post_attn_norm(attention(attn_norm(h))), then h + post_mlp_norm(mlp(mlp_norm(h)));
- q and k each RMS-normed over the head (q_norm, k_norm) before their rotation; the scores scaled
  by `query_pre_attn_scalar` ** -0.5; windowed layers see the last W keys (ModelConfig.local_attention,
  on the hybrid KV cache as gpt-oss's windows) and rotate with their own RoPE base, global layers with
  the global base and its scaling (linear on 4b and up);
- the MLP: GELU (tanh) of the gate times up, then down.
Gemma's RMSNorm multiplies by (1 + w): the loader stores 1 + w (as llama.cpp's GGUF files do), so every
norm here is models/layers.py's. The embedding is scaled by sqrt(hidden) in the weights' dtype, and the
head is the embedding (tied).

Weights are stacked over layers and scanned as models/llama.py's, with its CPU matmul kernels (panels)
and q/k/v as one weight grouped by kv head. Each step computes both RoPE tables once; a layer picks
its own by its row of `local_attention_table`. On a mesh the stack runs in models/parallel.py's
shard_map (tp splits the heads and the MLP width; pp stages hold their layers' window rows).
Layer weights may be kept quantized (int8 / fp8 per output channel, int4 groups: quant/resident.py), each
layer's dequantized in the scan as models/llama.py's, or read in place by the GPU's quantized matmul.
Palette-compressed weights, LoRA and EAGLE-3 aux states are refused with a ConfigError.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from infire_jax.errors import ConfigError
from infire_jax.models.config import ModelConfig
from infire_jax.models.decoder import DecoderModel
from infire_jax.models.layers import (apply_rope, layer_loop, local_attention_table, param, rms_norm,
                                      rope_cos_sin, with_local_mask)
from infire_jax.models.llama import in_place_weights, kernel_weights, linear, project_qkv
from infire_jax.models.panels import PanelParams
from infire_jax.models.parallel import Reductions, psum
from infire_jax.quant.resident import QuantLayout, dequantize_layer, keep_quantized, quant_layouts
from infire_jax.quant.weight_parts import LayerStacks, WeightParts
from pallas_kernels.attention import paged_attention, plan_step
from pallas_kernels.metadata import AttentionMetadata
from sharding.plan import ShardPlan

KVPages = tuple[Array, Array]  # (k_pages, v_pages), each [L, num_pages, page_size, kv_heads, head_dim]


class Gemma3Layers(LayerStacks):
    """All layers' weights, stacked on a leading `layers` axis: models/llama.py's q/k/v, o and gate/up
    layouts, q/k norms, and four norms a layer (each holding Gemma's 1 + w)."""

    takes_panels = True  # the layer body reads repacked weights (models/panels.py)
    PARTS = (WeightParts, PanelParams)

    def __init__(self, cfg: ModelConfig, dtype, resident: Mapping[str, QuantLayout]):
        n, e, hkv, d, f = cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        g = cfg.num_heads // hkv
        self.attn_norm = param((n, e), ("layers", "norm"), dtype, init="ones")
        self.wqkv = param((n, e, hkv, g + 2, d), ("layers", "embed", "kv_heads", "qkv", "head_dim"), dtype)
        self.q_norm = param((n, d), ("layers", "norm"), dtype, init="ones")
        self.k_norm = param((n, d), ("layers", "norm"), dtype, init="ones")
        self.wo = param((n, cfg.num_heads, d, e), ("layers", "q_heads", "head_dim", "embed"), dtype)
        self.post_attn_norm = param((n, e), ("layers", "norm"), dtype, init="ones")
        self.mlp_norm = param((n, e), ("layers", "norm"), dtype, init="ones")
        self.w_gate_up = param((n, e, 2, f), ("layers", "embed", "gate_up", "mlp"), dtype)
        self.w_down = param((n, f, e), ("layers", "mlp", "embed"), dtype)
        self.post_mlp_norm = param((n, e), ("layers", "norm"), dtype, init="ones")
        keep_quantized(self, resident)


def gelu_glu(gate: Float[Array, "... F"], up: Float[Array, "... F"]) -> Float[Array, "... F"]:
    """gelu_pytorch_tanh(gate) * up in float32, rounded once to the inputs' dtype (as layers.swiglu)."""
    f32 = jnp.float32
    return (jax.nn.gelu(gate.astype(f32), approximate=True) * up.astype(f32)).astype(gate.dtype)


def scaled_embedding(table: Float[Array, "V E"], tokens: Int[Array, "T"]) -> Float[Array, "T E"]:
    """The embedding rows times sqrt(hidden), the factor rounded to the weights' dtype as HF's (Gemma 3, 4)."""
    return table[tokens] * jnp.asarray(math.sqrt(table.shape[1]), jnp.float32).astype(table.dtype)


def decoder_stack(cfg: ModelConfig, attn_impl: str, red: Reductions, weights: dict[str, Array],
                  h: Float[Array, "T E"], k_pages: Array, v_pages: Array, meta: AttentionMetadata,
                  cos: Float[Array, "T D"], sin: Float[Array, "T D"]) -> tuple[Float[Array, "T E"], Array, Array]:
    """Scans the stacked layers (a pipeline stage's, inside the mesh's shard_map). `cos` and `sin` hold
    the global layers' table, then the windowed layers' (`gemma3_rope`); each layer's (chunk, window)
    row of `local_attention_table`, scanned beside its weights, picks its mask and its table."""
    tokens, n, one_device = h.shape[0], weights["attn_norm"].shape[0], red == Reductions()
    meta = plan_step(meta, attn_impl, tokens, cfg.num_heads // cfg.num_kv_heads)
    # Not the fused residual norm's in-place mlp_norm (models/llama.py): Gemma norms wo's output before the add.
    in_place = {k: v for k, v in in_place_weights(cfg, weights, tokens, red).items() if k != "mlp_norm"}
    scale, eps, half = cfg.gemma3.query_pre_attn_scalar ** -0.5, cfg.rms_norm_eps, cos.shape[-1] // 2

    def layer(carry, xs):
        h, k_pages, v_pages = carry
        lp, idx, local = xs
        lp = kernel_weights(dequantize_layer(lp, h.dtype), in_place, idx, tokens, cpu=one_device)
        windowed = False if local is None else local[1] > 0
        c, s = (jnp.where(windowed, t[:, half:], t[:, :half]) for t in (cos, sin))
        q, k, v = project_qkv(lp, rms_norm(h, lp["attn_norm"], eps), False)
        q = apply_rope(rms_norm(q, lp["q_norm"], eps), c, s)
        k = apply_rope(rms_norm(k, lp["k_norm"], eps), c, s)
        o, k_pages, v_pages = paged_attention(q, k, v, k_pages, v_pages, idx, with_local_mask(meta, local),
                                              scale=scale, impl=attn_impl, cpu_kernel=one_device)
        h = h + rms_norm(psum(linear(o, lp["wo"], "thd,hde->te"), red.attn), lp["post_attn_norm"], eps)
        gate_up = linear(rms_norm(h, lp["mlp_norm"], eps), lp["w_gate_up"], "te,ecf->tcf")
        y = psum(linear(gelu_glu(gate_up[:, 0], gate_up[:, 1]), lp["w_down"], "tf,fe->te"), red.mlp)
        return (h + rms_norm(y, lp["post_mlp_norm"], eps), k_pages, v_pages), None

    scanned = {name: w for name, w in weights.items() if name not in in_place}
    xs = (scanned, np.arange(n, dtype=np.int32), local_attention_table(cfg, n))
    return layer_loop(layer, (h, k_pages, v_pages), xs, n, tokens)


def gemma3_rope(cfg: ModelConfig, positions: Int[Array, "T"]) -> tuple[Float[Array, "T D"], Float[Array, "T D"]]:
    """cos and sin of the global layers' frequencies (rope_theta, rope_scaling), then of the windowed
    layers' (their own base, unscaled), side by side: per-token arrays the mesh's pipeline slices."""
    local = dataclasses.replace(cfg, rope_theta=cfg.gemma3.local_rope_theta, rope_scaling=None)
    tables = [rope_cos_sin(c, positions) for c in (cfg, local)]
    return tuple(jnp.concatenate([g, w], axis=-1) for g, w in zip(*tables))


class Gemma3(DecoderModel):
    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, resident: Mapping | None = None):
        """`resident`: layer weights kept quantized, by weight name (`wqkv`, `w_gate_up`, ...)."""
        self.cfg = cfg
        self.embed = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        self.layers = Gemma3Layers(cfg, dtype, quant_layouts("Gemma 3", resident))
        self.final_norm = param((cfg.hidden_size,), ("norm",), dtype, init="ones")
        if not cfg.tie_word_embeddings:
            self.lm_head = param((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)

    def embed_tokens(self, tokens: Int[Array, "T"]) -> Float[Array, "T E"]:
        return scaled_embedding(self.embed[...], tokens)

    def run_layers(self, h: Float[Array, "T E"], kv: KVPages, meta: AttentionMetadata, *, attn_impl: str,
                   plan: ShardPlan | None = None, aux_layers: tuple[int, ...] | None = None
                   ) -> tuple[Float[Array, "T E"], KVPages]:
        """Applies every decoder layer, on one device or (with a plan) across the mesh."""
        if aux_layers is not None:
            raise ConfigError("Gemma 3 runs without EAGLE-3 aux states")
        cos, sin = gemma3_rope(self.cfg, meta.positions)
        return self.run_stack(functools.partial(decoder_stack, self.cfg, attn_impl), self.layers.arrays(),
                              self.layers.axes(), h, kv, meta, cos, sin, plan)
