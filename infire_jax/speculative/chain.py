"""Drafting with a one-layer head on the target's states: what EAGLE-3 (eagle3.py) and MTP (mtp.py) share.

Both heads take, at position p, the token after it x_{p+1} and a target state h_p, run one decoder
layer of their own (KV on the target's page table, in a one-layer pool) and predict x_{p+2}. A step
first catches up over every token the target computed, then chains single-token steps: draft j + 1
is the head's output at the next position on input (draft j, the head's previous output state).
The heads differ only in that layer and in how logits become a draft, which they pass in here.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from infire_jax.sample.sampler import draw_from_weights
from pallas_kernels.attention import decode_only_steps
from pallas_kernels.metadata import NULL_PAGE, AttentionMetadata

KVPages = tuple[Array, Array]  # the head's one-layer pool, shaped as its layer stores a token
# (token ids after each position, the states there, pool, metadata) -> (the layer's output states, pool)
LayerFn = Callable[[Int[Array, "T"], Float[Array, "T E"], KVPages, AttentionMetadata],
                   tuple[Float[Array, "T E"], KVPages]]
# (output states of the rows, a key or None) -> (drafts in target ids, the target-vocab distribution each
# was drawn from, the head's raw logits)
DrawFn = Callable[[Float[Array, "S E"], Array | None], tuple[Int[Array, "S"], Float[Array, "S V"], Float[Array, "S Vd"]]]


class Proposal(NamedTuple):
    token_ids: Int[Array, "S K"]  # drafts, in target ids
    probs: Float[Array, "S K V"]  # the target-vocab distribution each draft was drawn from (one-hot if greedy)
    draft_logits: Float[Array, "S K Vd"]  # the head's raw logits (EAGLE-3: over its draft vocabulary)
    kv: KVPages


def chain_metadata(meta: AttentionMetadata, positions: Int[Array, "S"], page_size: int) -> AttentionMetadata:
    """One token per row at `positions`, on the rows' own pages: a chained draft step.

    A position past the row's page table, and every padding row, writes into the null page.
    """
    s, width = meta.page_table.shape
    rows = jnp.arange(s, dtype=jnp.int32)
    valid = rows < meta.num_seqs
    page_idx = positions // page_size
    page = meta.page_table[rows, jnp.clip(page_idx, 0, width - 1)]
    page = jnp.where(valid & (page_idx < width), page, NULL_PAGE)
    return AttentionMetadata(
        positions=jnp.where(valid, positions, 0).astype(jnp.int32),
        slot_mapping=(page * page_size + positions % page_size).astype(jnp.int32),
        seq_ids=jnp.where(valid, rows, s), page_table=meta.page_table,
        kv_lens=jnp.where(valid, positions + 1, 0).astype(meta.kv_lens.dtype),
        cu_q_lens=jnp.minimum(jnp.arange(s + 1), meta.num_seqs).astype(meta.cu_q_lens.dtype),
        num_seqs=meta.num_seqs)


def draw_tokens(logits: Float[Array, "S V"], temperature: Float[Array, "S"] | None,
                key: Array | None) -> tuple[Int[Array, "S"], Float[Array, "S V"]]:
    """A token per row of the logits' vocabulary and the distribution it was drawn from: argmax and a
    one-hot (temperature None or 0), or a sample of softmax(logits / temperature)."""
    greedy = jnp.argmax(logits, axis=-1)
    q = jax.nn.one_hot(greedy, logits.shape[-1], dtype=jnp.float32)
    if temperature is None:
        return greedy, q
    hot = (temperature > 0)[:, None]
    scaled = logits / jnp.where(hot, temperature[:, None], 1.0)
    probs = jax.nn.softmax(scaled, axis=-1)
    token = jnp.where(hot[:, 0], draw_from_weights(probs, jax.random.uniform(key, logits.shape[:1])), greedy)
    return token, jnp.where(hot, probs, q)


def chain_propose(layer: LayerFn, draw: DrawFn, kv: KVPages, tokens: Int[Array, "T"], hidden: Float[Array, "T E"],
                  meta: AttentionMetadata, last_index: Int[Array, "S"], *, num_draft: int,
                  keys: Array | None = None) -> Proposal:
    """Catch-up over the step's tokens, then `num_draft - 1` chained single-token steps (jit-able).

    tokens[i] is the token AFTER the one the target processed at flat index i (the next token of
    the row: the next prompt token, an accepted draft, or the newly sampled one) and hidden[i] the
    target's state there; meta is the target's step metadata. last_index[r] is row r's last valid
    catch-up index (its last accepted position q_r); its output gives draft 1. Draft j >= 2 is the
    head's output at position q_r + j - 1 on input (draft j-1, the head's previous output state).

    KV written: every catch-up token's position (meta.slot_mapping, including positions past q_r
    whose tokens were rejected), then positions q_r + 1 .. q_r + num_draft - 1 on the rows' pages
    (the null page where the page table ends, and for padding rows). The head's KV is therefore
    exact for every position <= q_r; later slots are scratch that the next call's catch-up
    overwrites before anything reads them, as long as that call starts at q_r + 1 (or earlier).
    `keys`: one per draft, for sampled drafts.
    """
    if num_draft < 1:
        raise ValueError(f"num_draft must be at least 1, got {num_draft}")
    h, kv = layer(tokens, hidden, kv, meta)
    h = h[last_index]
    token, probs, logits = draw(h, None if keys is None else keys[0])
    start = meta.positions[last_index]
    page_size = kv[0].shape[2]

    def step(carry, xs):
        kv, h, token = carry
        j, step_key = xs
        h, kv = layer(token, h, kv, chain_metadata(meta, start + j, page_size))
        token, probs, logits = draw(h, step_key)
        return (kv, h, token), (token, probs, logits)

    xs = (jnp.arange(1, num_draft), None if keys is None else keys[1:])
    with decode_only_steps():  # chained steps: a token a row, no prefill kernel
        (kv, _, _), (tokens_n, probs_n, logits_n) = jax.lax.scan(step, (kv, h, token), xs, length=num_draft - 1)

    def stack(first, rest):
        return jnp.concatenate([first[:, None], jnp.moveaxis(rest, 0, 1)], axis=1)

    return Proposal(stack(token, tokens_n), stack(probs, probs_n), stack(logits, logits_n), kv)
