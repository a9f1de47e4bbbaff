"""`POST /v1/embeddings`, `/score` and `/rerank` on the server's app over the shared small engine
(runner="pooling"): OpenAI's response for every input form and vLLM's chat form, base64 in each
dtype and byte order, vLLM's truncation, scores and rerank order, all against HF transformers on the
same weights; and the 400s, after which the server still answers and holds nothing."""

from __future__ import annotations

import base64

import ml_dtypes
import numpy as np
import pytest
import torch

from server_utils import MODEL, post_json

TEXT = "The licenses for most software are designed to take away your freedom to share and change the works."


def post(url: str, body: dict) -> tuple[int, dict]:
    return post_json(url, "/v1/embeddings", body)


@pytest.fixture(scope="module")
def tok(smol_llm):
    return smol_llm.tokenizer


def hf_last(hf_smol, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        h = hf_smol.model(torch.tensor([ids])).last_hidden_state[0, -1].double().numpy()
    return h / np.linalg.norm(h)


def test_embeddings_of_every_input_form(smol_server, hf_smol, tok):
    ids = tok.encode("Token ids are an input too.")
    status, out = post(smol_server, {"model": MODEL, "input": [TEXT, ids, "Hi"]})
    assert status == 200, out
    assert out["object"] == "list" and out["model"] == MODEL and out["id"].startswith("embd-")
    prompts = [tok.encode(TEXT), ids, tok.encode("Hi")]
    assert [d["index"] for d in out["data"]] == [0, 1, 2] and {d["object"] for d in out["data"]} == {"embedding"}
    for d, p in zip(out["data"], prompts):
        np.testing.assert_allclose(d["embedding"], hf_last(hf_smol, p), atol=2e-6)
    n = sum(map(len, prompts))
    assert out["usage"] == {"prompt_tokens": n, "total_tokens": n}
    status, one = post(smol_server, {"model": MODEL, "input": ids, "encoding_format": "base64"})
    assert status == 200, one
    decoded = np.frombuffer(base64.b64decode(one["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(decoded, np.asarray(out["data"][1]["embedding"], np.float32))
    want = np.asarray(out["data"][1]["embedding"], np.float32)
    for dtype, order, read in (("float16", "big", ">f2"), ("bfloat16", "little", ml_dtypes.bfloat16),
                               ("float32", "native", "=f4")):
        status, got = post(smol_server, {"model": MODEL, "input": ids, "encoding_format": "base64",
                                         "embed_dtype": dtype, "endianness": order})
        assert status == 200, got
        values = np.frombuffer(base64.b64decode(got["data"][0]["embedding"]), read)
        np.testing.assert_array_equal(values, want.astype(read))


def test_vllm_fields(smol_server, hf_smol, tok):
    """truncate_prompt_tokens keeps an input's last k tokens; use_activation=false gives the raw state;
    dimensions equal to the hidden size is the whole embedding."""
    full = tok.encode(TEXT)
    status, out = post(smol_server, {"model": MODEL, "input": TEXT, "truncate_prompt_tokens": 7,
                                     "dimensions": 576, "priority": -1})
    assert status == 200, out
    np.testing.assert_allclose(out["data"][0]["embedding"], hf_last(hf_smol, full[-7:]), atol=2e-6)
    assert out["usage"]["prompt_tokens"] == 7
    status, raw = post(smol_server, {"model": MODEL, "input": "Hi", "use_activation": False})
    with torch.no_grad():
        want = hf_smol.model(torch.tensor([tok.encode("Hi")])).last_hidden_state[0, -1].numpy()
    np.testing.assert_allclose(raw["data"][0]["embedding"], want, rtol=1e-5, atol=1e-4)


def test_chat_form(smol_server, hf_smol, tok):
    """vLLM's chat form: the conversation through the chat template (no generation prompt unless
    asked), its special tokens the template's own."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    for flags in ({}, {"add_generation_prompt": True}):
        status, out = post(smol_server, {"model": MODEL, "messages": messages, **flags})
        assert status == 200, out
        text = tok.apply_chat_template(messages, add_generation_prompt=bool(flags))
        ids = tok.encode(text, add_special_tokens=False)
        assert out["usage"]["prompt_tokens"] == len(ids) and len(out["data"]) == 1
        np.testing.assert_allclose(out["data"][0]["embedding"], hf_last(hf_smol, ids), atol=2e-6)
    other = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    status, out = post(smol_server, {"model": MODEL, "messages": [messages, other]})  # the batched form
    assert status == 200 and [d["index"] for d in out["data"]] == [0, 1]
    for d, conversation in zip(out["data"], (messages, other)):
        ids = tok.encode(tok.apply_chat_template(conversation, add_generation_prompt=False), add_special_tokens=False)
        np.testing.assert_allclose(d["embedding"], hf_last(hf_smol, ids), atol=2e-6)


DOCS = ["Paris is the capital and largest city of France.", "Bananas are a yellow fruit.",
        "France's capital city is Paris."]


def test_score_and_rerank(smol_server, hf_smol, tok):
    """vLLM's /score and /rerank: cosine similarities of HF's last-token embeddings."""
    query = "What is the capital of France?"
    want = [float(hf_last(hf_smol, tok.encode(query)) @ hf_last(hf_smol, tok.encode(d))) for d in DOCS]
    tokens = len(tok.encode(query)) + sum(len(tok.encode(d)) for d in DOCS)
    for path, sides in (("/score", ("text_1", "text_2")), ("/v1/score", ("queries", "documents"))):
        status, out = post_json(smol_server, path, {"model": MODEL, sides[0]: query, sides[1]: DOCS})
        assert status == 200, out
        assert [d["index"] for d in out["data"]] == [0, 1, 2] and {d["object"] for d in out["data"]} == {"score"}
        np.testing.assert_allclose([d["score"] for d in out["data"]], want, atol=2e-6)
        assert out["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    status, pair = post_json(smol_server, "/score", {"model": MODEL, "data_1": [query, DOCS[1]], "data_2": DOCS[:2]})
    assert status == 200 and len(pair["data"]) == 2
    np.testing.assert_allclose(pair["data"][0]["score"], want[0], atol=2e-6)
    order = sorted(range(3), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        status, out = post_json(smol_server, path, {"model": MODEL, "query": query, "documents": DOCS, "top_n": 2})
        assert status == 200, out
        assert [r["index"] for r in out["results"]] == order[:2]
        assert [r["document"]["text"] for r in out["results"]] == [DOCS[i] for i in order[:2]]
        np.testing.assert_allclose([r["relevance_score"] for r in out["results"]], [want[i] for i in order[:2]],
                                   atol=2e-6)
    status, out = post_json(smol_server, "/rerank", {"model": MODEL, "query": query, "documents": DOCS})
    assert status == 200 and len(out["results"]) == 3 and out["usage"]["prompt_tokens"] == tokens


@pytest.mark.parametrize("path, body, param", [
    ("/score", {"model": MODEL, "text_1": "a"}, "text_1"),
    ("/score", {"model": MODEL, "text_1": "a", "documents": ["b"]}, "text_1"),
    ("/score", {"model": MODEL, "queries": ["a", "b"], "documents": ["c"]}, "documents"),
    ("/score", {"model": MODEL, "text_1": "", "text_2": "b"}, "text_1"),
    ("/score", {"model": MODEL, "text_1": "a", "text_2": [1, 2]}, "text_2"),
    ("/score", {"model": MODEL, "text_1": "a", "text_2": "b", "instruction": "x"}, "instruction"),
    ("/rerank", {"model": MODEL, "documents": ["a"]}, "query"),
    ("/rerank", {"model": MODEL, "query": "q", "documents": []}, "documents"),
    ("/rerank", {"model": MODEL, "query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/rerank", {"model": MODEL, "query": "q", "documents": ["word " * 1100]}, "documents"),
])
def test_scoring_bad_requests(smol_server, path, body, param):
    status, out = post_json(smol_server, path, body)
    assert status == 400, out
    assert out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param, status", [
    ({"model": MODEL}, "input", 400),
    ({"model": MODEL, "input": ""}, "input", 400),
    ({"model": MODEL, "input": []}, "input", 400),
    ({"model": MODEL, "input": ["a", []]}, "input", 400),
    ({"model": MODEL, "input": [1, "a"]}, "input", 400),
    ({"model": MODEL, "input": "a", "encoding_format": "int8"}, "encoding_format", 400),
    ({"model": MODEL, "input": "a", "dimensions": 64}, "dimensions", 400),  # not a matryoshka model
    ({"model": MODEL, "input": "a", "dimensions": 0}, "dimensions", 400),
    ({"model": MODEL, "input": "a", "use_activation": "yes"}, "use_activation", 400),
    ({"model": MODEL, "input": "a", "normalize": False}, "normalize", 400),  # vLLM 0.32 removed it
    ({"model": MODEL, "input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", 400),
    ({"model": MODEL, "input": "a", "stream": True}, "stream", 400),
    ({"model": MODEL, "input": [10 ** 9]}, "input", 400),  # outside the vocabulary
    ({"model": MODEL, "input": "word " * 1100}, "input", 400),  # over max_model_len
    ({"model": MODEL, "input": "a", "messages": [{"role": "user", "content": "a"}]}, "messages", 400),
    ({"model": MODEL, "messages": []}, "messages", 400),
    ({"model": MODEL, "messages": [[]]}, "messages", 400),
    ({"model": MODEL, "input": "a", "embed_dtype": "fp8_e4m3"}, "embed_dtype", 400),
    ({"model": MODEL, "input": "a", "endianness": "middle"}, "endianness", 400),
    ({"model": MODEL, "input": "a", "add_generation_prompt": True}, "add_generation_prompt", 400),
    ({"model": MODEL, "messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": {"messages": 1}},
     "chat_template_kwargs.messages", 400),
    ({"model": "nope", "input": "a"}, "model", 404),
])
def test_bad_requests(smol_server, smol_llm, body, param, status):
    code, out = post(smol_server, body)
    assert code == status, out
    assert out["error"]["param"] == param and out["error"]["message"]
    if param == "normalize":  # vLLM 0.32's rename, named in the answer
        assert "use_activation" in out["error"]["message"]
    assert out["error"]["type"] == ("invalid_request_error" if status == 400 else out["error"]["type"])
    code, ok = post(smol_server, {"model": MODEL, "input": "still up"})
    assert code == 200 and len(ok["data"][0]["embedding"]) == 576
    e = smol_llm.engine  # the engine thread is idle between requests: nothing is held
    assert e.kv.num_free_pages == e.kv.num_usable_pages and e.num_running == e.num_waiting == 0
