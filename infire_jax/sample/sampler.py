"""Sampling on the device, each row with its own parameters, in a jitted call of its own.

Work that only some requests need (penalties, top-k/top-p truncation, random draws, logprobs) must
not cost a greedy batch anything. Two ways to skip it, one per backend:

* `branching` (CPU): `lax.cond` on "does any row need it". On the CPU backend the host runs the
  program, so a conditional costs nothing extra.
* `greedy`, `sample`, `full` (GPU): on XLA GPU a data-dependent conditional copies its predicate
  to the host, so the launch blocks until the device gets there and nothing overlaps (measured:
  batch 1 went from 11.0 to 8.8 ms/token without them). There the host picks the smallest
  variant that covers the batch (`choose_variant`) and each variant is branch-free: `greedy` is an
  argmax; `sample` adds penalties, min-tokens suppression, temperature, min-p, the seeded draw and
  logprobs, each a no-op for rows that do not ask for it; `full` adds top-k/top-p truncation.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from infire_jax.sample.sampling_params import MAX_LOGPROBS

BRANCHING, GREEDY, SAMPLE, FULL = "branching", "greedy", "sample", "full"
BRANCH_FREE_VARIANTS = (GREEDY, SAMPLE, FULL)  # each covers the batches the ones before it cover


class SamplingInputs(NamedTuple):
    """Per-row sampling parameters, as arrays of the step's row bucket S."""

    temperature: Float[Array, "S"]  # 0 = greedy
    top_k: Int[Array, "S"]  # 0 = off
    top_p: Float[Array, "S"]
    min_p: Float[Array, "S"]
    repetition_penalty: Float[Array, "S"]
    presence_penalty: Float[Array, "S"]
    frequency_penalty: Float[Array, "S"]
    seed: Int[Array, "S 2"]  # uint32 halves of the request's 64-bit seed
    step: Int[Array, "S"]  # tokens generated so far: the draw index, so a seed replays exactly
    want_logprobs: Bool[Array, "S"]
    suppress_ids: Int[Array, "S K"]  # stop ids masked until min_tokens is reached; -1 = none
    bias_ids: Int[Array, "S B"]  # logit_bias' token ids; -1 = none
    bias: Float[Array, "S B"]  # what each adds to its token's logit


class SamplerOutput(NamedTuple):
    tokens: Int[Array, "S"]
    logprob: Float[Array, "S"]  # of the chosen token, under the model's raw distribution
    top_ids: Int[Array, "S L"]
    top_logprobs: Float[Array, "S L"]


def argmax(x: Float[Array, "S V"]) -> Int[Array, "S"]:
    """`jnp.argmax(x, axis=-1)` as int32 (the first maximum; the first NaN where a row has one), as two
    plain reductions: XLA CPU runs argmax's (value, index) reduction as a scalar loop, 0.9 ms for
    8 rows of a 49k vocabulary against 0.19 ms for the two reductions (docs/PERFORMANCE.md)."""
    nan = jnp.isnan(x)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == jnp.max(x, axis=-1, keepdims=True))
    return jnp.min(jnp.where(hit, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1] - 1), axis=-1)


def apply_penalties(logits, s: SamplingInputs, counts: Int[Array, "S V"], in_prompt: Bool[Array, "S V"]):
    """vLLM semantics: repetition over prompt and output; presence and frequency over output."""
    seen = (counts > 0) | in_prompt
    rep = s.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - s.frequency_penalty[:, None] * counts.astype(logits.dtype)
    return logits - s.presence_penalty[:, None] * (counts > 0).astype(logits.dtype)


def suppress(logits, ids):
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, jnp.where(ids >= 0, ids, logits.shape[1])].set(-jnp.inf, mode="drop")


