"""Decode bursts: several decode steps in one device launch (scheduler.py, step_programs.decode_burst).

The scheduler decides when a step becomes a burst and gives it pages for every step; the device
feeds each step's samples to the next and stops rows on their stop ids. The reference is the same
engine taking one step a launch: every token, logprob and finish reason must match.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SMALL_ENGINE

from infire_jax import LLM, SamplingParams
from infire_jax.runner.batch import TOKEN_OUTPUT, TOKEN_PAD, TOKEN_PROMPT, build_batch, burst_inputs
from infire_jax.bench.driver import StepTrace
from infire_jax.runner.buckets import Buckets, StepShape
from infire_jax.core.kv_cache import KVCacheManager
from infire_jax.core.request import Request
from infire_jax.core.scheduler import Scheduler
from infire_jax.runner.step_programs import burst_step_batch

PS = 4


def make_req(rid: str, prompt_len: int, *, max_tokens: int = 16, min_tokens: int = 0, arrival: float = 0.0,
             stop_token_ids=None) -> Request:
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, stop_token_ids=stop_token_ids)
    return Request(rid, list(range(10, 10 + prompt_len)), params, max_tokens=max_tokens, seed=0,
                   eos_token_ids=(2,), arrival_time=arrival)


def prefilled(sched: Scheduler, *reqs: Request) -> None:
    """Admits the requests and runs their prompts (one token sampled and read back each)."""
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    assert [s.req for s in out.seqs] == list(reqs) and all(s.samples for s in out.seqs) and not out.is_burst
    sched.commit(out)
    for s in out.seqs:
        s.req.num_pending_tokens -= 1
        s.req.output_token_ids.append(7)


# ---- when the scheduler plans a burst ---------------------------------------------------------

def test_decodes_alone_become_a_burst_with_pages_for_every_step():
    kv = KVCacheManager(64, PS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16, num_decode_steps=4)
    a, b = make_req("a", 3), make_req("b", 6, arrival=1)
    prefilled(sched, a, b)
    out = sched.schedule()
    assert out.is_burst and [(s.start, s.num_tokens, s.num_steps) for s in out.seqs] == [(3, 1, 4), (6, 1, 4)]
    assert len(a.pages) == kv.pages_needed(3 + 4) and len(b.pages) == kv.pages_needed(6 + 4)
    sched.commit(out)
    assert (a.num_computed_tokens, a.num_pending_tokens, a.num_tokens) == (7, 4, 8)
    # The next burst is planned while this one is in flight: its first token is the device's.
    out = sched.schedule()
    assert [(s.start, s.from_device, s.gen_index, s.num_steps) for s in out.seqs] == [(7, True, 5, 4), (10, True, 5, 4)]


def test_burst_steps_stop_at_max_tokens_and_before_min_tokens_ends():
    """max_tokens caps a row's steps; so does min_tokens, whose stop-id suppression stays fixed for a burst."""
    kv = KVCacheManager(64, PS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16, num_decode_steps=4)
    a, b, c = make_req("a", 3, max_tokens=3), make_req("b", 3, min_tokens=3, arrival=1), make_req("c", 3, arrival=2)
    prefilled(sched, a, b, c)
    out = sched.schedule()
    assert [s.num_steps for s in out.seqs] == [2, 2, 4]
    np.testing.assert_array_equal(burst_inputs(out, 4).num_steps, [2, 2, 4, 0])


def test_no_burst_while_a_waiting_request_may_join_soon():
    """A request waiting for pages could be admitted once some free: the decodes go one step at a
    time. One waiting for a sequence slot cannot join before a running request ends: they burst."""
    kv = KVCacheManager(5, PS)  # 4 usable pages
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=32, num_decode_steps=4)
    a, c = make_req("a", 3), make_req("c", 16, arrival=1)
    prefilled(sched, a)
    sched.add(c)  # needs all 4 pages
    out = sched.schedule()
    assert [s.req for s in out.seqs] == [a] and not out.is_burst and sched.waiting == [c]

    kv = KVCacheManager(64, PS)
    sched = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=32, num_decode_steps=4)
    a, c = make_req("a", 3), make_req("c", 3, arrival=1)
    prefilled(sched, a)
    sched.add(c)
    out = sched.schedule()
    assert [s.req for s in out.seqs] == [a] and out.is_burst


def test_no_burst_with_a_prompt_chunk_a_grammar_or_too_few_pages():
    kv = KVCacheManager(64, PS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=8, num_decode_steps=4)
    a, long = make_req("a", 3), make_req("long", 20, arrival=1)
    prefilled(sched, a)
    sched.add(long)
    assert not sched.schedule().is_burst  # a decodes beside long's first chunk

    kv = KVCacheManager(64, PS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=8, num_decode_steps=4)
    a = make_req("a", 3)
    prefilled(sched, a)
    a.grammar = object()  # structured outputs: each token's mask needs the one before it on the host
    assert not sched.schedule().is_burst

    kv = KVCacheManager(4, PS)  # 3 usable pages
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=8, num_decode_steps=8)
    a = make_req("a", 6, max_tokens=12)
    prefilled(sched, a)  # 2 pages; 8 steps from position 6 would need 4
    out = sched.schedule()
    assert [s.req for s in out.seqs] == [a] and not out.is_burst and kv.num_free_pages == 1


