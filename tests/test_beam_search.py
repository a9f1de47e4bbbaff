"""Beam search (infire_jax/sample/beam_search.py): vLLM's algorithm on a hand-worked table, `LLM.beam_search`
on the real model against transformers' own beam search, and `use_beam_search` over HTTP against the
offline results, with the requests it refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from server_utils import MODEL, post_json

from infire_jax import BeamSearchParams
from infire_jax.sample.beam_search import BeamSearch

# A toy model: the top log-probabilities after each prefix (token 0 is the end of the sequence).
TABLE = {(5,): {1: -0.1, 2: -0.7, 0: -2.0, 3: -3.0},
         (5, 1): {0: -0.4, 2: -3.0, 1: -4.0, 3: -5.0},
         (5, 2): {3: -0.2, 1: -2.0, 0: -3.0, 2: -4.0}}


def _search(**kw) -> list[tuple[list[int], float, str]]:
    search = BeamSearch([[5]], BeamSearchParams(beam_width=2, max_tokens=2, **kw), eos_token_id=0)
    while not search.done:
        search.advance([TABLE.get(tuple(p), {9: -9.0}) for p in search.step_prompts()])
    return [(s.tokens, round(s.cum_logprob, 6), s.finish_reason) for s in search.results()[0].sequences]


def test_the_algorithm_on_a_worked_example():
    """Step 1 keeps [5,1] and [5,2] and sets [5] aside (the end token, -2.0); step 2 sets [5,1] (-0.5)
    and [5,2] (-3.7) aside and keeps [5,2,3] (-0.9) and [5,2,1] (-2.7). Ranked by cum / length, the
    length counting the prompt as vLLM's: [5,1] at -0.25, then [5,2,3] at -0.3 (counting the generated
    tokens alone would put [5,2,3] first: -0.45 against -0.5)."""
    assert _search() == [([5, 1], -0.5, "stop"), ([5, 2, 3], -0.9, "length")]
    # the end token kept in the tokens does not count in the length
    assert _search(include_stop_str_in_output=True) == [([5, 1, 0], -0.5, "stop"), ([5, 2, 3], -0.9, "length")]
    # length_penalty 0 ranks by the cumulative log-probability alone; 2 favours the longer beam
    assert _search(length_penalty=0.0) == [([5, 1], -0.5, "stop"), ([5, 2, 3], -0.9, "length")]
    assert _search(length_penalty=2.0) == [([5, 2, 3], -0.9, "length"), ([5, 1], -0.5, "stop")]
    # ignore_eos: the end token is a token like any other, and beams run to max_tokens
    assert _search(ignore_eos=True) == [([5, 1, 0], -0.5, "length"), ([5, 2, 3], -0.9, "length")]


@pytest.fixture(scope="module")
def offline(smol_llm):
    """LLM.beam_search on two prompts, 3 beams, 10 tokens, the end token ignored (so that transformers'
    beam search, which ends beams its own way, does the same search)."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    return prompts, smol_llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True))


def test_llm_beam_search_matches_transformers(smol_llm, hf_smol, offline):
    """The same sequences, in the same order, as transformers' `generate(num_beams=3)`; each one's
    cumulative log-probability is transformers' float64 sum over its tokens within 1e-3."""
    prompts, outs = offline
    hf_smol.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outs):
        ids = smol_llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        with torch.no_grad():
            ref = hf_smol.generate(torch.tensor([ids]), num_beams=3, num_return_sequences=3, do_sample=False,
                                   max_new_tokens=10, length_penalty=1.0, early_stopping=False, pad_token_id=0)
        assert [s.tokens for s in out.sequences] == ref.tolist()
        for seq in out.sequences:
            with torch.no_grad():
                logits = hf_smol(torch.tensor([seq.tokens])).logits[0].double()
            lp = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1, len(seq.tokens) - 1),
                                               torch.tensor(seq.tokens[len(ids):])]
            assert abs(seq.cum_logprob - lp.sum().item()) < 1e-3
            assert seq.text == smol_llm.tokenizer.decode(seq.tokens) and seq.finish_reason == "length"
            # vLLM's form: each step's alternatives as Logprob(logprob, rank, decoded_token), the beam's among them
            chosen = [e[t] for e, t in zip(seq.logprobs, seq.tokens[len(ids):])]
            assert abs(sum(c.logprob for c in chosen) - seq.cum_logprob) < 1e-4
            assert all(c.rank >= 1 and c.decoded_token == smol_llm.engine.token_text(t)
                       for c, t in zip(chosen, seq.tokens[len(ids):]))
            assert all([v.rank for v in e.values()] == list(range(1, len(e) + 1)) for e in seq.logprobs)
    assert smol_llm.engine.kv.num_free_pages == smol_llm.engine.kv.num_usable_pages


