"""Device sampling against a float64 numpy reference, and the stop rules on the real model."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infire_jax import SamplingParams
from infire_jax.errors import InvalidRequestError
from infire_jax.structured import StructuredOutputs

from infire_jax.sample import sampler
from infire_jax.engine.detokenizer import IncrementalDetokenizer
from infire_jax.sample.sampler import (BRANCH_FREE_VARIANTS, BRANCHING, FULL, GREEDY, SAMPLE, SamplingInputs, choose_variant,
                                sample)
from infire_jax.sample.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS

V = 64
MODES = ["branching", "branch_free"]  # the CPU sampler (lax.cond) and the GPU one (variants picked on the host)


def sample_as(mode: str, logits, inputs: SamplingInputs, *tables):
    """`sample` the way the engine runs it in `mode`: the branch-free variant is chosen from the inputs."""
    variant = BRANCHING if mode == "branching" else choose_variant(jax.device_get(inputs), BRANCH_FREE_VARIANTS)
    return sample(logits, inputs, *tables, variant)


def make_inputs(rows: list[dict]) -> SamplingInputs:
    s = len(rows)

    def col(name, default, dtype):
        return jnp.asarray([r.get(name, default) for r in rows], dtype)

    suppress = np.full((s, MAX_STOP_TOKEN_IDS), -1, np.int32)
    bias_ids = np.full((s, MAX_LOGIT_BIAS), -1, np.int32)
    bias = np.zeros((s, MAX_LOGIT_BIAS), np.float32)
    for i, r in enumerate(rows):
        ids = r.get("suppress", [])
        suppress[i, :len(ids)] = ids
        for j, (token, value) in enumerate(r.get("bias", {}).items()):
            bias_ids[i, j], bias[i, j] = token, value
    return SamplingInputs(
        temperature=col("temperature", 0.0, jnp.float32), top_k=col("top_k", 0, jnp.int32),
        top_p=col("top_p", 1.0, jnp.float32), min_p=col("min_p", 0.0, jnp.float32),
        repetition_penalty=col("rep", 1.0, jnp.float32), presence_penalty=col("pres", 0.0, jnp.float32),
        frequency_penalty=col("freq", 0.0, jnp.float32),
        seed=jnp.asarray([[r.get("seed", 7), 0] for r in rows], jnp.uint32),
        step=jnp.zeros(s, jnp.int32), want_logprobs=col("logprobs", False, jnp.bool_),
        suppress_ids=jnp.asarray(suppress), bias_ids=jnp.asarray(bias_ids), bias=jnp.asarray(bias))


def reference_distribution(logits: np.ndarray, r: dict) -> np.ndarray:
    """vLLM's order: temperature, min_p, top-k, top-p (renormalising after each cut)."""
    x = logits.astype(np.float64) / r["temperature"]
    p = np.exp(x - x.max())
    p /= p.sum()
    if r.get("min_p", 0) > 0:
        p = np.where(p < r["min_p"] * p.max(), 0, p)
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(V, bool)
    k = r.get("top_k", 0) or V
    keep[order[:k]] = True
    p = np.where(keep, p, 0)
    p /= p.sum()
    if r.get("top_p", 1.0) < 1.0:
        sorted_p = p[order]
        above = np.cumsum(sorted_p) - sorted_p
        cut = np.zeros(V, bool)
        cut[order[above >= r["top_p"]]] = True
        p = np.where(cut, 0, p)
    return p / p.sum()


ROWS = [
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.0, top_p=0.5),
    dict(temperature=1.3, min_p=0.1),
    dict(temperature=1.0, top_k=10, top_p=0.8),
    dict(temperature=0.5),
]


