"""`/v1/completions` with `echo` and `logprobs` (prompt logprobs, OpenAI's legacy layout), `max_tokens`
0 with echo, vLLM's tokenizer endpoints, and the 400s, on the server's app over the shared small
engine (float32). Prompt values are checked against HF transformers on the same weights."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import torch

from server_utils import MODEL
from server_utils import post_json as post

TEXT = ("The licenses for most software and other practical works are designed to take away your freedom "
        "to share and change the works.")
OTHER = "By contrast, the GNU General Public License is intended to guarantee your freedom."


def streamed(url: str, body: dict) -> list[dict]:
    req = urllib.request.Request(url + "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def completion(url: str, **body) -> dict:
    status, out = post(url, "/v1/completions", {"model": MODEL, "temperature": 0, **body})
    assert status == 200, out
    return out


@pytest.fixture(scope="module")
def tok(smol_llm):
    return smol_llm.tokenizer


def check_layout(choice: dict, prompt_ids: list[int], tok, num_generated: int, k: int) -> None:
    """tokens, nulls, text offsets and the top alternatives of one echoed choice."""
    lp = choice["logprobs"]
    n = len(prompt_ids) + num_generated
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    single = [tok.decode([t], skip_special_tokens=False) for t in prompt_ids]
    assert lp["tokens"][:len(prompt_ids)] == single
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert lp["text_offset"] == [sum(len(s) for s in lp["tokens"][:i]) for i in range(n)]
    for i in range(1, n):
        top = lp["top_logprobs"][i]
        assert k <= len(top) <= k + 1 and lp["tokens"][i] in top  # the top k, and the token itself
        assert top[lp["tokens"][i]] == lp["token_logprobs"][i]
        assert max(top.values()) >= lp["token_logprobs"][i]
    assert choice["text"] == tok.decode(prompt_ids) + "".join(lp["tokens"][len(prompt_ids):])


def test_echo_logprobs_of_a_string_prompt_match_hf(smol_server, tok, hf_smol):
    out = completion(smol_server, prompt=TEXT, echo=True, logprobs=3, max_tokens=2)
    ids = tok.encode(TEXT)
    (choice,) = out["choices"]
    check_layout(choice, ids, tok, 2, 3)
    with torch.no_grad():
        ref = torch.log_softmax(hf_smol(torch.tensor([ids])).logits[0].double(), dim=-1).numpy()
    got = choice["logprobs"]["token_logprobs"]
    np.testing.assert_allclose(got[1:len(ids)], ref[np.arange(len(ids) - 1), ids[1:]], atol=1e-4, rtol=0)
    first = choice["logprobs"]["tokens"][len(ids)]  # the greedy continuation, its logprob HF's maximum
    assert first == tok.decode([int(ref[-1].argmax())], skip_special_tokens=False)
    assert abs(got[len(ids)] - ref[-1].max()) < 1e-4
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 2, "total_tokens": len(ids) + 2,
                            "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("form", ["strings", "ids", "lists of ids"])
def test_every_prompt_form_echoes_its_logprobs(smol_server, tok, form):
    """Several prompts in one request: each choice covers its own prompt; token ids give the values
    their text gives."""
    ids = [tok.encode(TEXT), tok.encode(OTHER)]
    prompt = {"strings": [TEXT, OTHER], "ids": ids[0], "lists of ids": ids}[form]
    out = completion(smol_server, prompt=prompt, echo=True, logprobs=1, max_tokens=1)
    expected = ids[:1] if form == "ids" else ids
    assert [c["index"] for c in out["choices"]] == list(range(len(expected)))
    reference = completion(smol_server, prompt=TEXT, echo=True, logprobs=1, max_tokens=1)["choices"][0]
    for choice, prompt_ids in zip(out["choices"], expected):
        check_layout(choice, prompt_ids, tok, 1, 1)
    np.testing.assert_allclose(out["choices"][0]["logprobs"]["token_logprobs"][1:],
                               reference["logprobs"]["token_logprobs"][1:], atol=1e-6)
    assert out["usage"]["prompt_tokens"] == sum(map(len, expected))
    assert out["usage"]["completion_tokens"] == len(expected)


def test_max_tokens_0_scores_the_prompt_alone(smol_server, tok):
    ids = tok.encode(OTHER)
    out = completion(smol_server, prompt=[OTHER, TEXT], echo=True, logprobs=0, max_tokens=0)
    for choice, text in zip(out["choices"], (OTHER, TEXT)):
        check_layout(choice, tok.encode(text), tok, 0, 0)
        assert choice["text"] == text and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0
    assert out["usage"]["prompt_tokens"] == len(ids) + len(tok.encode(TEXT))
    plain = completion(smol_server, prompt=OTHER, echo=True, max_tokens=0)["choices"][0]  # echo alone
    assert plain["text"] == OTHER and plain["logprobs"] is None
    one = completion(smol_server, prompt=ids[:1], echo=True, logprobs=2, max_tokens=0)["choices"][0]
    assert one["logprobs"]["token_logprobs"] == [None] and one["logprobs"]["top_logprobs"] == [None]


def test_n_samples_each_echo_the_prompt(smol_server, tok):
    out = completion(smol_server, prompt=TEXT, echo=True, logprobs=2, max_tokens=3, n=2, temperature=1.0, seed=7,
                     ignore_eos=True)
    ids = tok.encode(TEXT)
    assert len(out["choices"]) == 2
    for c in out["choices"]:
        check_layout(c, ids, tok, 3, 2)
    a, b = (c["logprobs"]["token_logprobs"][:len(ids)] for c in out["choices"])
    np.testing.assert_allclose(a[1:], b[1:], atol=1e-6)


def test_streamed_echo_carries_the_prompt_in_the_first_chunk(smol_server, tok):
    body = {"model": MODEL, "prompt": [TEXT, OTHER], "echo": True, "logprobs": 2, "max_tokens": 4, "temperature": 0,
            "stream_options": {"include_usage": True}}
    whole = completion(smol_server, **{k: v for k, v in body.items() if k != "stream_options"})
    chunks = streamed(smol_server, body)
    for index, choice in enumerate(whole["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert mine[0]["text"].startswith([TEXT, OTHER][index])
        assert len(mine[0]["logprobs"]["tokens"]) > len(tok.encode([TEXT, OTHER][index]))
        assert "".join(c["text"] for c in mine) == choice["text"]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for c in mine for x in c["logprobs"][key]] == choice["logprobs"][key]
    assert chunks[-1]["usage"] == whole["usage"]


def test_prompt_logprobs_field_matches_hf(smol_server, tok, hf_smol):
    """vLLM's `prompt_logprobs` field: a list per choice (completions) or per response (chat), null for
    the first token, then {token id: {logprob, rank, decoded_token}} for the prompt token and the top k,
    the values HF's; with echo it keeps echo's own k in `logprobs`."""
    ids = tok.encode(TEXT)
    with torch.no_grad():
        ref = torch.log_softmax(hf_smol(torch.tensor([ids])).logits[0].double(), dim=-1).numpy()
    out = completion(smol_server, prompt=TEXT, prompt_logprobs=2, max_tokens=1)
    (choice,) = out["choices"]
    assert choice["logprobs"] is None and not choice["text"].startswith(TEXT)
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for i, entry in enumerate(entries[1:]):
        row = ref[i]
        own = entry[str(ids[i + 1])]
        assert abs(own["logprob"] - row[ids[i + 1]]) < 1e-4 and own["decoded_token"] == tok.decode([ids[i + 1]])
        best = sorted(entry.items(), key=lambda kv: kv[1]["rank"])
        assert 2 <= len(entry) <= 3 and [e["rank"] for _, e in best[:2]] == [1, 2]
        np.testing.assert_allclose([e["logprob"] for _, e in best[:2]], np.sort(row)[::-1][:2], atol=1e-4)
        gap = np.abs(row - row[ids[i + 1]])
        if np.sort(gap)[1] > 1e-3:  # no near-tie with the prompt token: its rank is HF's
            assert own["rank"] == 1 + int((row > row[ids[i + 1]]).sum())
    both = completion(smol_server, prompt=TEXT, prompt_logprobs=3, echo=True, logprobs=1, max_tokens=1)["choices"][0]
    check_layout(both, ids, tok, 1, 1)  # echo's alternatives stay 1 (and the token)
    assert all(3 <= len(e) <= 4 for e in both["prompt_logprobs"][1:])
    status, chat = post(smol_server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "prompt_logprobs": 0,
                                                              "messages": [{"role": "user", "content": TEXT}]})
    assert status == 200 and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in completion(smol_server, prompt=TEXT, max_tokens=1)["choices"][0]


def test_bad_echo_requests_get_400s(smol_server, smol_llm):
    cases = [("/v1/completions", {"prompt": TEXT, "echo": True, "logprobs": 21}, "logprobs"),
             ("/v1/completions", {"prompt": TEXT, "max_tokens": 0}, "max_tokens"),
             ("/v1/completions", {"prompt": TEXT, "max_tokens": 0, "logprobs": 1}, "max_tokens"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": 1}, "echo"),
             ("/v1/completions", {"prompt": TEXT, "prompt_logprobs": 21}, "prompt_logprobs"),
             ("/v1/completions", {"prompt": TEXT, "prompt_logprobs": -1}, "prompt_logprobs"),
             ("/v1/completions", {"prompt": TEXT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1,
                                       "stream": True}, "prompt_logprobs")]
    for path, body, param in cases:
        status, out = post(smol_server, path, {"model": MODEL, **body})
        assert status == 400 and out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error"
    limit = smol_llm.engine.config.max_prompt_logprobs
    smol_llm.engine.config.max_prompt_logprobs = 3  # as --max-prompt-logprobs 3 would set it
    try:
        status, out = post(smol_server, "/v1/completions", {"model": MODEL, "prompt": TEXT, "echo": True,
                                                            "logprobs": 4})
        ok, _ = post(smol_server, "/v1/completions", {"model": MODEL, "prompt": TEXT, "echo": True, "logprobs": 3})
        _, field = post(smol_server, "/v1/completions", {"model": MODEL, "prompt": TEXT, "prompt_logprobs": 4})
    finally:
        smol_llm.engine.config.max_prompt_logprobs = limit
    assert status == 400 and out["error"]["param"] == "logprobs" and "--max-prompt-logprobs" in out["error"]["message"]
    assert ok == 200 and field["error"]["param"] == "prompt_logprobs"


def _answer(out: dict) -> list:
    """What a response says, without its ids and times: texts, messages' contents or embeddings."""
    if "data" in out:
        return [d["embedding"] for d in out["data"]]
    if "output" in out:  # the Responses API
        return [c["text"] for item in out["output"] for c in item.get("content", [])]
    return [c["text"] if "text" in c else c["message"]["content"] for c in out["choices"]]