def test_burst_batch_steps_advance_positions_and_park_finished_rows():
    """Step k of a burst: each row one position on, at most to its last allowed step; rows no longer
    active write to the null page as padding does, and only active rows sample."""
    kv = KVCacheManager(64, PS)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16, num_decode_steps=4)
    a, b = make_req("a", 3, max_tokens=3), make_req("b", 6, arrival=1)
    prefilled(sched, a, b)
    out = sched.schedule()
    assert [s.num_steps for s in out.seqs] == [2, 4]
    batch = build_batch(out, StepShape(4, 4), page_size=PS, pages_per_seq=4, dummy_slot=4)
    burst = burst_inputs(out, 4)
    active = jnp.asarray([False, True, False, False])  # a is done after its 2 steps
    k3 = jax.tree.map(np.asarray, burst_step_batch(batch, jnp.int32(3), active, jnp.asarray(burst.num_steps), PS))
    np.testing.assert_array_equal(k3.meta.positions, [4, 9, 0, 0])  # a parked at its last position, 3 + 1
    np.testing.assert_array_equal(k3.meta.kv_lens, [5, 10, 0, 0])
    np.testing.assert_array_equal(k3.meta.slot_mapping, [0, b.pages[9 // PS] * PS + 9 % PS, 2, 3])
    np.testing.assert_array_equal(k3.token_kind, [TOKEN_PAD, TOKEN_OUTPUT, TOKEN_PAD, TOKEN_PAD])
    np.testing.assert_array_equal(k3.from_device, [True, True, False, False])
    np.testing.assert_array_equal(k3.sample_rows, [False, True, False, False])
    np.testing.assert_array_equal(k3.sampling.step, [4, 4, 3, 3])
    k0 = jax.tree.map(np.asarray, burst_step_batch(batch, jnp.int32(0), jnp.asarray([True, True, False, False]),
                                                   jnp.asarray(burst.num_steps), PS))
    for got, want in zip(jax.tree.leaves(k0), jax.tree.leaves(batch)):  # step 0 is the scheduled step itself
        np.testing.assert_array_equal(got, want)
    assert list(batch.token_kind[:2]) == [TOKEN_OUTPUT, TOKEN_OUTPUT] and TOKEN_PROMPT not in batch.token_kind


def test_decode_shapes_are_the_buckets_a_decode_step_can_take():
    assert [s.num_tokens for s in Buckets((1, 2, 4, 8, 16, 64), 12).decode_shapes] == [1, 2, 4, 8, 16]
    assert Buckets((4, 32), 4).decode_shapes == [StepShape(4, 4)]


def test_bench_counts_every_step_of_a_burst():
    burst = StepTrace(0.0, contexts=[10, 20], num_first=0, row_tokens=[3, 1], burst=True)
    assert burst.step_contexts() == [[10, 20], [11], [12]]
    verify = StepTrace(0.0, contexts=[10, 20], num_first=0, row_tokens=[3, 1], burst=False)
    assert verify.step_contexts() == [[10, 20]]


# ---- on the real model: bursts change nothing but the number of launches ----------------------

@pytest.fixture(scope="module")
def one_step_llm():
    return LLM(**SMALL_ENGINE, num_decode_steps=1)


PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "List three colors:"]
PARAMS = {
    "greedy": SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=17, temperature=0.8, top_k=40, top_p=0.9, seed=7, logprobs=2),
    "penalties": SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.2,
                                presence_penalty=0.1),
    "min_tokens": SamplingParams(max_tokens=20, min_tokens=6, temperature=0.0),
    "stop_string": SamplingParams(max_tokens=40, temperature=0.0, stop=[" the"]),
    "stop_token_ids": SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[13, 30]),
    "eos": SamplingParams(max_tokens=150, temperature=0.0, n=2),
}


def outputs(llm: LLM, params: SamplingParams):
    return [[(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in r.outputs]
            for r in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("name", list(PARAMS))
def test_bursts_sample_what_single_steps_sample(smol_llm, one_step_llm, name):
    engine = smol_llm.engine
    assert engine.runner.rc.decode_steps == 4 and one_step_llm.engine.runner.rc.decode_steps == 1
    free, steps = engine.kv.num_free_pages, engine.stats.steps
    got = outputs(smol_llm, PARAMS[name])
    want = outputs(one_step_llm, PARAMS[name])
    # Tokens, texts and ends exactly. Log-probabilities within float32 rounding: the session engine may
    # hold a prompt's first pages from another module's requests (prefix caching), and then prefills
    # only the tail, in another bucket, which rounds the prompt's logits and KV differently (1e-6 to 1e-5).
    assert [[c[:3] for c in r] for r in got] == [[c[:3] for c in r] for r in want]
    for g, w in zip((c[3] for r in got for c in r), (c[3] for r in want for c in r)):
        assert (g is None) == (w is None) and [list(a) for a in g or []] == [list(b) for b in w or []]
        for a, b in zip(g or [], w or []):
            np.testing.assert_allclose([v.logprob for v in a.values()], [v.logprob for v in b.values()], rtol=0,
                                       atol=1e-4)
    longest = max(len(c[0]) for r in got for c in r)
    assert engine.stats.steps - steps < longest  # fewer launches than tokens: bursts ran
    assert engine.kv.num_free_pages == free and engine.compiles_since_warmup == 0


def test_device_stops_a_row_on_its_stop_token(smol_llm, monkeypatch):
    """A row whose burst samples one of its stop ids ends there on the device: the burst reports the
    tokens up to the stop, not four."""
    greedy = smol_llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    stop = greedy.outputs[0].token_ids[2]  # sampled by the first burst's second step
    runner = smol_llm.engine.runner
    fetched = []
    fetch = runner.fetch

    def logged_fetch(pending):
        res = fetch(pending)
        fetched.append((pending.work.is_burst, res.num_tokens[:len(pending.work.seqs)].tolist()))
        return res

    monkeypatch.setattr(runner, "fetch", logged_fetch)
    out = smol_llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                       stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == greedy.outputs[0].token_ids[:3] and out.finish_reason == "stop"
    assert fetched[:2] == [(False, [1]), (True, [2])]