@pytest.mark.parametrize("mode", MODES)
def test_random_sampling_matches_reference_distribution(mode):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(0, 2.0, (len(ROWS), V)), jnp.float32)
    inputs = make_inputs(ROWS)
    counts = jnp.zeros((len(ROWS) + 1, V), jnp.int32)
    prompt = jnp.zeros((len(ROWS) + 1, V), bool)
    slots = jnp.arange(len(ROWS))
    n = 6000

    @jax.jit
    def draws(steps):
        return jax.vmap(lambda st: sample_as(mode, logits, inputs._replace(step=jnp.full(len(ROWS), st)),
                                             counts, prompt, slots).tokens)(steps)

    toks = np.asarray(draws(jnp.arange(n)))
    for i, r in enumerate(ROWS):
        ref = reference_distribution(np.asarray(logits[i]), r)
        emp = np.bincount(toks[:, i], minlength=V) / n
        assert set(np.flatnonzero(emp)) <= set(np.flatnonzero(ref)), f"row {i} drew a masked token"
        assert 0.5 * np.abs(emp - ref).sum() < 0.05, f"row {i} distribution is off"


@pytest.mark.parametrize("mode", MODES)
def test_same_seed_and_step_give_same_draw_different_seeds_differ(mode):
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 1.0, (2, V)), jnp.float32)
    rows = [dict(temperature=1.0, seed=123), dict(temperature=1.0, seed=123)]
    z = jnp.zeros((3, V), jnp.int32), jnp.zeros((3, V), bool), jnp.arange(2)
    a = sample_as(mode, logits[:1].repeat(2, 0), make_inputs(rows), *z).tokens
    assert a[0] == a[1]
    many = [int(sample_as(mode, logits, make_inputs([dict(temperature=1.0, seed=s)] * 2), *z).tokens[0])
            for s in range(20)]
    assert len(set(many)) > 3


def vllm_penalized(logits: np.ndarray, output_counts: np.ndarray, in_prompt: np.ndarray, rep: float, pres: float,
                   freq: float) -> np.ndarray:
    """vLLM's penalties in float64, token by token: repetition (over prompt and output tokens) divides a
    positive logit and multiplies a negative one; then frequency subtracts freq * count and presence
    subtracts pres once, both over output tokens only."""
    out = logits.astype(np.float64).copy()
    for t in range(out.shape[0]):
        if output_counts[t] > 0 or in_prompt[t]:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        if output_counts[t] > 0:
            out[t] -= freq * output_counts[t] + pres
    return out


# (penalties, {token: (raw logit, output count, in prompt)}): each row's raw argmax is penalized and
# loses to another token, which it would not if the penalty were missing or computed another way.
PENALTY_ROWS = [
    # repetition, positive logit of a prompt-only token: 6/2 < 4
    (dict(rep=2.0), {10: (6.0, 0, True), 11: (4.0, 0, False)}),
    # repetition, negative logits: an output token's is multiplied (-1 * 2 < -1.5), not divided
    (dict(rep=2.0), {12: (-1.0, 1, False), 13: (-1.5, 0, False)}),
    # presence, output tokens only: 5 - 1 < 4.6, and the prompt-only 4.6 is left alone (else 4.3 wins)
    (dict(pres=1.0), {20: (5.0, 2, False), 21: (4.6, 0, True), 22: (4.3, 0, False)}),
    # frequency, times the count: 10 - 1.5 < 9.8 - 0.5 (as a presence-like flat 0.5, 10 would stay first)
    (dict(freq=0.5), {30: (10.0, 3, False), 31: (9.8, 1, False), 32: (9.0, 0, True)}),
    # all three, repetition first: 8 / 2 - 2 * 0.5 - 0.5 = 2.5 < 3 ((8 - 1.5) / 2 = 3.25 would win)
    (dict(rep=2.0, pres=0.5, freq=0.5), {40: (8.0, 2, True), 41: (3.0, 0, False)}),
    # neutral parameters beside penalized rows: a seen argmax stays
    (dict(), {50: (5.0, 2, True), 51: (4.0, 0, False)}),
]


