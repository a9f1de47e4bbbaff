"""Speculative decoding: the n-gram proposer, the rejection sampler, and the engine with speculation
on, against the same engine without it (greedy: token-identical; sampled: the same distribution)."""

from __future__ import annotations

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_ENGINE
from scipy import stats

from infire_jax import LLM
from infire_jax.errors import ConfigError
from infire_jax.core.request import Request
from infire_jax.sample.sampler import SamplingInputs
from infire_jax.sample.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from infire_jax.core.scheduler import GROWTH_RATIO_MIN
from infire_jax.speculative.config import SpeculativeConfig
from infire_jax.speculative.controller import MAX_BACKOFF, NgramProposer, SpecController
from infire_jax.speculative.ngram import propose_ngram
from infire_jax.speculative.verify import verify

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8}
TEXT = ("The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran into the forest. "
        "In the forest the fox met an owl who asked where it was going.")
GROUNDED = f"Repeat this text exactly:\n{TEXT}\nRepeated text:\n"
SIGNIFICANCE = 1e-3  # chi-square tests: a correct sampler fails one in a thousand runs


@pytest.fixture(scope="module")
def spec_llm():
    return LLM(**SMALL_ENGINE, speculative_config=SPEC)


# ---- the proposer and the config ------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_longest_match():
    t = np.array([5, 2, 3, 7, 2, 3, 8, 1, 2, 3], np.int32)
    assert propose_ngram(t, 2, 1, 3) == [8, 1]  # "2 3" last occurred before "8 1"
    assert propose_ngram(t, 2, 3, 3) == []  # "1 2 3" never occurred before
    assert propose_ngram(np.array([1, 2, 3, 4, 5, 9, 1, 2, 3]), 3, 1, 3) == [4, 5, 9]
    assert propose_ngram(np.array([7, 8, 9]), 3, 1, 3) == []
    assert propose_ngram(np.array([9, 4, 1, 2, 6, 4, 1, 2]), 5, 2, 4) == [6, 4, 1, 2]  # stops at the end


@pytest.mark.parametrize("value, field", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel": 2}, "draft_tensor_parallel"),
    ('{"method": "ngram", ', "JSON"),
])
def test_bad_speculative_config_names_the_field(value, field):
    with pytest.raises(ConfigError, match=field):
        SpeculativeConfig.parse(value)


def _request(tokens: list[int], max_tokens: int = 100) -> Request:
    req = Request("r", tokens[:3], SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens, seed=0)
    req.output_token_ids = tokens[3:]
    return req


def test_controller_backs_off_doubling_and_turns_off_for_large_batches():
    sc = SpeculativeConfig("ngram", 3, prompt_lookup_min=1)
    ctl = SpecController(sc, max_batch=4, proposer=NgramProposer(sc))
    req = _request([1, 2, 3, 4, 1, 2])
    ctl.plan(req, num_running=1)
    ctl.propose_queued()
    assert req.spec_wait and req.spec_drafts == [3, 4, 1]
    ctl.plan(req, num_running=5)  # too many running: decode without waiting
    assert not req.spec_wait
    for expected in (1, 2, 4):  # each rejected proposal doubles the back-off
        ctl.record(req, 3, 0)
        for _ in range(expected):
            req.spec_drafts = []
            ctl.plan(req, num_running=1)
            ctl.propose_queued()
            assert not req.spec_wait and not req.spec_drafts
        ctl.plan(req, num_running=1)
        ctl.propose_queued()
        assert req.spec_wait
    ctl.record(req, 3, 3)  # accepted: the next failure backs off one step again
    ctl.record(req, 3, 0)
    assert req.spec_state.backoff_left == 1
    assert ctl.stats.num_drafts == 5 and ctl.stats.num_accepted_tokens == 3
    assert ctl.stats.accepted_per_pos == [1, 1, 1]
    assert MAX_BACKOFF >= 32
    near_end = _request([1, 2, 3, 4, 1, 2], max_tokens=4)  # 3 generated, 1 left: nothing to propose
    ctl.plan(near_end, num_running=1)
    ctl.propose_queued()
    assert not near_end.spec_drafts and not near_end.spec_wait


