"""Checking proposed tokens on the device, in the step's sampler program: lossless speculation.

A row with k proposed tokens d_1..d_k was run through the model as k+1 tokens, so its logits at
position j (0 <= j <= k) give the target's distribution p_j of the token after d_j (d_0 is the
row's last known token). Each position is then treated as a row of its own by the ordinary
sampler functions: penalties see d_1..d_j as generated tokens, and temperature, min-p, top-k and
top-p shape p_j as they would without speculation (vLLM's rejection sampler does the same).

* Greedy rows accept d_{j+1} while it is the argmax of position j, and add that argmax at the
  first mismatch (or after the last proposal: the bonus token).
* Sampled rows use speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023):
  d_{j+1} is accepted with probability min(1, p_j(d) / q_j(d)), where q_j is the proposer's
  distribution (one-hot for n-gram proposals); at the first rejection the token is drawn from
  normalize(max(p_j - q_j, 0)); if all are accepted, the bonus is drawn from p_k. The output then
  has exactly the target's distribution.

Random numbers come from (request seed, draw index) as in the plain sampler, so a seeded request
replays exactly. Rows without proposals go through the same code with k = 0.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from infire_jax.sample.sampler import (SamplingInputs, apply_penalties, argmax, biased, draw_from_weights, draw_key,
                                       draw_uniforms, grammar_masked, logprobs_of, no_logprobs, sampling_logits,
                                       suppress)


class VerifyOutput(NamedTuple):
    tokens: Int[Array, "S P"]  # the accepted proposals, then the token sampled after them; -1 beyond
    num_tokens: Int[Array, "S"]  # accepted proposals + 1
    logprob: Float[Array, "S P"]  # of each output token, under the model's raw distribution
    top_ids: Int[Array, "S P L"]
    top_logprobs: Float[Array, "S P L"]


def _per_position(s: SamplingInputs, positions: int) -> SamplingInputs:
    """Each row's parameters once per position; position j draws with index step + j."""
    rep = jax.tree.map(lambda x: jnp.repeat(x, positions, axis=0), s)
    return rep._replace(step=(s.step[:, None] + jnp.arange(positions, dtype=s.step.dtype)).reshape(-1))


def _penalize(logits, ps: SamplingInputs, counts_table, prompt_table, slots, drafts, num_drafts):
    """Penalties at every position, with the proposals before that position counted as output."""
    rows, k = drafts.shape
    p, v = k + 1, logits.shape[-1]
    counts = jnp.repeat(counts_table[slots], p, axis=0)
    later, earlier = np.tril_indices(p, -1)  # position `later` has seen proposal `earlier` (0-based)
    flat_rows = jnp.arange(rows)[:, None] * p + later[None, :]
    seen = jnp.where(earlier[None, :] < num_drafts[:, None], drafts[:, earlier], v)
    counts = counts.at[flat_rows, seen].add(1, mode="drop")
    return apply_penalties(logits, ps, counts, jnp.repeat(prompt_table[slots], p, axis=0))


def _uniform(seed, step):
    return jax.random.uniform(jax.random.fold_in(draw_key(seed, step), 1))


def _decide(x, ps: SamplingInputs, s: SamplingInputs, drafts, num_drafts, draft_probs, random: bool,
            truncation: bool | None):
    """(accepted proposals [S], the token after them [S]) from the processed logits x [S*P, V]."""
    rows, k = drafts.shape
    p, v = k + 1, x.shape[-1]
    r = jnp.arange(rows)
    greedy = argmax(x).reshape(rows, p)
    accept = greedy[:, :k] == drafts
    if random:
        probs = jax.nn.softmax(sampling_logits(x, ps, truncation), axis=-1).reshape(rows, p, v)
        safe = jnp.clip(drafts, 0, v - 1)
        p_d = jnp.take_along_axis(probs[:, :k], safe[..., None], axis=-1)[..., 0]
        q_d = 1.0 if draft_probs is None else jnp.take_along_axis(draft_probs, safe[..., None], axis=-1)[..., 0]
        steps = s.step[:, None] + jnp.arange(k, dtype=s.step.dtype)
        u = jax.vmap(jax.vmap(_uniform, in_axes=(None, 0)))(s.seed.astype(jnp.uint32), steps)
        accept = jnp.where(s.temperature[:, None] > 0, u * q_d < p_d, accept)
    accept = accept & (jnp.arange(k) < num_drafts[:, None])
    accepted = jnp.sum(jnp.cumprod(accept, axis=-1), axis=-1).astype(jnp.int32)
    final = greedy[r, accepted]
    if random:
        p_a = probs[r, accepted]
        at = jnp.minimum(accepted, k - 1)
        q_a = jax.nn.one_hot(drafts[r, at], v, dtype=p_a.dtype) if draft_probs is None else draft_probs[r, at]
        residual = jnp.where((accepted < num_drafts)[:, None], jnp.maximum(p_a - q_a, 0.0), p_a)
        residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_a)
        drawn = draw_from_weights(residual, draw_uniforms(s.seed, s.step + accepted))
        final = jnp.where(s.temperature > 0, drawn, final)
    return accepted, final