@pytest.mark.parametrize("mode", MODES)
def test_penalties_match_vllm_formula(mode):
    """Each penalty kind alone and together, on rows whose raw argmax is a penalized token: the
    sampler's greedy token is the argmax of an independent float64 computation of vLLM's formula,
    and that differs from the raw argmax wherever a penalty is set; `apply_penalties` gives the
    reference's logits on every token, seen or not, positive or negative."""
    rng = np.random.default_rng(2)
    s = len(PENALTY_ROWS)
    logits = rng.normal(-6.0, 1.0, (s, V)).astype(np.float32)  # every unnamed token well below the named ones
    counts = np.zeros((s + 1, V), np.int32)
    prompt = np.zeros((s + 1, V), bool)
    for i, (_, tokens) in enumerate(PENALTY_ROWS):
        for t, (value, count, in_prompt) in tokens.items():
            logits[i, t], counts[i, t], prompt[i, t] = value, count, in_prompt
        unnamed = np.setdiff1d(np.arange(V), list(tokens))  # unnamed seen tokens too, of both signs
        counts[i, unnamed[::7]] = rng.integers(1, 4, len(unnamed[::7]))
        prompt[i, unnamed[3::5]] = True
    inputs = make_inputs([dict(temperature=0.0, **params) for params, _ in PENALTY_ROWS])
    want = np.stack([vllm_penalized(logits[i], counts[i], prompt[i], params.get("rep", 1.0), params.get("pres", 0.0),
                                    params.get("freq", 0.0)) for i, (params, _) in enumerate(PENALTY_ROWS)])
    moved = [bool(params) for params, _ in PENALTY_ROWS]
    np.testing.assert_array_equal(np.argmax(want, -1) != np.argmax(logits, -1), moved)  # the rows are what they claim

    out = sample_as(mode, jnp.asarray(logits), inputs, jnp.asarray(counts), jnp.asarray(prompt), jnp.arange(s))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.argmax(want, -1))
    got = sampler.apply_penalties(jnp.asarray(logits), inputs, jnp.asarray(counts[:s]), jnp.asarray(prompt[:s]))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_logprobs_are_raw_log_softmax_and_suppression_masks(mode):
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2.0, (2, V)).astype(np.float32)
    best = int(np.argmax(logits[0]))
    rows = [dict(temperature=0.0, logprobs=True, suppress=[best]), dict(temperature=0.0, logprobs=True)]
    z = jnp.zeros((3, V), jnp.int32), jnp.zeros((3, V), bool), jnp.arange(2)
    out = sample_as(mode, jnp.asarray(logits), make_inputs(rows), *z)
    assert int(out.tokens[0]) != best and int(out.tokens[0]) == int(np.argsort(-logits[0])[1])
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    for i in range(2):
        np.testing.assert_allclose(float(out.logprob[i]), ref[i, int(out.tokens[i])], atol=1e-5)
        np.testing.assert_array_equal(np.asarray(out.top_ids[i]), np.argsort(-ref[i])[:MAX_LOGPROBS])
        np.testing.assert_allclose(np.asarray(out.top_logprobs[i]), np.sort(ref[i])[::-1][:MAX_LOGPROBS], atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_logit_bias_is_added_before_penalties_and_leaves_logprobs_raw(mode):
    """Greedy rows whose argmax each bias moves: a ban (-100) of the raw argmax, a boost of the fourth
    token past the first, a bias on one row only (the row beside it keeps its argmax), and a bias
    that loses only if added before the repetition penalty (vLLM's order: (6 + 2) / 2 = 4 < 4.5,
    where 6 / 2 + 2 = 5 would win). Tokens are the float64 reference's argmax; logprobs are those of
    the raw logits."""
    rng = np.random.default_rng(5)
    logits = rng.normal(-6.0, 1.0, (5, V)).astype(np.float32)
    logits[:3, [7, 8, 9, 10]] = [5.0, 4.5, 4.0, 3.5]
    logits[3, [7, 8, 9, 10]] = [5.0, 4.5, 4.0, 3.5]
    logits[4, [20, 21]] = [6.0, 4.5]
    prompt = np.zeros((6, V), bool)
    prompt[4, 20] = True
    rows = [dict(bias={7: -100.0}, logprobs=True), dict(bias={10: 2.0, 60: -3.0}, logprobs=True), dict(bias={7: 0.25}),
            dict(), dict(bias={20: 2.0}, rep=2.0)]
    want = []
    for i, r in enumerate(rows):
        x = logits[i].astype(np.float64)
        for t, b in r.get("bias", {}).items():
            x[t] += b
        want.append(int(np.argmax(vllm_penalized(x, np.zeros(V), prompt[i], r.get("rep", 1.0), 0.0, 0.0))))
    assert want == [8, 10, 7, 7, 21]
    tables = jnp.zeros((6, V), jnp.int32), jnp.asarray(prompt), jnp.arange(5)
    out = sample_as(mode, jnp.asarray(logits), make_inputs([dict(temperature=0.0, **r) for r in rows]), *tables)
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    ref = logits[:2].astype(np.float64) - np.log(np.exp(logits[:2].astype(np.float64)).sum(-1, keepdims=True))
    for i in range(2):
        np.testing.assert_allclose(float(out.logprob[i]), ref[i, want[i]], atol=1e-5)
        np.testing.assert_array_equal(np.asarray(out.top_ids[i]), np.argsort(-ref[i])[:MAX_LOGPROBS])
    drawn = {int(sample_as(mode, jnp.asarray(logits), make_inputs([dict(temperature=1.0, seed=s, bias={60: 100.0})]
                                                                   * 5), *tables).tokens[0]) for s in range(8)}
    assert drawn == {60}  # +100 makes a sampled row's token all but certain


@pytest.mark.parametrize("rows,variant", [
    ([dict(), dict()], GREEDY),
    ([dict(bias={3: 2.5}), dict()], SAMPLE),
    ([dict(), dict(logprobs=True)], SAMPLE),
    ([dict(rep=1.2), dict()], SAMPLE),
    ([dict(suppress=[3]), dict()], SAMPLE),
    ([dict(temperature=0.8), dict(pres=0.5, logprobs=True)], SAMPLE),
    ([dict(top_p=0.5), dict()], GREEDY),  # truncation is moot for greedy rows
    ([dict(temperature=0.8), dict(top_k=4)], FULL),
    ([dict(temperature=0.9, top_p=0.7, min_p=0.05, freq=0.2, logprobs=True, suppress=[1, 2]), dict(rep=1.3)], FULL),
])
def test_branch_free_variants_equal_the_branching_sampler(rows, variant):
    """The host picks the cheapest variant that covers the batch, and it samples exactly as the
    conditional sampler does: same tokens and logprobs, bit for bit, over many draws."""
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.normal(0, 2.0, (len(rows), V)), jnp.float32)
    counts = jnp.asarray(rng.integers(0, 3, (len(rows) + 1, V)), jnp.int32)
    prompt = jnp.asarray(rng.random((len(rows) + 1, V)) < 0.2)
    inputs = make_inputs(rows)
    assert choose_variant(jax.device_get(inputs), BRANCH_FREE_VARIANTS) == variant
    assert choose_variant(jax.device_get(inputs), (BRANCHING,)) == BRANCHING

    @jax.jit
    def both(step):
        s = inputs._replace(step=jnp.full(len(rows), step))
        tables = (counts, prompt, jnp.arange(len(rows)))
        return sample(logits, s, *tables, BRANCHING), sample(logits, s, *tables, variant)

    for step in range(0, 400, 7):
        want, got = both(step)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
        if any(r.get("logprobs") for r in rows):
            for a, b in zip(got[1:], want[1:]):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- the real model ---------------------------------------------------------------------------