def test_a_body_without_a_model_asks_for_the_served_model(smol_server):
    """As on vLLM: a body without `model`, or with an empty one, asks for the served model; the answer is
    the one naming it gets, and names it. A `model` that is not a string is still a 400."""
    chat = [{"role": "user", "content": "Name a colour."}]
    for path, body in [("/v1/completions", {"prompt": TEXT, "max_tokens": 6, "temperature": 0}),
                       ("/v1/chat/completions", {"messages": chat, "max_tokens": 6, "temperature": 0}),
                       ("/v1/responses", {"input": "Name a colour.", "max_output_tokens": 6, "temperature": 0}),
                       ("/v1/embeddings", {"input": TEXT}), ("/score", {"text_1": TEXT, "text_2": OTHER})]:
        status, want = post(smol_server, path, {"model": MODEL, **body})
        assert status == 200 and want["model"] == MODEL, (path, want)
        for unnamed in ({}, {"model": ""}):
            status, got = post(smol_server, path, {**body, **unnamed})
            assert status == 200 and got["model"] == MODEL, (path, unnamed, got)
            assert (_answer(got) if path != "/score" else got["data"]) == \
                (_answer(want) if path != "/score" else want["data"]), path
        status, out = post(smol_server, path, {**body, "model": 7})
        assert status == 400 and out["error"]["param"] == "model", (path, out)


