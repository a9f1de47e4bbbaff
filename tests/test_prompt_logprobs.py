"""Prompt logprobs (SamplingParams.prompt_logprobs) against HF transformers on the default model, in
float32: short and long prompts (700 tokens: eleven chunks of the 64-token step budget, over several
blocks of the head), batches mixing them with ordinary requests and prefill-only ones (max_tokens 0),
a prefix-cache hit beside a request that must not take it, a preemption in the middle of a prompt,
and no compilation after warmup.

The text is the GPL-3 that every Debian system ships (base-files: /usr/share/common-licenses).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from infire_jax import SamplingParams
from infire_jax.runner.compile_guard import forbid_compiles
from infire_jax.errors import InvalidRequestError
from infire_jax.core.request import Status

LICENSE = "/usr/share/common-licenses/GPL-3"
TOL = 1e-4
NEAR_TIE = 1e-3  # alternatives closer than this may swap places between two float32 implementations


@pytest.fixture(scope="module")
def text_ids(smol_llm) -> list[int]:
    with open(LICENSE) as f:
        return smol_llm.tokenizer.encode(" ".join(f.read().split()))


def hf_logprobs(hf_model, ids: list[int]) -> np.ndarray:
    """[len(ids), V]: the log-softmax at every position, in float64, from one forward."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def assert_matches_hf(prompt_logprobs, ids: list[int], ref: np.ndarray, k: int) -> None:
    """Each position's prompt-token logprob within TOL; its rank and the top k ids where no near-tie
    makes the order ambiguous."""
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    ranks_checked = 0
    for p in range(1, len(ids)):
        entry, row, target = prompt_logprobs[p], ref[p - 1], ids[p]
        assert abs(entry[target].logprob - row[target]) < TOL, (p, entry[target].logprob, row[target])
        others = np.delete(row, target)
        if np.min(np.abs(others - row[target])) > NEAR_TIE:
            assert entry[target].rank == 1 + int(np.sum(others > row[target])), p
            ranks_checked += 1
        order = np.argsort(-row)
        top = [t for t, lp in sorted(entry.items(), key=lambda item: item[1].rank) if lp.rank <= k]
        if k and np.all(-np.diff(row[order[:k + 1]]) > NEAR_TIE):
            assert top == order[:k].tolist(), p
            for t in top:
                assert abs(entry[t].logprob - row[t]) < TOL
        assert all(lp.decoded_token is not None for lp in entry.values())
    assert ranks_checked >= (len(ids) - 1) // 2  # the check above is not vacuous


def test_prompt_logprobs_match_hf_in_a_mixed_batch(smol_llm, hf_smol, text_ids):
    """1, 17 and 700 tokens, with top 5 / 0 / 3, beside an ordinary request and a prefill-only one."""
    short, mid, long = text_ids[:1], text_ids[100:117], text_ids[200:900]
    params = [SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=5),
              SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0),
              SamplingParams(max_tokens=0, prompt_logprobs=3),
              SamplingParams(max_tokens=4, temperature=0, logprobs=2),
              SamplingParams(max_tokens=0, prompt_logprobs=2)]
    outs = smol_llm.generate([short, mid, long, text_ids[50:90], short], params)
    assert outs[0].prompt_logprobs == [None] and len(outs[0].token_ids) == 3
    assert_matches_hf(outs[1].prompt_logprobs, mid, hf_logprobs(hf_smol, mid), 0)
    assert all(len(e) == 1 for e in outs[1].prompt_logprobs[1:])  # k = 0: the prompt token alone
    assert_matches_hf(outs[2].prompt_logprobs, long, hf_logprobs(hf_smol, long), 3)
    assert outs[2].token_ids == [] and outs[2].outputs[0].finish_reason == "length"
    assert outs[3].prompt_logprobs is None and len(outs[3].token_ids) == 4
    assert outs[4].prompt_logprobs == [None] and outs[4].token_ids == []
    # The generated tokens follow the prompt as HF's greedy choice does.
    ref = hf_logprobs(hf_smol, mid)
    assert outs[1].token_ids[0] == int(np.argmax(ref[-1]))