CHAT = [{"role": "user", "content": "Name three colors."}]


def test_seed_reproducible_across_batches(smol_llm):
    p = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=42)
    a = smol_llm.generate(["Tell me about the sea."], p)[0]
    b = smol_llm.generate(["Hello there", "Tell me about the sea.", "1 2 3"], p)[1]
    assert a.token_ids == b.token_ids
    c = smol_llm.generate(["Tell me about the sea."], SamplingParams(max_tokens=24, temperature=0.9, seed=43))[0]
    assert c.token_ids != a.token_ids


def test_top_k_one_is_greedy_and_n_samples_differ(smol_llm):
    greedy = smol_llm.generate(["The sky is"], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    topk1 = smol_llm.generate(["The sky is"], SamplingParams(max_tokens=16, temperature=1.5, top_k=1,
                                                             ignore_eos=True))[0]
    assert topk1.token_ids == greedy.token_ids
    two = smol_llm.generate(["The sky is"], SamplingParams(max_tokens=16, temperature=1.0, n=2, seed=5))[0]
    assert len(two.outputs) == 2 and two.outputs[0].token_ids != two.outputs[1].token_ids


def test_stop_string_and_stop_token(smol_llm):
    base = smol_llm.chat(CHAT, SamplingParams(max_tokens=40, temperature=0))[0]
    text = base.text
    assert len(base.token_ids) > 6
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = smol_llm.chat(CHAT, SamplingParams(max_tokens=40, temperature=0, stop=[stop]))[0]
    assert cut.text == text[:text.index(stop)]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    kept = smol_llm.chat(CHAT, SamplingParams(max_tokens=40, temperature=0, stop=[stop],
                                              include_stop_str_in_output=True))[0]
    assert kept.text == text[:text.index(stop) + len(stop)]
    tok = base.token_ids[4]
    first = base.token_ids.index(tok)
    by_id = smol_llm.chat(CHAT, SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[tok]))[0]
    assert by_id.token_ids == base.token_ids[:first + 1]
    assert by_id.outputs[0].stop_reason == tok
    # as vLLM: the stop token's text is left out of the output, unless include_stop_str_in_output
    with_it = smol_llm.chat(CHAT, SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[tok],
                                                 include_stop_str_in_output=True))[0]
    assert with_it.token_ids == by_id.token_ids
    assert text.startswith(with_it.text) and with_it.text.startswith(by_id.text)
    assert len(with_it.text) > len(by_id.text)