# ---- the rejection sampler on synthetic distributions ----------------------------------------------

def _inputs(rows: int, temperature: float, top_k: int = 0, top_p: float = 1.0) -> SamplingInputs:
    return SamplingInputs(
        jnp.full(rows, temperature, jnp.float32), jnp.full(rows, top_k, jnp.int32), jnp.full(rows, top_p, jnp.float32),
        jnp.zeros(rows, jnp.float32), jnp.ones(rows, jnp.float32), jnp.zeros(rows, jnp.float32),
        jnp.zeros(rows, jnp.float32), jnp.stack([jnp.arange(rows, dtype=jnp.uint32), jnp.full(rows, 7, jnp.uint32)], 1),
        jnp.full(rows, 3, jnp.int32), jnp.zeros(rows, bool), jnp.full((rows, 16), -1, jnp.int32),
        jnp.full((rows, MAX_LOGIT_BIAS), -1, jnp.int32), jnp.zeros((rows, MAX_LOGIT_BIAS), jnp.float32))


def _target(p: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The distribution the plain sampler draws from, computed in float64 on the host."""
    x = np.log(p) / temperature
    q = np.exp(x - x.max())
    q[np.argsort(-q)[top_k:]] = 0
    q /= q.sum()
    order = np.argsort(-q)
    keep = np.cumsum(q[order]) - q[order] < top_p
    q[order[~keep]] = 0
    return q / q.sum()


def _chi2_agrees(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    mask = expected_probs > 0
    assert counts[~mask].sum() == 0, "a token outside the target's support was drawn"
    return stats.chisquare(counts[mask], expected_probs[mask] * counts.sum()).pvalue


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(with_draft_probs):
    """Over many seeds, the first output token follows p_0 and, where the first proposal was
    accepted, the second follows p_1: with one-hot proposals (n-gram) and with a draft distribution."""
    rng = np.random.default_rng(0)
    rows, v, k = 20000, 24, 2
    temperature, top_k, top_p = 1.0, 8, 0.9
    p = rng.dirichlet(np.ones(v) * 0.7, size=k + 1)
    logits = jnp.asarray(np.tile(np.log(p), (rows, 1, 1)).reshape(rows * (k + 1), v), jnp.float32)
    targets = [_target(p[j], temperature, top_k, top_p) for j in range(k + 1)]
    draft = np.array([np.argsort(-targets[0])[1], np.argsort(-targets[1])[0]])  # a plausible, not the best, guess
    q = None
    if with_draft_probs:
        q_np = rng.dirichlet(np.ones(v), size=k)
        q = jnp.asarray(np.tile(q_np, (rows, 1, 1)), jnp.float32)
        draft_rows = np.stack([rng.choice(v, rows, p=q_np[j]) for j in range(k)], 1)  # proposals drawn from q
    else:
        draft_rows = np.tile(draft, (rows, 1))
    table = jnp.zeros((rows + 1, v), jnp.int32)
    out = jax.jit(verify, static_argnums=(8,))(
        logits, _inputs(rows, temperature, top_k, top_p), table, table.astype(bool), jnp.arange(rows),
        jnp.asarray(draft_rows, jnp.int32), jnp.full(rows, k, jnp.int32), q, True)
    tokens, num = np.asarray(out.tokens), np.asarray(out.num_tokens)
    assert ((num >= 1) & (num <= k + 1)).all()
    assert _chi2_agrees(np.bincount(tokens[:, 0], minlength=v), targets[0]) > SIGNIFICANCE
    # Where the first proposal was accepted (a rejected proposal is never redrawn: the residual is 0
    # there), the second token is the accepted second proposal, a residual draw or the bonus token.
    second = tokens[(num >= 2) & (tokens[:, 0] == draft_rows[:, 0]), 1]
    assert (second >= 0).all() and len(second) > 2000, len(second)
    assert _chi2_agrees(np.bincount(second, minlength=v), targets[1]) > SIGNIFICANCE


def test_greedy_verification_accepts_the_matching_prefix_and_adds_the_argmax():
    v, k = 24, 3
    best = np.array([[4, 7, 1, 2], [4, 7, 1, 2], [3, 3, 3, 3]])
    logits = np.full((3, k + 1, v), -5.0, np.float32)
    for r in range(3):
        logits[r, np.arange(k + 1), best[r]] = 5.0
    drafts = jnp.array([[4, 7, 9], [4, 7, 1], [3, -1, -1]], jnp.int32)
    table = jnp.zeros((4, v), jnp.int32)
    out = verify(jnp.asarray(logits.reshape(-1, v)), _inputs(3, 0.0), table, table.astype(bool), jnp.arange(3),
                 drafts, jnp.array([3, 3, 1], jnp.int32), None, True)
    assert np.asarray(out.num_tokens).tolist() == [3, 4, 2]
    assert np.asarray(out.tokens).tolist() == [[4, 7, 1, -1], [4, 7, 1, 2], [3, 3, -1, -1]]


# ---- the engine with speculation ---------------------------------------------------------------------

PROMPTS = [GROUNDED, "List the numbers from 1 to 40, separated by commas: 1, 2,",
           "Write a short poem about the sea.", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=48, temperature=0),
    SamplingParams(max_tokens=13, temperature=0, ignore_eos=True),  # ends inside a proposal
    SamplingParams(max_tokens=48, temperature=0, stop=["lazy dog. The dog", "15,"]),  # stop strings mid-proposal
    SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.05, frequency_penalty=0.1),
    SamplingParams(max_tokens=24, temperature=0, logprobs=3),
])
def test_greedy_output_is_token_identical_to_no_speculation(smol_llm, spec_llm, params):
    before = spec_llm.engine.spec.stats.num_accepted_tokens
    want = smol_llm.generate(PROMPTS, params)
    got = spec_llm.generate(PROMPTS, params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert (g.outputs[0].finish_reason, g.outputs[0].stop_reason) == (w.outputs[0].finish_reason,
                                                                        w.outputs[0].stop_reason)
        if params.logprobs:
            for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                assert a.keys() == b.keys()
                np.testing.assert_allclose([v.logprob for v in a.values()], [b[t].logprob for t in a], atol=2e-4)
    assert spec_llm.engine.spec.stats.num_accepted_tokens > before  # speculation did happen
    assert spec_llm.engine.compiles_since_warmup == 0


def test_logit_bias_and_allowed_token_ids_hold_at_every_verified_position(smol_llm, spec_llm):
    """Proposals are verified against the biased logits: with the comma banned and the space boosted,
    the speculating engine's greedy tokens are the plain engine's (which differ from the unbiased
    ones), and proposals were still accepted; so with allowed_token_ids."""
    comma, space = smol_llm.tokenizer.encode(",")[-1], smol_llm.tokenizer.encode(" ")[-1]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logit_bias={comma: -100, space: 1.5})
    before = spec_llm.engine.spec.stats.num_accepted_tokens
    want = smol_llm.generate(PROMPTS, params)
    got = spec_llm.generate(PROMPTS, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert not any(comma in w.token_ids for w in want)
    unbiased = smol_llm.generate(PROMPTS[1:2], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    assert comma in unbiased.token_ids
    assert spec_llm.engine.spec.stats.num_accepted_tokens > before
    # allowed_token_ids ride with the grammar masks, one per verified position: the grounded answer's
    # own tokens but its last new one, so it follows the text (proposals accepted), then parts from it
    grounded = smol_llm.generate(PROMPTS[:1], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    allowed = sorted(set(grounded.token_ids) - {grounded.token_ids[-1]})
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, allowed_token_ids=allowed)
    before = spec_llm.engine.spec.stats.num_accepted_tokens
    want = smol_llm.generate(PROMPTS[:1], params)[0].token_ids
    assert want != grounded.token_ids and set(want) <= set(allowed)
    assert spec_llm.generate(PROMPTS[:1], params)[0].token_ids == want
    assert spec_llm.engine.spec.stats.num_accepted_tokens > before


def test_bad_words_hold_at_every_verified_position(smol_llm, spec_llm):
    """Two-token bad words, from the grounded answer (where proposals are accepted), are banned at
    whichever verified position their first token ends: the speculating engine's greedy tokens are the
    plain engine's, which part from the unbanned answer there, and proposals were accepted. Several
    words, so that some fall inside a proposal, not at its start."""
    tok = smol_llm.tokenizer
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    grounded = smol_llm.generate(PROMPTS[:1], params)[0].token_ids
    starts = [i for i in range(4, len(grounded) - 1) if tok.decode(grounded[i:i + 2]).startswith(" ")
              and tok.encode(tok.decode(grounded[i:i + 2]), add_special_tokens=False) == grounded[i:i + 2]]
    assert len(starts) >= 6
    before = spec_llm.engine.spec.stats.num_accepted_tokens
    for at in starts[:6]:
        banned = dataclasses.replace(params, bad_words=[tok.decode(grounded[at:at + 2])])
        want = smol_llm.generate(PROMPTS[:1], banned)[0].token_ids
        assert want[:at + 1] == grounded[:at + 1] and want[at + 1] != grounded[at + 1]
        assert spec_llm.generate(PROMPTS[:1], banned)[0].token_ids == want, at
    assert spec_llm.engine.spec.stats.num_accepted_tokens > before


# The sampled test's prompt: 49 tokens, three whole pages and one more, so that every sample but the
# first few finds the prompt's pages in the prefix cache and prefills one token (GROUNDED's 52 left
# four, and 8 rows of 4 took the 64-token bucket). Its n-gram proposals are accepted ~32% of the time
# (GROUNDED's ~47%): a wrong acceptance moves more samples. Planted in verify.py, "accept every
# proposal" and "draw a rejected token from p, not the residual" gave p = 1e-45 and 2e-5 here, against
# 6e-18 and 0.014 (missed) with GROUNDED.
SAMPLED_PROMPT = f"Repeat this text:\n{TEXT}\nAgain:\n"


def _second_tokens(llm: LLM, n: int) -> np.ndarray:
    params = SamplingParams(n=n, max_tokens=3, temperature=1.0, top_k=40, top_p=0.95, seed=1234, ignore_eos=True)
    out = llm.generate([SAMPLED_PROMPT], params)[0]
    return np.array([o.token_ids[1] for o in out.outputs])


def test_sampled_output_keeps_the_distribution_on_the_real_model(smol_llm, spec_llm):
    """The second generated token (verified against n-gram proposals with speculation on) has the
    same distribution with and without speculation: a chi-square test over 300 seeds each."""
    before = spec_llm.engine.spec.stats.num_drafts
    want, got = _second_tokens(smol_llm, 300), _second_tokens(spec_llm, 300)
    assert spec_llm.engine.spec.stats.num_drafts - before >= 75
    ids = np.union1d(want, got)
    table = np.array([[np.sum(want == t) for t in ids], [np.sum(got == t) for t in ids]])
    common = table.sum(axis=0) >= 10
    table = np.concatenate([table[:, common], table[:, ~common].sum(axis=1, keepdims=True)], axis=1)
    assert stats.chi2_contingency(table).pvalue > SIGNIFICANCE
    assert spec_llm.engine.compiles_since_warmup == 0


def test_mixed_load_compiles_nothing_and_frees_everything(spec_llm):
    """Greedy, sampled, penalized and logprob requests, more than speculate at once, with prompts
    long enough for chunked prefill: no compile, every page and slot back afterwards."""
    prompts = PROMPTS * 3 + [GROUNDED * 3]
    params = [SamplingParams(max_tokens=20 + i, temperature=(i % 3) * 0.5, top_p=0.9 if i % 2 else 1.0,
                             presence_penalty=0.5 if i % 4 == 0 else 0.0, logprobs=2 if i % 5 == 0 else None,
                             seed=i) for i in range(len(prompts))]
    out = spec_llm.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == p.max_tokens or o.outputs[0].finish_reason == "stop"
               for o, p in zip(out, params))
    e = spec_llm.engine
    assert e.compiles_since_warmup == 0
    assert e.kv.num_free_pages == e.kv.num_usable_pages
    assert sorted(e.scheduler._free_slots) == list(range(e.config.max_num_seqs))


def test_preempted_and_aborted_speculating_requests_free_everything(smol_llm):
    llm = LLM(**{**SMALL_ENGINE, "num_kv_pages": 16, "max_model_len": 160}, speculative_config=SPEC)
    e = llm.engine
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    prompts = [GROUNDED, "Please. " + GROUNDED, "Now. " + GROUNDED]  # no shared prefix pages
    want = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params)]
    e.scheduler.growth_ratio = GROWTH_RATIO_MIN  # admit all three at once: they outgrow the pool later
    ids = [e.add_request(p, params)[0] for p in prompts]
    outputs = {i: [] for i in ids}
    steps = 0
    while e.has_unfinished():
        for d in e.step():
            outputs[d.request_id] += d.token_ids
        steps += 1
        if steps == 12:
            e.abort(ids[0])
    assert e.scheduler.num_preemptions > 0  # two sequences of 9 pages do not fit 15
    assert e.spec.stats.num_accepted_tokens > 0
    assert 0 < len(outputs[ids[0]]) < 80
    for i, tokens in zip(ids[1:], want[1:]):  # recomputed after preemption, still the same tokens
        assert outputs[i] == tokens
    assert e.kv.num_free_pages == e.kv.num_usable_pages
    assert sorted(e.scheduler._free_slots) == list(range(e.config.max_num_seqs))
    assert e.compiles_since_warmup == 0


def test_metrics_report_spec_decode_counters_under_vllm_names():
    from infire_jax.engine.async_engine import EngineSnapshot
    from infire_jax.speculative.controller import SpecStats
    from server.metrics import ServerMetrics

    metrics = ServerMetrics(["smol"])
    spec = SpecStats(num_drafts=3, num_draft_tokens=12, num_accepted_tokens=7, accepted_per_pos=[3, 2, 1, 1])
    metrics.track_engine("smol", lambda: EngineSnapshot(spec=spec))
    text = metrics.render().decode()
    for line in ('infire:spec_decode_num_drafts_total{model_name="smol"} 3.0',
                 'infire:spec_decode_num_draft_tokens_total{model_name="smol"} 12.0',
                 'infire:spec_decode_num_accepted_tokens_total{model_name="smol"} 7.0',
                 'infire:spec_decode_num_accepted_tokens_per_pos_total{model_name="smol",position="1"} 2.0'):
        assert line in text


@pytest.mark.parametrize("draft", ["default", "dummy:smollm2-135m,layers=2"])
def test_draft_model_output_is_token_identical_and_frees_everything(smol_llm, default_gguf, draft):
    """The default model drafting for itself (nearly every proposal accepted) and a random-weight
    draft with its vocabulary and 2 of its 30 layers (nearly none accepted): greedy output equals
    decoding without one."""
    llm = LLM(**SMALL_ENGINE, speculative_config={
        "method": "draft_model", "model": default_gguf if draft == "default" else draft,
        "num_speculative_tokens": 3, "disable_by_batch_size": 8})
    e = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0, stop=["15,"])
    for w, g in zip(smol_llm.generate(PROMPTS, params), llm.generate(PROMPTS, params)):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    s = e.spec.stats
    assert s.num_drafts > 0
    if draft == "default":
        assert s.num_accepted_tokens >= 0.9 * s.num_draft_tokens
    else:
        assert s.num_accepted_tokens <= 0.2 * s.num_draft_tokens
    sampled = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3))
    assert all(len(o.outputs[0].token_ids) == 16 or o.outputs[0].finish_reason == "stop" for o in sampled)
    assert e.compiles_since_warmup == 0
    assert e.kv.num_free_pages == e.kv.num_usable_pages


def test_draft_model_with_another_vocabulary_is_refused(monkeypatch):
    """From the draft's config, before the target is loaded and compiled."""
    def load_and_compile(*args, **kwargs):
        raise AssertionError("the target was loaded before the draft was checked")

    monkeypatch.setattr("infire_jax.engine.engine.load_and_compile", load_and_compile)
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(**SMALL_ENGINE, speculative_config={"method": "draft_model", "model": "dummy:qwen3-0.6b",
                                                "num_speculative_tokens": 2})


def test_draft_model_and_eagle3_need_a_kv_group_that_keeps_every_page():
    """A draft model or an EAGLE-3 head keeps its KV on the pages of the target's global group; a model of
    sliding-window layers only has none on the hybrid KV cache: refused before anything loads, naming the
    way out. With every page kept in one group (`hybrid_kv_cache=False`) or beside global layers, a draft
    model passes (an EAGLE-3 head there: tests/test_eagle3.py's engine tests)."""
    from infire_jax.core.kv_groups import KVGroupLayout
    from infire_jax.models.config import ModelConfig
    from infire_jax.speculative.setup import parse_speculation

    windows = ((0, 16),) * 2
    target = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=2, num_kv_heads=1, head_dim=16, local_attention=windows)
    spec = {"method": "draft_model", "model": "dummy:smollm2-135m", "num_speculative_tokens": 2}  # its vocabulary
    check = dict(dtype="float32", multiprocess=False)
    for method in ("draft_model", "eagle3"):
        with pytest.raises(ConfigError, match=f"method '{method}' keeps its KV on the pages of the target's global "
                                              "layers .* no group keeps them: set hybrid_kv_cache=False"):
            parse_speculation(dict(spec, method=method), target, kv_groups=KVGroupLayout.of(windows, 2), **check)
    assert parse_speculation(spec, target, kv_groups=None, **check)[0].method == "draft_model"
    mixed = KVGroupLayout.of(((0, 0), (0, 16)), 2)
    assert parse_speculation(spec, target, kv_groups=mixed, **check)[0].method == "draft_model"


