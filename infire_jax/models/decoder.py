"""What the decoder models share around their layers (models/gpt_oss.py, llama4.py, gemma3.py,
glm4_moe.py): the embedding lookup, the final norm and LM head, and a step as embed, `run_layers`,
logits. Each model builds its own weights and `run_layers`."""

from __future__ import annotations

from flax import nnx
from jaxtyping import Array, Float, Int

from infire_jax.models.layers import final_logits
from infire_jax.models.parallel import Reductions, StackFn, run_sharded
from pallas_kernels.metadata import AttentionMetadata
from sharding.plan import ShardPlan

KVPages = tuple[Array, Array]  # (k_pages, v_pages), each [L, num_pages, page_size, kv_heads, head_dim]


class DecoderModel(nnx.Module):
    """A subclass holds `cfg`, `embed` [V, E], `final_norm` and, unless tied, `lm_head` [V, E]."""

    def embed_tokens(self, tokens: Int[Array, "T"]) -> Float[Array, "T E"]:
        return self.embed[...][tokens]

    def logits(self, h: Float[Array, "S E"], plan: ShardPlan | None = None) -> Float[Array, "S V"]:
        head = self.embed[...] if self.cfg.tie_word_embeddings else self.lm_head[...]
        return final_logits(h, self.final_norm[...], head, self.cfg.rms_norm_eps, plan is None)

    def run_stack(self, stack: StackFn, weights: dict, axes: dict, h: Float[Array, "T E"], kv: KVPages,
                  meta: AttentionMetadata, cos: Array, sin: Array, plan: ShardPlan | None
                  ) -> tuple[Float[Array, "T E"], KVPages]:
        """`stack` (models/parallel.py's StackFn) over the model's layer weights: on one device, or across
        the plan's mesh."""
        if plan is None:
            h, k_pages, v_pages = stack(Reductions(), weights, h, *kv, meta, cos, sin)
            return h, (k_pages, v_pages)
        return run_sharded(stack, plan, weights, axes, h, kv, meta, cos, sin)

    def __call__(self, tokens: Int[Array, "T"], kv: KVPages, meta: AttentionMetadata, logits_indices: Int[Array, "S"],
                 *, attn_impl: str, plan: ShardPlan | None = None, aux_layers: tuple[int, ...] | None = None
                 ) -> tuple[Float[Array, "S V"], KVPages] | tuple[Float[Array, "S V"], KVPages, Float[Array, "T N"]]:
        """Logits of each row's `logits_indices` token and the updated pool; with `aux_layers`, also every
        token's residual-stream states at those indices (a model's `run_layers` that keeps them)."""
        out = self.run_layers(self.embed_tokens(tokens), kv, meta, attn_impl=attn_impl, plan=plan,
                              aux_layers=aux_layers)
        return self.logits(out[0][logits_indices], plan), *out[1:]