def test_eos_min_tokens_and_ignore_eos(smol_llm):
    base = smol_llm.chat(CHAT, SamplingParams(max_tokens=200, temperature=0))[0]
    assert base.outputs[0].finish_reason == "stop" and base.token_ids[-1] == 2  # ended by EOS
    n = len(base.token_ids)
    longer = smol_llm.chat(CHAT, SamplingParams(max_tokens=200, temperature=0, min_tokens=n + 5))[0]
    assert len(longer.token_ids) >= n + 5
    assert 2 not in longer.token_ids[:n + 5]
    forced = smol_llm.chat(CHAT, SamplingParams(max_tokens=n + 10, temperature=0, ignore_eos=True))[0]
    assert len(forced.token_ids) == n + 10 and forced.outputs[0].finish_reason == "length"
    # the end-of-sequence token's text, shown with skip_special_tokens off, only with include_stop_str_in_output
    special = smol_llm.chat(CHAT, SamplingParams(max_tokens=200, temperature=0, skip_special_tokens=False))[0]
    kept = smol_llm.chat(CHAT, SamplingParams(max_tokens=200, temperature=0, skip_special_tokens=False,
                                              include_stop_str_in_output=True))[0]
    assert special.token_ids == kept.token_ids == base.token_ids
    assert (special.text, kept.text) == (base.text, base.text + "<|im_end|>")


def test_logit_bias_on_the_real_model(smol_llm):
    """A bias just past the gap between the first greedy token and the third candidate makes the
    third the first token (its logprob reported raw, as without the bias); -100 on every token of a
    greedy answer keeps each out of it; +100 on one token makes a seeded sampled answer all that
    token. Ids outside the vocabulary are refused."""
    prompt = ["The capital of Italy is"]
    plain = smol_llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, logprobs=5))[0]
    first = sorted(plain.logprobs[0].items(), key=lambda kv: -kv[1].logprob)
    (top, top_lp), (third, third_lp) = [(t, lp.logprob) for t, lp in (first[0], first[2])]
    boosted = smol_llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=1,
                                                       logit_bias={third: top_lp - third_lp + 0.5}))[0]
    assert boosted.token_ids == [third]
    np.testing.assert_allclose(boosted.logprobs[0][third].logprob, third_lp, atol=1e-4)
    banned = smol_llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0,
                                                      logit_bias={t: -100 for t in plain.token_ids}))[0]
    assert len(banned.token_ids) == 8 and not set(banned.token_ids) & set(plain.token_ids)
    forced = smol_llm.generate(prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True,
                                                      logit_bias={top: 100}))[0]
    assert forced.token_ids == [top] * 6
    with pytest.raises(InvalidRequestError, match="logit_bias token id 49152 is out of the vocabulary"):
        smol_llm.generate(prompt, SamplingParams(logit_bias={5: 1, 49152: 1}))
    for bad_bias in ({5: 100.5}, {-1: 1}, {5: float("nan")}, {t: 1 for t in range(301)}, [5]):
        with pytest.raises(InvalidRequestError, match="logit_bias"):
            SamplingParams(logit_bias=bad_bias)