def verify(
    logits: Float[Array, "SP V"],
    s: SamplingInputs,
    counts_table: Int[Array, "R V"],
    prompt_table: Bool[Array, "R V"],
    slots: Int[Array, "S"],
    drafts: Int[Array, "S K"],
    num_drafts: Int[Array, "S"],
    draft_probs: Float[Array, "S K V"] | None,
    branch: bool,
    grammar_mask: Int[Array, "SP W"] | None = None,
) -> VerifyOutput:
    """Accepts a prefix of each row's proposals and samples the token after it.

    `branch`: skip unused work with `lax.cond` (CPU), else run every part (GPU, see sample/sampler.py).
    `grammar_mask` (structured outputs, [S * (K + 1), W]) holds what each position allows, given
    the proposals before it; it applies first, as in the plain sampler.
    """
    rows, k = drafts.shape
    p = k + 1
    ps = _per_position(s, p)
    x = logits
    if grammar_mask is not None:
        x = grammar_masked(x, grammar_mask, branch)
    x = biased(x, ps, branch)
    if branch:
        has_penalty = jnp.any((s.repetition_penalty != 1.0) | (s.presence_penalty != 0) | (s.frequency_penalty != 0))
        x = jax.lax.cond(has_penalty, lambda y: _penalize(y, ps, counts_table, prompt_table, slots, drafts,
                                                          num_drafts), lambda y: y, x)
        x = jax.lax.cond(jnp.any(s.suppress_ids >= 0), suppress, lambda y, _: y, x, ps.suppress_ids)
        accepted, final = jax.lax.cond(
            jnp.any(s.temperature > 0),
            lambda y: _decide(y, ps, s, drafts, num_drafts, draft_probs, True, None),
            lambda y: _decide(y, ps, s, drafts, num_drafts, draft_probs, False, None), x)
    else:
        x = suppress(_penalize(x, ps, counts_table, prompt_table, slots, drafts, num_drafts), ps.suppress_ids)
        accepted, final = _decide(x, ps, s, drafts, num_drafts, draft_probs, True, True)
    pos = jnp.arange(p)
    padded = jnp.concatenate([drafts, jnp.full((rows, 1), -1, drafts.dtype)], axis=1)
    tokens = jnp.where(pos < accepted[:, None], padded, jnp.where(pos == accepted[:, None], final[:, None], -1))
    flat = jnp.maximum(tokens, 0).reshape(-1)
    if branch:
        lp = jax.lax.cond(jnp.any(s.want_logprobs), logprobs_of, lambda *_: no_logprobs(rows * p), logits, flat)
    else:
        lp = logprobs_of(logits, flat)
    chosen, top_ids, top_lp = lp
    return VerifyOutput(tokens, accepted + 1, chosen.reshape(rows, p), top_ids.reshape(rows, p, -1),
                        top_lp.reshape(rows, p, -1))


def count_accepted(counts_table: Int[Array, "R V"], slots: Int[Array, "S"], drafts: Int[Array, "S K"],
                   out: VerifyOutput) -> Int[Array, "R V"]:
    """Adds the accepted proposals to their slots' output-token counts (the token after them is
    counted by the next step, as every sampled token is)."""
    k = drafts.shape[1]
    take = jnp.arange(k) < (out.num_tokens - 1)[:, None]
    v = counts_table.shape[1]
    return counts_table.at[jnp.repeat(slots[:, None], k, axis=1), jnp.where(take, drafts, v)].add(1, mode="drop")
