"""The EAGLE-3 draft head (Li et al., 2025): one decoder layer over the target's fused features.

The head reads three residual-stream states of the target (low, middle, high: `Llama(aux_layers=...)`),
fuses them with `fc` [3 Et -> E], and runs one Llama decoder layer whose q/k/v take 2E inputs,
cat(input_norm(embed(token)), hidden_norm(hidden)); its LM head covers a reduced draft vocabulary,
mapped to target ids by `d2t` (target id = draft id + d2t[draft id]), as in the public EAGLE code.

Positions follow that code: the head's input at position p is (embed(x_{p+1}), h_p), where h_p is
the target's state at p and x_{p+1} the token after it; its output there predicts x_{p+2}. Its KV
for position p is written to the target's slot for p (same page table, a one-layer pool of its own),
so the head needs no page bookkeeping beyond the target's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from infire_jax.models.config import ModelConfig, RopeScaling
from infire_jax.models.kv_entry import KVEntry, kv_entry
from infire_jax.models.layers import apply_rope, head_logits, param, rms_norm, rope_cos_sin
from infire_jax.models.llama import KVPages, dense_mlp, project_qkv
from infire_jax.speculative.chain import Proposal, chain_propose, draw_tokens
from pallas_kernels.attention import paged_attention
from pallas_kernels.metadata import AttentionMetadata


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int  # E, the head's width
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (d2t maps into it)
    draft_vocab_size: int
    target_hidden_size: int  # Et: fc takes 3 Et
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    # `eagle_aux_hidden_state_layer_ids` as published: ids of target layers whose OUTPUT is read
    # (SpecForge and SGLang's reading); None: the EAGLE default.
    aux_layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False  # residual = hidden_norm(hidden) instead of hidden
    has_embed: bool = False  # the checkpoint carries its own embed_tokens (else the target's is used)
    # speculators' variants: an RMSNorm before fc over the three states together ("concat": norm_before_fc,
    # gpt-oss style) or over each ("each": fc_norm); norm_output: the state a draft feeds the next one is the
    # layer's output after the final norm (Eagle 3.1)
    fc_norm: str = "none"
    norm_output: bool = False
    qk_norm: bool = False  # a Qwen3 decoder layer (speculators' default): q and k RMS-normed per head before RoPE

    @property
    def layer_config(self) -> ModelConfig:
        """The decoder layer as a one-layer Llama config (for RoPE and head counts)."""
        return ModelConfig("llama", self.vocab_size, self.hidden_size, self.intermediate_size, 1, self.num_heads,
                           self.num_kv_heads, self.head_dim, rms_norm_eps=self.rms_norm_eps,
                           rope_theta=self.rope_theta, rope_scaling=self.rope_scaling)

    def aux_layers(self, target_num_layers: int) -> tuple[int, ...]:
        """The target's hidden-state indices (HF `output_hidden_states`, i: the input of layer i) to
        pass as `Llama(aux_layers=...)`: (2, L // 2, L - 3) by default as in EAGLE/vLLM/SGLang, else
        each published layer id + 1 (that layer's output), as SpecForge trains and SGLang serves."""
        if self.aux_layer_ids is None:
            return 2, target_num_layers // 2, target_num_layers - 3
        return tuple(i + 1 for i in self.aux_layer_ids)


class IdMap(nnx.Variable):
    """A fixed integer table loaded with the weights (not a trained parameter)."""


class Eagle3Head(nnx.Module):
    """fc, one decoder layer (2E-input q/k/v, fused like the target's), final norm, draft LM head, d2t."""

    def __init__(self, cfg: Eagle3Config, *, dtype=jnp.float32):
        e, hkv, d = cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim
        g = cfg.num_heads // hkv
        self.cfg = cfg
        self.fc = param((3 * cfg.target_hidden_size, e), ("embed", "embed"), dtype)
        self.input_norm = param((e,), ("norm",), dtype, init="ones")
        self.hidden_norm = param((e,), ("norm",), dtype, init="ones")
        self.wqkv = param((2 * e, hkv, g + 2, d), ("embed", "kv_heads", "qkv", "head_dim"), dtype)
        self.wo = param((cfg.num_heads, d, e), ("q_heads", "head_dim", "embed"), dtype)
        self.mlp_norm = param((e,), ("norm",), dtype, init="ones")
        if cfg.qk_norm:
            self.q_norm = param((d,), ("norm",), dtype, init="ones")
            self.k_norm = param((d,), ("norm",), dtype, init="ones")
        self.w_gate_up = param((e, 2, cfg.intermediate_size), ("embed", "gate_up", "mlp"), dtype)
        self.w_down = param((cfg.intermediate_size, e), ("mlp", "embed"), dtype)
        self.final_norm = param((e,), ("norm",), dtype, init="ones")
        self.lm_head = param((cfg.draft_vocab_size, e), ("vocab", "embed"), dtype)
        self.d2t = IdMap(jnp.zeros((cfg.draft_vocab_size,), jnp.int32))
        if cfg.has_embed:
            self.embed = param((cfg.vocab_size, e), ("vocab", "embed"), dtype)
        et = cfg.target_hidden_size
        if cfg.fc_norm == "concat":
            self.fc_input_norm = param((3 * et,), ("norm",), dtype, init="ones")
        elif cfg.fc_norm == "each":
            self.fc_input_norms = param((3, et), (None, "norm"), dtype, init="ones")

    def fuse(self, aux: Float[Array, "T N"]) -> Float[Array, "T E"]:
        """The target's low/middle/high states [T, 3 Et] -> the head's input width E (normed first where the
        head was trained so)."""
        x, eps = aux.astype(self.fc.dtype), self.cfg.rms_norm_eps
        if self.cfg.fc_norm == "concat":
            x = rms_norm(x, self.fc_input_norm[...], eps)
        elif self.cfg.fc_norm == "each":
            parts = x.reshape(x.shape[0], 3, -1)
            x = rms_norm(parts, self.fc_input_norms[...], eps).reshape(x.shape)
        return jnp.einsum("tc,ce->te", x, self.fc[...])

    def layer(self, emb: Float[Array, "T E"], hidden: Float[Array, "T E"], kv: KVPages, meta: AttentionMetadata, *,
              attn_impl: str) -> tuple[Float[Array, "T E"], KVPages]:
        """The decoder layer; writes k/v at `meta.slot_mapping` and returns its (pre-norm) output."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        normed = rms_norm(hidden, self.hidden_norm[...], eps)
        residual = normed if cfg.norm_before_residual else hidden
        x = jnp.concatenate([rms_norm(emb, self.input_norm[...], eps), normed], axis=-1)
        rope = rope_cos_sin(cfg.layer_config, meta.positions)
        if cfg.qk_norm:
            q, k, v = project_qkv({"wqkv": self.wqkv[...]}, x, False)
            q, k = (apply_rope(rms_norm(a, w[...], eps), *rope) for a, w in ((q, self.q_norm), (k, self.k_norm)))
        else:
            q, k, v = project_qkv({"wqkv": self.wqkv[...]}, x, False, rope)
        o, k_pages, v_pages = paged_attention(q, k, v, *kv, jnp.int32(0), meta, scale=cfg.head_dim ** -0.5,
                                              impl=attn_impl)
        h = residual + jnp.einsum("thd,hde->te", o, self.wo[...])
        mlp = {"w_gate_up": self.w_gate_up[...], "w_down": self.w_down[...]}
        return h + dense_mlp(mlp, rms_norm(h, self.mlp_norm[...], eps)), (k_pages, v_pages)

    def output(self, h: Float[Array, "T E"]) -> Float[Array, "T E"]:
        """The state a draft passes on: the layer's output, or with `norm_output` that after the final norm."""
        return rms_norm(h, self.final_norm[...], self.cfg.rms_norm_eps) if self.cfg.norm_output else h

    def logits(self, h: Float[Array, "S E"]) -> Float[Array, "S Vd"]:
        """Draft-vocabulary logits in float32 (`head_logits`: the head read once in its dtype) of `output`'s
        states (normed here unless already)."""
        normed = h if self.cfg.norm_output else rms_norm(h, self.final_norm[...], self.cfg.rms_norm_eps)
        return head_logits(normed, self.lm_head[...])

    # What the engine's proposer (head_proposer.py) asks of a draft head.
    def aux_layers(self, target_num_layers: int) -> tuple[int, ...]:
        """The target states the head reads (`Eagle3Config.aux_layers`)."""
        return self.cfg.aux_layers(target_num_layers)

    @property
    def kv_entry(self) -> KVEntry:
        """What a token stores in the head's one-layer pool."""
        return kv_entry(self.cfg.layer_config)

    def pool_sharding(self, plan) -> jax.sharding.Sharding:
        """The one-layer pool on a mesh: whole on every device, as the head."""
        return plan.replicated

    def draft(self, target, kv: KVPages, tokens: Int[Array, "T"], states: Float[Array, "T N"],
              meta: AttentionMetadata, last_index: Int[Array, "S"], *, num_draft: int, attn_impl: str,
              plan=None) -> Proposal:
        """Greedy drafts after a step of `target` (the model, for its embedding): `eagle3_propose` (on a mesh,
        `plan`, replicated whole: GSPMD)."""
        return eagle3_propose(self, target.embed[...], kv, tokens, states, meta, last_index, num_draft=num_draft,
                              attn_impl=attn_impl)


def _draw(head: Eagle3Head, logits: Float[Array, "S Vd"], temperature: Float[Array, "S"] | None,
          key: Array | None) -> tuple[Int[Array, "S"], Float[Array, "S V"]]:
    """A draft per row in target ids, and the target-vocab distribution it was drawn from."""
    token, q = draw_tokens(logits, temperature, key)
    d2t = head.d2t[...]
    target = jnp.arange(d2t.shape[0]) + d2t
    probs = jnp.zeros((logits.shape[0], head.cfg.vocab_size), jnp.float32).at[:, target].set(q)
    return token + d2t[token], probs


def eagle3_propose(
    head: Eagle3Head,
    embed: Float[Array, "V E"] | None,
    kv: KVPages,
    tokens: Int[Array, "T"],
    hidden: Float[Array, "T N"],
    meta: AttentionMetadata,
    last_index: Int[Array, "S"],
    *,
    num_draft: int,
    attn_impl: str,
    temperature: Float[Array, "S"] | None = None,
    key: Array | None = None,
) -> Proposal:
    """`chain_propose` with this head (see there): hidden[i] is the target's aux states at flat index i,
    [T, 3 Et] (or already fused, [T, E]). `embed` is the target's embedding table, used unless the head
    carries its own."""
    cfg = head.cfg
    if hasattr(head, "embed"):
        embed = head.embed[...]
    elif embed is None:
        raise ValueError("this EAGLE-3 head has no embed_tokens of its own: pass the target's embedding")
    if hidden.shape[-1] == 3 * cfg.target_hidden_size:
        hidden = head.fuse(hidden)
    elif hidden.shape[-1] != cfg.hidden_size:
        raise ValueError(f"hidden states of width {hidden.shape[-1]}: expected {3 * cfg.target_hidden_size} "
                         f"(3 x target hidden) or {cfg.hidden_size}")
    if (temperature is None) != (key is None):
        raise ValueError("sampled drafting needs both a temperature per row and a key")
    dtype = head.lm_head.dtype

    def layer(tokens, hidden, kv, meta):
        h, kv = head.layer(embed[tokens].astype(dtype), hidden.astype(dtype), kv, meta, attn_impl=attn_impl)
        return head.output(h), kv

    def draw(h, key):
        logits = head.logits(h)
        return *_draw(head, logits, temperature, key), logits

    keys = None if key is None else jax.random.split(key, num_draft)
    return chain_propose(layer, draw, kv, tokens, hidden, meta, last_index, num_draft=num_draft, keys=keys)