def test_allowed_token_ids_on_the_real_model(smol_llm):
    """Only the listed tokens are sampled: greedy takes the likeliest of them (the plain run's second
    and fourth candidates give the second), sampled answers stay inside the set and run to max_tokens
    (EOS is not listed), a request beside it in the same steps is untouched, and with a grammar
    (a choice) the answer is what both allow. Ids outside the vocabulary are refused."""
    prompt = "The capital of Italy is"
    plain = smol_llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, logprobs=5))[0]
    ranked = [t for t, _ in sorted(plain.logprobs[0].items(), key=lambda kv: -kv[1].logprob)]
    allowed = [ranked[3], ranked[1]]
    only = SamplingParams(max_tokens=6, temperature=0, allowed_token_ids=allowed)
    got, beside = smol_llm.generate([prompt, prompt], [only, SamplingParams(max_tokens=8, temperature=0)])
    assert got.token_ids[0] == ranked[1] and set(got.token_ids) <= set(allowed) and len(got.token_ids) == 6
    assert beside.token_ids == plain.token_ids
    wider = allowed + ranked[2:3]
    sampled = smol_llm.generate([prompt], SamplingParams(n=4, max_tokens=8, temperature=1.5, seed=1,
                                                         allowed_token_ids=wider))[0]
    assert all(set(o.token_ids) <= set(wider) and len(o.token_ids) == 8 for o in sampled.outputs)
    assert len({tuple(o.token_ids) for o in sampled.outputs}) > 1
    choice = SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputs(choice=[" yes", " no"]))
    assert smol_llm.generate([prompt], choice)[0].text == " no"  # the grammar alone
    choice = dataclasses.replace(choice, allowed_token_ids=[*smol_llm.tokenizer.encode(" yes"),
                                                            *smol_llm.engine.model_config.eos_token_ids])
    assert smol_llm.generate([prompt], choice)[0].text == " yes"  # what both allow
    with pytest.raises(InvalidRequestError, match="allowed_token_ids token id 49152 is out of the vocabulary"):
        smol_llm.generate([prompt], SamplingParams(allowed_token_ids=[5, 49152]))
    for bad_ids in ([], [-1], [5, "6"], (5,)):
        with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad_ids)