def test_llm_beam_search_refuses_what_it_cannot_run(smol_llm):
    from infire_jax.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="beam_width must be an integer in \\[1, 10\\]"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="exceed max_model_len=1024"):
        smol_llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=1024))


# ---- over HTTP (the module's last tests: the server owns the engine from here on) -------------------
def test_completions_use_beam_search_returns_the_offline_beams(smol_server, offline):
    """Both prompts' 3 beams as 6 choices (prompt by prompt, best first): their text is the offline
    beams' generated tokens decoded, their logprobs sum to the beams' scores; streamed, the same."""
    import openai

    prompts, outs = offline
    client = openai.OpenAI(base_url=smol_server + "/v1", api_key="none", max_retries=0, timeout=300)
    extra = {"use_beam_search": True, "ignore_eos": True}
    r = client.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=10, logprobs=2, extra_body=extra)
    tok = _tokenizer()
    lens = [len(tok.encode(p) if isinstance(p, str) else p) for p in prompts]
    want = [(tok.decode(s.tokens[n:]), s.cum_logprob) for n, out in zip(lens, outs) for s in out.sequences]
    got = sorted(r.choices, key=lambda c: c.index)
    assert [c.text for c in got] == [text for text, _ in want]
    for c, (_, score) in zip(got, want):
        assert c.finish_reason == "length" and len(c.logprobs.tokens) == 10
        assert np.isclose(sum(c.logprobs.token_logprobs), score, atol=1e-4)
    assert r.usage.completion_tokens == 60
    texts: dict[int, str] = {}
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, n=3, max_tokens=10, stream=True,
                                            stream_options=options, extra_body=extra))
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (lens[c.index // 3], 10)
    assert [texts[i] for i in range(6)] == [c.text for c in got]
    assert chunks[-1].usage.completion_tokens == 60


def test_completions_beam_logprobs_cover_the_returned_tokens(smol_server):
    """A beam that ends at EOS leaves the EOS token out, and its logprobs entry with it; each token
    lists `logprobs` alternatives and itself, not the search's 2 x beam width."""
    import openai

    client = openai.OpenAI(base_url=smol_server + "/v1", api_key="none", max_retries=0, timeout=300)
    r = client.completions.create(model=MODEL, prompt="The capital of France is", n=2, max_tokens=6, logprobs=1,
                                  extra_body={"use_beam_search": True})
    assert "stop" in [c.finish_reason for c in r.choices]  # a beam ended at EOS
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert 1 <= len(top) <= 2 and top[token] == logprob


def _tokenizer():
    from infire_jax.loaders.gguf import PlainGGUFReader, read_metadata
    from infire_jax.loaders.paths import default_model_path
    from infire_jax.loaders.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(read_metadata(PlainGGUFReader(default_model_path())))


def test_chat_use_beam_search_and_its_refusals(smol_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name a fruit."}],
            "use_beam_search": True, "n": 2, "max_tokens": 8, "length_penalty": 0.5}
    status, r = post_json(smol_server, "/v1/chat/completions", body)
    assert status == 200, r
    assert len(r["choices"]) == 2 and all(c["message"]["content"] for c in r["choices"])
    for extra, param in ((dict(stop=["."]), "stop"), (dict(n=11), "n"), (dict(logit_bias={"5": 1}), "logit_bias"),
                         (dict(response_format={"type": "json_object"}), "response_format"),
                         (dict(length_penalty="long"), "length_penalty"), (dict(max_tokens=2000), "max_tokens")):
        status, r = post_json(smol_server, "/v1/chat/completions", {**body, **extra})
        assert status == 400 and r["error"]["param"] == param, (extra, r)
    status, r = post_json(smol_server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "use_beam_search": True,
                                                         "echo": True})
    assert status == 400 and r["error"]["param"] == "echo"
    status, _ = post_json(smol_server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert status == 200  # still serving