def test_constrained_requests_speculate_within_their_grammar(smol_llm, spec_llm):
    """JSON-schema and regex outputs with n-gram proposals: the proposals are cut to what the
    grammar allows, each verified position is masked by the grammar after the proposals before it,
    and greedy output equals constrained decoding without speculation."""
    import json

    from infire_jax.structured.spec import StructuredOutputs

    schema = {"type": "object", "properties": {"text": {"type": "string"}, "words": {"type": "integer"}},
              "required": ["text", "words"], "additionalProperties": False}
    prompt = f"Put this text in a JSON object with its word count:\n{TEXT}\nJSON:"
    params = [SamplingParams(max_tokens=80, temperature=0, structured_outputs=StructuredOutputs(json=schema)),
              SamplingParams(max_tokens=40, temperature=0,
                             structured_outputs=StructuredOutputs(regex=r"(The [a-z]+ [a-z]+ fox\. ){2,4}"))]
    before = spec_llm.engine.spec.stats.num_accepted_tokens
    want = smol_llm.generate([prompt, GROUNDED], params)
    got = spec_llm.generate([prompt, GROUNDED], params)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    if got[0].outputs[0].finish_reason == "stop":
        json.loads(got[0].outputs[0].text)
    assert spec_llm.engine.spec.stats.num_accepted_tokens > before
    assert spec_llm.engine.compiles_since_warmup == 0
