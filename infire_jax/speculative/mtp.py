"""The multi-token-prediction (MTP) head of DeepSeek-V3 (paper, section 2.2), GLM-4.5 and Qwen3.5 / Qwen3-Next,
as vLLM's mtp runs it.

DeepSeek-V3 and GLM-4.5 carry it as decoder layer `num_hidden_layers`, Qwen3.5 as `mtp.*` (its fc,
pre_fc_norm_embedding, pre_fc_norm_hidden and norm are eh_proj, enorm, hnorm and norm here). At position
p, with the target's last hidden state h_p (after its final norm: what the target's head reads, and what
vLLM hands its drafter) and the token after it x_{p+1}, u = eh_proj(cat(enorm(embed(x_{p+1})), hnorm(h_p)))
goes through one decoder layer of the family's own (KV on the target's page table, in a one-layer pool
shaped as the target's pool entry), then shared_head.norm (Qwen3.5: norm) and the head give logits for
x_{p+2}. Further drafts reuse the one layer, its output state standing in for h (vLLM's recursion;
chain.py): the layer's output, before the head's norm (DeepSeek-V3, GLM-4.5) or after it (Qwen3.5, whose
MTP module ends in its norm). The layer runs through the family's own code (deepseek.py's MLA and
glm4_moe.py's GQA `decoder_stack` over a one-layer MoE stack, qwen3_5.py's `mtp_stack`: a gated attention
layer and its MLP or MoE), so there is one implementation of each. The embedding and the head are the
target's unless the checkpoint's differ.
On a mesh the layer is split as the target's layers are (its experts over ep, its heads over tp: GLM-4.5's
kv heads repeated up to tp as the target's, its one-layer pool split by kv head as the target's pool; an
MLA latent pool whole on every device) and runs in the mesh's shard_map; the rest is whole on every device.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from infire_jax.errors import ConfigError
from infire_jax.models import deepseek, glm4_moe, qwen3_5
from infire_jax.models.config import ModelConfig
from infire_jax.models.kv_entry import KVEntry, kv_entry
from infire_jax.models.layers import head_logits, param, rms_norm
from infire_jax.models.parallel import Reductions, run_sharded
from infire_jax.speculative.chain import KVPages, Proposal, chain_propose, draw_tokens
from pallas_kernels.metadata import AttentionMetadata
from sharding.plan import ShardPlan


def check_family(cfg: ModelConfig) -> None:
    """MTP runs the DeepSeek-V3 family's, GLM-4.5's and Qwen3.5's layer; anything else is refused by name."""
    if cfg.mla is None and cfg.architecture not in ("glm4_moe", "qwen3_5"):
        raise ConfigError(f"speculative_config.method 'mtp' serves the DeepSeek-V3 family, GLM-4.5 and Qwen3.5, "
                          f"not {cfg.architecture}")