def test_bad_words_on_the_real_model(smol_llm):
    """vLLM's bad_words: a word the greedy answer opens with is never written, alone or after a space
    (here " Berlin" is one token and "Berlin" two); a two-token phrase is banned only at its second
    token, so the answer equals the plain one up to the phrase's first token and then parts from it; a
    request beside it in the same steps is untouched."""
    from infire_jax.sample import bad_words

    tok = smol_llm.tokenizer
    encode = functools.partial(tok.encode, add_special_tokens=False)
    assert bad_words.word_sequences(["Berlin"], encode) == [encode("Berlin"), encode(" Berlin")]
    assert len(encode("Berlin")) == 2 and len(encode(" Berlin")) == 1
    banned, longer = bad_words.split_bans(bad_words.word_sequences(["Berlin"], encode), 1536)
    (berlin,) = encode(" Berlin")
    assert not (banned.view(np.uint32)[berlin // 32] >> (berlin % 32)) & 1 and (banned == -1).sum() == 1535
    assert longer == [(tuple(encode("Berlin")[:1]), encode("Berlin")[1])]
    assert bad_words.banned_after(longer, [5, *encode("Berlin")[:1]]) == encode("Berlin")[1:]
    assert bad_words.banned_after(longer, [5, 6]) == []

    prompt = "The capital of France is Paris. The capital of Germany is"
    greedy = SamplingParams(max_tokens=24, temperature=0)
    plain = smol_llm.generate([prompt], greedy)[0].token_ids
    assert plain[0] == berlin
    no_berlin, beside = smol_llm.generate([prompt, prompt], [dataclasses.replace(greedy, bad_words=["Berlin"]),
                                                             greedy])
    assert berlin not in no_berlin.token_ids and "Berlin" not in no_berlin.text
    assert beside.token_ids == plain
    phrase = encode(" capital of")
    at = next(i for i in range(len(plain)) if plain[i:i + 2] == phrase)
    got = smol_llm.generate([prompt], dataclasses.replace(greedy, bad_words=["capital of"]))[0].token_ids
    assert got[:at + 1] == plain[:at + 1] and got[at + 1] != phrase[1]
    assert not any(got[i:i + 2] in (phrase, encode("capital of")) for i in range(len(got)))
    for bad_list in ([""], ["  "], "Berlin", [5], ["x"] * 257):
        with pytest.raises(InvalidRequestError, match="bad_words"):
            SamplingParams(bad_words=bad_list)


def test_logprobs_output_shape(smol_llm):
    out = smol_llm.generate(["The capital of Italy is"], SamplingParams(max_tokens=8, temperature=0, logprobs=3))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and 3 <= len(lp) <= 4
        assert lp[tok].logprob == max(v.logprob for v in lp.values())  # greedy picks the most likely token
        assert all(v.logprob <= 0 for v in lp.values())
        # vLLM's Logprob: the alternatives ranked 1, 2, 3 in order, each with its text
        assert [v.rank for v in lp.values()][:3] == [1, 2, 3] and lp[tok].rank == 1
        assert all(v.decoded_token == smol_llm.tokenizer.decode([t], skip_special_tokens=False) for t, v in lp.items())
    total = sum(lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs))
    assert out.outputs[0].cumulative_logprob == pytest.approx(total)
    plain = smol_llm.generate(["The capital of Italy is"], SamplingParams(max_tokens=2))[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None  # not asked for, as in vLLM


@pytest.mark.parametrize("text", ["naïve café 😀 日本語のテキスト", "emoji 🧑‍🚀🚀 and ünïcödé"])
def test_incremental_detokenizer_handles_split_utf8(smol_llm, text):
    tok = smol_llm.tokenizer
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [1, 2], SamplingParams())
    pieces = [detok.add(i)[0] for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == tok.decode(ids) == text


def test_detokenizer_holds_back_possible_stop_prefix(smol_llm):
    tok = smol_llm.tokenizer
    ids = tok.encode("alpha beta STOP gamma")
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP"]))
    shown, hit = "", None
    for i in ids:
        piece, hit = detok.add(i)
        shown += piece
        if hit:
            break
    assert hit == "STOP" and shown == "alpha beta "


def test_penalties_see_the_whole_prompt_after_a_prefix_cache_hit(smol_llm):
    """The second request reuses cached pages, yet its repetition penalty covers the skipped tokens."""
    prompt = "List the days of the week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. " * 3
    p = SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.8, frequency_penalty=0.4)
    first = smol_llm.generate([prompt], p)[0]
    second = smol_llm.generate([prompt], p)[0]
    assert second.num_cached_tokens >= 32 and first.num_cached_tokens < second.num_cached_tokens
    assert second.token_ids == first.token_ids


def test_argmax_is_jnp_argmax():
    """The sampler's two-reduction argmax picks what jnp.argmax picks: ties to the first, all -inf
    rows (a grammar that allows nothing) to 0, NaN rows to their first NaN."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 49152)).astype(np.float32)
    x[1, [7, 300, 9000]] = 50.0  # a tie
    x[2] = -np.inf
    x[3, [40, 20000]] = np.nan
    x[4, :] = 1.0
    x[5, -1] = 80.0
    got = np.asarray(jax.jit(sampler.argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    assert got.dtype == np.int32 and list(got[1:]) == [7, 0, 40, 0, 49151]


def test_draw_from_weights_is_the_float64_inverse_cdf():
    """The two-level inverse-CDF draw: for each u, the drawn token's stretch of the running sum (in
    float64) holds u times the total, at a vocabulary that fills its blocks and one that does not, and
    a token of weight 0 is never drawn, not even at u = 0 or at the largest uniform below 1."""
    rng = np.random.default_rng(3)
    top = np.nextafter(np.float32(1), np.float32(0))
    us = np.concatenate([[0.0, top, 0.5], rng.random(197)]).astype(np.float32)
    for vocab in (49152, 32001):
        w = (rng.exponential(1.0, (6, vocab)) ** 4).astype(np.float32)
        w[1, :30000] = 0  # a masked run across blocks
        w[2, 5:] = 0  # mass in the first block only
        w[3, np.setdiff1d(np.arange(vocab), [17, 300, vocab - 1])] = 0  # three tokens, one the last
        w[4, 100::2] = 0
        w[5, -1] = 1e6  # one token holds nearly all
        got = np.asarray(jax.jit(jax.vmap(sampler.draw_from_weights, in_axes=(None, 0)))(
            jnp.asarray(w), jnp.asarray(np.repeat(us[:, None], 6, axis=1))))
        cdf = np.cumsum(w.astype(np.float64), axis=-1)
        for r in range(6):
            t = us * cdf[r, -1]
            lo = np.where(got[:, r] > 0, cdf[r, got[:, r] - 1], 0.0)
            tol = 1e-5 * cdf[r, -1]
            assert np.all(w[r, got[:, r]] > 0), f"vocab {vocab}, row {r}: a token of weight 0 was drawn"
            assert np.all((lo - tol <= t) & (t <= cdf[r, got[:, r]] + tol)), f"vocab {vocab}, row {r}"


def reference_kept(x: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The tokens a row's top-k then top-p keep, in float64 and by sorting (ties included): top-k
    the k-th largest logit and up; top-p, on the renormalised rest, the smallest top set whose mass
    reaches top_p and every token as likely as its last."""
    x = x.astype(np.float64)
    keep = np.isfinite(x)
    if 0 < top_k < len(x):
        keep &= x >= np.sort(x)[::-1][top_k - 1]
    if top_p < 1.0:
        p = np.where(keep, np.exp(x - x[keep].max()), 0.0)
        p /= p.sum()
        desc = np.sort(p)[::-1]
        keep &= p >= desc[np.argmax(np.cumsum(desc) >= top_p)]
    return keep