def add_logit_bias(logits, s: SamplingInputs):
    """OpenAI's logit_bias: each row's (token, bias) pairs added to its logits."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, jnp.where(s.bias_ids >= 0, s.bias_ids, logits.shape[1])].add(s.bias, mode="drop")


def biased(logits, s: SamplingInputs, branch: bool):
    """`add_logit_bias`, which on CPU a batch without any bias skips."""
    if branch:
        return jax.lax.cond(jnp.any(s.bias_ids >= 0), add_logit_bias, lambda x, _: x, logits, s)
    return add_logit_bias(logits, s)


_BISECT_STEPS = 32  # halvings of the threshold interval: 2^-32 of the value range


def _kth_largest(x: Float[Array, "S V"], k: Int[Array, "S"]) -> Float[Array, "S"]:
    """The k-th largest value of each row, by bisection on the value (a full sort is ~80x slower on CPU)."""
    lo = jnp.min(jnp.where(jnp.isfinite(x), x, jnp.inf), axis=-1)  # masked (-inf) tokens never bound the search
    hi = jnp.max(x, axis=-1)

    def step(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        ok = jnp.sum(x >= mid[:, None], axis=-1) >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, hi = jax.lax.fori_loop(0, _BISECT_STEPS, step, (lo, hi))
    return jnp.where(jnp.sum(x >= hi[:, None], axis=-1) >= k, hi, lo)


def _nucleus_floor(probs: Float[Array, "S V"], top_p: Float[Array, "S"]) -> Float[Array, "S"]:
    """The largest probability t such that the tokens with probability >= t hold at least top_p of the mass.

    Keeping exactly those tokens is vLLM's top-p: the smallest top set reaching top_p, ties included.
    """
    lo = jnp.zeros(probs.shape[0], probs.dtype)
    hi = jnp.max(probs, axis=-1)

    def step(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        ok = jnp.sum(jnp.where(probs >= mid[:, None], probs, 0), axis=-1) >= top_p
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, hi = jax.lax.fori_loop(0, _BISECT_STEPS, step, (lo, hi))
    return jnp.where(jnp.sum(jnp.where(probs >= hi[:, None], probs, 0), axis=-1) >= top_p, hi, lo)


def truncate(logits, s: SamplingInputs):
    """Top-k, then top-p on the renormalised rest, on temperature-scaled logits; ties are kept."""
    v = logits.shape[-1]
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, v), v)
    logits = jnp.where(logits < _kth_largest(logits, k)[:, None], -jnp.inf, logits)
    probs = jax.nn.softmax(logits, axis=-1)
    floor = jnp.where(s.top_p < 1.0, _nucleus_floor(probs, s.top_p), 0.0)
    return jnp.where(probs < floor[:, None], -jnp.inf, logits)


_CANDIDATES = 256  # the top logits a CPU row is truncated from; a row cut deeper takes the bisections


def truncate_from_candidates(logits, s: SamplingInputs):
    """`truncate`, read from each row's top `_CANDIDATES` logits: XLA's TopK sorts them in one pass over
    the vocabulary (40 rows of 49k: 15 ms on 2 cores, against 48 ms for the bisections' 64 passes).
    The same cut, in logits: top-k keeps the k-th largest and up, top-p the smallest top set whose
    mass reaches top_p, ties included. A batch with a row whose cut reaches past the candidates (a
    top-k above them, a nucleus wider than them) takes the bisections. On CPU, where a conditional is
    free (the `branching` sampler)."""
    v = logits.shape[-1]
    c = min(_CANDIDATES, v)
    top = jax.lax.top_k(logits, c)[0]  # [S, c], descending
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, v), v)
    kth = jnp.take_along_axis(top, jnp.minimum(k, c)[:, None] - 1, axis=-1)
    kth = jnp.where(k[:, None] < v, kth, -jnp.inf)
    kept = jnp.where(logits < kth, -jnp.inf, logits)
    top = jnp.where(top < kth, -jnp.inf, top)
    mass = jnp.cumsum(jnp.exp(top - jax.nn.logsumexp(kept, axis=-1, keepdims=True)), axis=-1)
    reached = mass >= s.top_p[:, None]  # monotone: the nucleus ends at the first row entry reaching it
    last = jnp.minimum(jnp.sum(~reached, axis=-1, keepdims=True), c - 1)
    floor = jnp.where(s.top_p[:, None] < 1.0, jnp.take_along_axis(top, last, axis=-1), -jnp.inf)
    fits = jnp.all(((k <= c) | (k == v)) & ((s.top_p >= 1.0) | reached[:, -1]))
    return jax.lax.cond(fits, lambda: jnp.where(kept < floor, -jnp.inf, kept), lambda: truncate(logits, s))


_BLOCK = 256  # tokens per block of `draw_from_weights`


def _first_past(cdf: Float[Array, "S N"], target: Float[Array, "S"]) -> Int[Array, "S"]:
    """The first index whose running sum passes `target`; where rounding leaves none (target at the
    total), the last index whose weight moved the sum, so that nothing of weight 0 is drawn."""
    count = jnp.sum(cdf <= target[:, None], axis=-1).astype(jnp.int32)
    return jnp.minimum(count, argmax(cdf))


def draw_from_weights(weights: Float[Array, "S V"], u: Float[Array, "S"]) -> Int[Array, "S"]:
    """Index i of each row, drawn with probability weights[i] / sum(weights) by the inverse CDF at
    u in [0, 1). In two levels, the block of `_BLOCK` tokens and then the token in it, so that the
    running sums cover V / _BLOCK block masses and one block. One random number a row, where a
    Gumbel-max draw takes one a token: 8 rows of a 49k vocabulary took 0.37 ms against 6.4 ms on 2 CPU
    cores (docs/PERFORMANCE.md). Each chance is exact to u's resolution, 2^-23."""
    rows, v = weights.shape
    nb = -(-v // _BLOCK)
    blocks = jnp.pad(weights, ((0, 0), (0, nb * _BLOCK - v))).reshape(rows, nb, _BLOCK)
    ends = jnp.cumsum(jnp.sum(blocks, axis=-1), axis=-1)  # [S, nb]
    target = u * ends[:, -1]
    block = _first_past(ends, target)
    start = jnp.take_along_axis(ends, jnp.maximum(block - 1, 0)[:, None], axis=-1)[:, 0]
    rest = target - jnp.where(block > 0, start, 0.0)
    inside = jnp.cumsum(jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0], axis=-1)
    return block * _BLOCK + _first_past(inside, rest)


def draw_key(seed: Int[Array, "2"], step: Int[Array, ""]) -> Array:
    """The key of one row's draw: from (seed, step) alone, so it is independent of batch composition."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed[0]), seed[1]), step)


def draw_uniforms(seed: Int[Array, "S 2"], step: Int[Array, "S"]) -> Float[Array, "S"]:
    """Each row's uniform in [0, 1) for its draw at `step` (`draw_key`)."""
    return jax.vmap(lambda a, b: jax.random.uniform(draw_key(a, b)))(seed.astype(jnp.uint32), step)


def _draw(logits, s: SamplingInputs):
    """A token per row from softmax(logits), with the row's (seed, step) uniform."""
    weights = jnp.exp((logits - jnp.max(logits, axis=-1, keepdims=True)).astype(jnp.float32))
    return draw_from_weights(weights, draw_uniforms(s.seed, s.step))


def sampling_logits(logits, s: SamplingInputs, truncation: bool | None):
    """Temperature, min-p, then (if `truncation`; None: if any row asks) top-k/top-p: the logits
    whose softmax is the distribution a row samples from."""
    temp = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    logits = logits / temp
    # min_p: drop tokens whose probability is below min_p times the top probability.
    floor = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(jnp.maximum(s.min_p[:, None], 1e-30))
    logits = jnp.where((s.min_p[:, None] > 0) & (logits < floor), -jnp.inf, logits)
    if truncation is None:
        needs_cut = jnp.any((s.top_k > 0) | (s.top_p < 1.0))
        return jax.lax.cond(needs_cut, truncate_from_candidates, lambda x, _: x, logits, s)
    return truncate(logits, s) if truncation else logits


def logprobs_of(raw_logits, tokens):
    lp = jax.nn.log_softmax(raw_logits, axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(lp, MAX_LOGPROBS)
    return chosen, top_ids.astype(jnp.int32), top_lp


def no_logprobs(rows: int):
    return (jnp.zeros(rows, jnp.float32), jnp.zeros((rows, MAX_LOGPROBS), jnp.int32),
            jnp.zeros((rows, MAX_LOGPROBS), jnp.float32))


def _apply_grammar_mask(logits: Float[Array, "S V"], mask: Int[Array, "S W"]) -> Float[Array, "S V"]:
    """Bit t % 32 of word t // 32 clear: token t is not allowed (llguidance's bitmask layout)."""
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=mask.dtype)) & 1
    allowed = bits.reshape(mask.shape[0], -1)[:, :logits.shape[1]].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def grammar_masked(logits, mask, branch: bool):
    """Structured outputs: the mask goes first, before penalties and truncation. Rows without a
    constraint have every bit set; on CPU a batch without any constraint skips the pass."""
    if branch:
        return jax.lax.cond(jnp.any(mask != -1), _apply_grammar_mask, lambda x, _: x, logits, mask)
    return _apply_grammar_mask(logits, mask)