def test_tokenizer_endpoints(smol_server, tok):
    status, out = post(smol_server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False})
    assert status == 200 and out["tokens"] == tok.encode(TEXT, add_special_tokens=False)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 1024
    special = tok.token_to_id(tok.bos_token)
    status, back = post(smol_server, "/detokenize", {"model": MODEL, "tokens": [special] + out["tokens"]})
    assert status == 200 and back["prompt"] == tok.bos_token + TEXT  # as given: special tokens kept
    with urllib.request.urlopen(smol_server + "/tokenizer_info", timeout=30) as r:
        info = json.load(r)
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    status, out = post(smol_server, "/tokenize", {"prompt": TEXT, "return_token_strs": True})
    assert status == 200 and out["token_strs"] == [tok.tk.id_to_token(i) for i in tok.encode(TEXT)]
    for path, body, param in [("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"text": "hi"}, "text"),
                              ("/detokenize", {"tokens": [10 ** 7]}, "tokens"),
                              ("/tokenize", {"prompt": "hi", "return_token_strs": 1}, "return_token_strs")]:
        status, out = post(smol_server, path, body)
        assert status == 400 and out["error"]["param"] == param
    status, out = post(smol_server, "/tokenize", {"model": "gpt-4o", "prompt": "hi"})  # as on /v1
    assert (status, out["error"]["code"], out["error"]["param"]) == (404, "model_not_found", "model")
    # vLLM's chat form: the messages as the chat endpoint renders them, so the count is its prompt_tokens
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    status, out = post(smol_server, "/tokenize", {"model": MODEL, "messages": messages})
    want = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)
    assert status == 200 and out["tokens"] == want, out
    status, chat = post(smol_server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1})
    assert status == 200 and chat["usage"]["prompt_tokens"] == out["count"]
    status, chat = post(smol_server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1,
                                                              "add_special_tokens": True})  # vLLM's; no BOS here
    assert status == 200 and chat["usage"]["prompt_tokens"] == out["count"]
    status, bare = post(smol_server, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert status == 200 and bare["tokens"] == want[:len(bare["tokens"])] and bare["count"] < out["count"]
    for body, param in [({"prompt": "hi", "messages": messages}, "prompt"), ({"prompt": "hi", "tools": []}, "tools"),
                        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role")]:
        status, err = post(smol_server, "/tokenize", body)
        assert status == 400 and err["error"]["param"] == param, err