def test_truncation_from_candidates_keeps_what_sorting_keeps(monkeypatch):
    """The CPU sampler's top-k/top-p, read from each row's top 256 logits, against a float64 sort. A
    batch cut within the candidates (ties at both cuts, masked tokens) takes that path alone: with the
    bisections replaced by a no-op it still cuts as the sort does. A batch with one row cut deeper,
    by a top-k of 300 or by a nucleus of ~900 tokens, takes the bisections."""
    vocab, c = 1000, sampler._CANDIDATES
    rng = np.random.default_rng(5)
    x = rng.normal(0, 3.0, (8, vocab)).astype(np.float32)
    x[2] = np.round(x[2] * 2) / 2  # ties around both cuts
    x[3, rng.choice(vocab, 400, replace=False)] = -np.inf  # masked (a grammar's, a bias's)
    near = [dict(top_k=5), dict(top_k=c), dict(top_k=37, top_p=0.9), dict(top_k=9, top_p=0.7),
            dict(top_p=0.95), dict(top_p=0.5), dict(top_k=0), dict(top_k=vocab, top_p=0.9)]
    flat = rng.normal(0, 0.1, (1, vocab)).astype(np.float32)
    within, *deeper = [(x, near), (x, near[:7] + [dict(top_k=300)]),
                       (np.concatenate([x[:7], flat]), near[:7] + [dict(top_p=0.95)])]

    def cut(logits, rows):
        s = make_inputs([dict(temperature=1.0, **r) for r in rows])
        traced_now = jax.jit(lambda *a: sampler.truncate_from_candidates(*a))  # not a trace from before a patch
        return np.isfinite(np.asarray(traced_now(jnp.asarray(logits), s)))

    def sorted_cut(logits, rows):
        return np.stack([reference_kept(row, r.get("top_k", 0), r.get("top_p", 1.0)) for row, r in zip(logits, rows)])

    for (logits, rows), past in [(within, False), *[(d, True) for d in deeper]]:
        want = sorted_cut(logits, rows)
        assert (want[-1].sum() > c) == past and (want[:-1].sum(axis=1)[:6] <= c).all()  # the cases are what they say
        np.testing.assert_array_equal(cut(logits, rows), want)
    with monkeypatch.context() as m:
        m.setattr(sampler, "truncate", lambda logits, s: logits)
        np.testing.assert_array_equal(cut(*within), sorted_cut(*within))
        for logits, rows in deeper:
            np.testing.assert_array_equal(cut(logits, rows), np.isfinite(logits))