class MTPHead(nnx.Module):
    """enorm, hnorm, eh_proj [2E, E], one decoder layer (`layers`, a stack of one: a MoE layer of the DeepSeek-V3
    family's or GLM-4.5's, or Qwen3.5's attention layer with its MLP or MoE), shared_head.norm (`norm`) and,
    where the checkpoint's differ from the target's, its own `head` [V, E] and `embed`. On a mesh `cfg` is
    the placed one (ShardPlan.effective_config: kv heads repeated up to tp)."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, own_head: bool = False, own_embed: bool = False):
        check_family(cfg)
        e = cfg.hidden_size
        self.cfg = cfg
        self.enorm = param((e,), ("norm",), dtype, init="ones")
        self.hnorm = param((e,), ("norm",), dtype, init="ones")
        self.eh_proj = param((2 * e, e), ("embed", "embed"), dtype)
        if cfg.gated_delta is not None:  # one attention layer: a config of one group has one
            self.layers = qwen3_5.AttentionLayers(dataclasses.replace(cfg, num_layers=cfg.gated_delta.interval),
                                                  dtype, {})
        else:
            self.layers = (deepseek.MLALayers(cfg, 1, True, dtype, {}) if cfg.mla is not None
                           else glm4_moe.Glm4Layers(cfg, 1, True, dtype, {}))
        self.norm = param((e,), ("norm",), dtype, init="ones")
        if own_head:
            self.head = param((cfg.vocab_size, e), ("vocab", "embed"), dtype)
        if own_embed:
            self.embed = param((cfg.vocab_size, e), ("vocab", "embed"), dtype)

    def layer(self, emb: Float[Array, "T E"], hidden: Float[Array, "T E"], kv: KVPages, meta: AttentionMetadata, *,
              attn_impl: str, plan: ShardPlan | None = None) -> tuple[Float[Array, "T E"], KVPages]:
        """Fuse, then the decoder layer; writes its KV at `meta.slot_mapping`, returns its (pre-norm) output. With
        `plan` (the layer placed split, mtp_loader.py `build_mtp_head`), it runs in the mesh's shard_map as the
        target's."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        x = jnp.concatenate([rms_norm(emb, self.enorm[...], eps), rms_norm(hidden, self.hnorm[...], eps)], axis=-1)
        u = jnp.einsum("tc,ce->te", x, self.eh_proj[...])
        key = "moe"
        if cfg.gated_delta is not None:
            stack, (cos, sin), key = qwen3_5.mtp_stack, qwen3_5.rotary_tables(cfg, meta.positions), "attention_layers"
        elif cfg.mla is not None:
            stack, (cos, sin) = deepseek.decoder_stack, deepseek.mla_rope(cfg, meta.positions)
        else:
            stack, (cos, sin) = glm4_moe.decoder_stack, glm4_moe.glm4_rope(cfg, meta.positions)
        stack = functools.partial(stack, cfg, attn_impl)
        weights = {key: self.layers.arrays()}
        if plan is not None:
            h, kv = run_sharded(stack, plan, weights, {key: self.layers.axes()}, u, kv, meta, cos, sin,
                                kv_axes=kv_entry(cfg).pool_axes)
        else:
            h, *kv = stack(Reductions(), weights, u, *kv, meta, cos, sin)
        if cfg.gated_delta is not None:  # Qwen3.5's MTP module ends in its norm: the next draft reads the normed state
            h = rms_norm(h, self.norm[...], eps)
        return h, tuple(kv)

    def logits(self, h: Float[Array, "S E"], head: Float[Array, "V E"]) -> Float[Array, "S V"]:
        """shared_head: its norm (Qwen3.5's already applied by `layer`), then `head` (this head's own or the
        target's), float32 logits."""
        if self.cfg.gated_delta is None:
            h = rms_norm(h, self.norm[...], self.cfg.rms_norm_eps)
        return head_logits(h, head)

    # What the engine's proposer (head_proposer.py) asks of a draft head.
    @property
    def kv_entry(self) -> KVEntry:
        """The target's pool entry, for one layer."""
        return kv_entry(self.cfg)

    def pool_sharding(self, plan: ShardPlan) -> jax.sharding.Sharding:
        """The one-layer pool on the mesh: as the target's pool (a GQA one split by kv head over tp)."""
        return plan.sharding(self.kv_entry.pool_axes)

    def aux_layers(self, target_num_layers: int) -> None:
        """None: the head reads the target's last layer output (`StepForward.hidden`, normed by `draft`)."""
        return None

    def draft(self, target, kv: KVPages, tokens: Int[Array, "T"], states: Float[Array, "T E"],
              meta: AttentionMetadata, last_index: Int[Array, "S"], *, num_draft: int, attn_impl: str,
              plan: ShardPlan | None = None) -> Proposal:
        """Greedy drafts after a step of `target` (the model: its embedding and LM head unless this head has its
        own): `mtp_propose` over `states`, the target's last layer outputs, normed by its final norm."""
        states = rms_norm(states, target.final_norm[...], target.cfg.rms_norm_eps)
        embed = self.embed[...] if hasattr(self, "embed") else target.embed[...]
        if hasattr(self, "head"):
            head = self.head[...]
        else:
            head = target.embed[...] if target.cfg.tie_word_embeddings else target.lm_head[...]
        return mtp_propose(self, embed, head, kv, tokens, states, meta, last_index, num_draft=num_draft,
                           attn_impl=attn_impl, plan=plan)


def mtp_propose(head: MTPHead, embed: Float[Array, "V E"], lm_head: Float[Array, "V E"], kv: KVPages,
                tokens: Int[Array, "T"], hidden: Float[Array, "T E"], meta: AttentionMetadata,
                last_index: Int[Array, "S"], *, num_draft: int, attn_impl: str,
                plan: ShardPlan | None = None) -> Proposal:
    """`chain_propose` with the MTP head, greedy (jit-able): hidden[i] is the target's last layer output at flat
    index i, tokens[i] the token after it; `embed` and `lm_head` the tables the head reads."""
    if hidden.shape[-1] != head.cfg.hidden_size:
        raise ValueError(f"hidden states of width {hidden.shape[-1]}: expected {head.cfg.hidden_size}")
    dtype = head.eh_proj.dtype

    def layer(tokens, hidden, kv, meta):
        return head.layer(embed[tokens].astype(dtype), hidden.astype(dtype), kv, meta, attn_impl=attn_impl,
                          plan=plan)

    def draw(h, key):
        logits = head.logits(h, lm_head)
        return *draw_tokens(logits, None, key), logits

    return chain_propose(layer, draw, kv, tokens, hidden, meta, last_index, num_draft=num_draft)