def choose_variant(s: SamplingInputs, variants: tuple[str, ...]) -> str:
    """The cheapest compiled variant that covers this batch's host-side parameters (numpy)."""
    if variants == (BRANCHING,):
        return BRANCHING
    if np.any((s.top_k > 0) | (s.top_p < 1.0)) and np.any(s.temperature > 0):
        return FULL
    plain = not (np.any(s.temperature > 0) or np.any(s.want_logprobs) or np.any(s.suppress_ids >= 0)
                 or np.any(s.bias_ids >= 0)
                 or np.any((s.repetition_penalty != 1.0) | (s.presence_penalty != 0) | (s.frequency_penalty != 0)))
    return GREEDY if plain else SAMPLE


def sample(
    logits: Float[Array, "S V"],
    s: SamplingInputs,
    counts_table: Int[Array, "R V"],
    prompt_table: Bool[Array, "R V"],
    slots: Int[Array, "S"],
    variant: str = BRANCHING,
    grammar_mask: Int[Array, "S W"] | None = None,
) -> SamplerOutput:
    """Picks the next token of every row. The tables hold each request slot's token history.
    `grammar_mask` (structured outputs) holds each row's allowed tokens as bits. In vLLM's order: the
    mask, logit_bias, penalties, min-tokens suppression, then temperature and truncation; logprobs
    stay those of the model's own distribution, as vLLM reports them."""
    rows = logits.shape[0]
    raw = logits
    if grammar_mask is not None:
        logits = grammar_masked(logits, grammar_mask, variant == BRANCHING)
    if variant == GREEDY:
        return SamplerOutput(argmax(logits), *no_logprobs(rows))
    branch = variant == BRANCHING
    logits = biased(logits, s, branch)
    if branch:
        has_penalty = jnp.any((s.repetition_penalty != 1.0) | (s.presence_penalty != 0) | (s.frequency_penalty != 0))
        logits = jax.lax.cond(has_penalty, lambda x: apply_penalties(x, s, counts_table[slots], prompt_table[slots]),
                              lambda x: x, logits)
        logits = jax.lax.cond(jnp.any(s.suppress_ids >= 0), suppress, lambda x, _: x, logits, s.suppress_ids)
    else:  # neutral parameters leave a row's logits bit-identical
        logits = suppress(apply_penalties(logits, s, counts_table[slots], prompt_table[slots]), s.suppress_ids)
    greedy = argmax(logits)
    if branch:
        random = jax.lax.cond(jnp.any(s.temperature > 0), lambda x, s: _draw(sampling_logits(x, s, None), s),
                              lambda x, _: greedy, logits, s)
    else:
        random = _draw(sampling_logits(logits, s, truncation=variant == FULL), s)
    tokens = jnp.where(s.temperature > 0, random, greedy)
    if branch:
        logprobs = jax.lax.cond(jnp.any(s.want_logprobs), logprobs_of, lambda *_: no_logprobs(rows), raw, tokens)
    else:
        logprobs = logprobs_of(raw, tokens)
    return SamplerOutput(tokens, *logprobs)