def test_prefix_cache_hit_beside_a_request_that_needs_every_position(smol_llm, hf_smol, text_ids):
    """After a prompt is cached, a request sharing its prefix and asking for prompt logprobs computes
    every position (nothing taken from the cache), while one in the same batch that does not ask
    takes the cached pages and still gets the right next token."""
    first = text_ids[1000:1100]
    smol_llm.generate([first], SamplingParams(max_tokens=1, temperature=0))
    with_lp, plain = first[:80] + text_ids[1200:1230], first[:80] + text_ids[1300:1320]
    outs = smol_llm.generate([with_lp, plain], [SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2),
                                                SamplingParams(max_tokens=1, temperature=0, logprobs=0)])
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens >= 64
    assert_matches_hf(outs[0].prompt_logprobs, with_lp, hf_logprobs(hf_smol, with_lp), 2)
    ref = hf_logprobs(hf_smol, plain)[-1]
    assert outs[1].token_ids[0] == int(np.argmax(ref))
    assert abs(outs[1].logprobs[0][outs[1].token_ids[0]].logprob - ref.max()) < TOL


@pytest.mark.parametrize("evicted", [False, True])
def test_a_preempted_prompt_reports_each_position_once(smol_llm, hf_smol, text_ids, evicted):
    """A request preempted after two chunks of its prompt comes back and reports the rest: each
    position once, all equal to HF. While the prefix cache (which holds the whole prompt) keeps its
    pages, it takes only the positions already reported from it; once they are evicted, it computes
    the prompt again from the start."""
    engine, budget = smol_llm.engine, smol_llm.engine.scheduler.max_num_batched_tokens
    ids = text_ids[2000 + 400 * evicted:2300 + 400 * evicted]
    smol_llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))  # the whole prompt cached
    rid, _ = engine.add_request(ids, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    (req,) = engine._requests[rid]
    deltas = []
    while req.num_computed_tokens < 2 * budget:
        deltas += engine.step()
    assert req.num_cached_tokens == 0
    engine.scheduler._preempt(req)  # what the scheduler does when a page runs out
    assert req.status is Status.WAITING and req.num_computed_tokens == 0
    if evicted:
        engine.kv.drop_cached()  # as pool pressure would evict the pages; nobody holds one now
    reported = req.prompt_logprobs_next
    assert reported == 2 * budget
    while req.status is Status.WAITING:
        deltas += engine.step()
    assert req.num_computed_tokens == budget + (0 if evicted else reported)  # cached: the reported positions alone
    while engine.has_unfinished():
        deltas += engine.step()
    assert req.num_preemptions == 1
    got = [d.prompt_logprobs for d in deltas if d.request_id == rid and d.prompt_logprobs is not None]
    assert len(got) == 1
    assert_matches_hf(got[0], ids, hf_logprobs(hf_smol, ids), 1)


def test_nothing_compiles_with_prompt_logprobs_in_the_mix(smol_llm, text_ids):
    prompts = [text_ids[i:i + n] for i, n in ((0, 1), (10, 2), (20, 9), (40, 63), (110, 64), (200, 129), (400, 300))]
    kinds = [dict(prompt_logprobs=0), dict(prompt_logprobs=20, max_tokens=0), dict(logprobs=3),
             dict(prompt_logprobs=7, n=2, temperature=0.8, seed=3), dict(prompt_logprobs=1, logprobs=1),
             dict(), dict(prompt_logprobs=4, max_tokens=0)]
    params = [SamplingParams(**{"max_tokens": 3, "temperature": 0, "ignore_eos": True, **k}) for k in kinds]
    with forbid_compiles():
        outs = smol_llm.generate(prompts, params)
        smol_llm.generate(prompts[::-1], params)
    assert smol_llm.engine.compiles_since_warmup == 0
    for prompt, p, out in zip(prompts, params, outs):
        want = p.prompt_logprobs is not None
        assert (out.prompt_logprobs is not None) == want
        if want:
            assert len(out.prompt_logprobs) == len(prompt)
            assert all(len(e) in (p.prompt_logprobs, p.prompt_logprobs + 1) for e in out.prompt_logprobs[1:])
        assert len(out.outputs) == p.n and all(len(o.token_ids) == p.max_tokens for o in out.outputs)


def test_prompt_logprobs_beyond_the_limit_are_refused(smol_llm):
    with pytest.raises(InvalidRequestError) as e:
        smol_llm.generate(["Hello there"], SamplingParams(prompt_logprobs=21))
    assert e.value.param == "prompt_logprobs" and "--max-prompt-logprobs" in str(e.value)
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(prompt_logprobs=bad)
        assert e.value.param == "prompt_logprobs"
    assert not smol_llm.engine.has_unfinished()
