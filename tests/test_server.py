"""The OpenAI-compatible server, live: two `infire-jax serve` subprocesses driven by the official client.

`main` has API keys (two tenants) and a large KV pool; `small` has no keys (tenants come from
x-tenant-id), a KV pool too small for its load (preemption) and a short queue (overload). Outputs
are compared greedily: a request under load must produce what it produces alone.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import aiohttp
import numpy as np
import openai
import pytest

from bad_requests import BAD_BODIES, BASE, CMPL, DROP
from conftest import engine_flags
from server_utils import MODEL, ServerProcess, post_json, wait_until

KEY_A, KEY_B = "sk-alpha-0123", "sk-beta-4567"
# `main` runs the suite's small engine (conftest.engine_flags): it loads the programs `smol_llm` compiled.
MAIN_ARGS = [*engine_flags(), "--api-key", f"{KEY_A}:alpha", "--api-key", f"{KEY_B}:beta", "--max-queue", "64"]
# 23 usable pages of 16 tokens; 8 running sequences + 4 queued at most; the generate runner (no embeddings).
SMALL_ARGS = [*engine_flags(max_model_len=256, num_kv_pages=24, runner="generate"), "--max-queue", "4"]
PAGE = 16
LONG_TEXT = ("The history of the printing press begins with movable type in East Asia and continues with "
             "Gutenberg's press in Mainz around 1440, which spread across Europe within a few decades. ")


@pytest.fixture(scope="module")
def servers():
    procs = [ServerProcess(MAIN_ARGS), ServerProcess(SMALL_ARGS)]  # start both, so they load in parallel
    try:
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def main(servers) -> ServerProcess:
    return servers[0]


@pytest.fixture(scope="module")
def small(servers) -> ServerProcess:
    return servers[1]


@pytest.fixture(scope="module")
def client(main):
    with openai.OpenAI(base_url=main.url + "/v1", api_key=KEY_A, max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer():
    from infire_jax.loaders.gguf import PlainGGUFReader, read_metadata
    from infire_jax.loaders.paths import default_model_path
    from infire_jax.loaders.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(read_metadata(PlainGGUFReader(default_model_path())))


def chat_ids(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def greedy(**kw) -> dict:
    return dict(model=MODEL, temperature=0, **kw)


def cached_expected(num_prompt_tokens: int) -> int:
    """Full pages of the prompt, less the page of the last token (its logits must be computed)."""
    return (num_prompt_tokens - 1) // PAGE * PAGE


# ---- basics ---------------------------------------------------------------------------------------
def test_models_health_and_auth(main, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    for path in ("/health", "/metrics", "/ping", "/version"):  # operational endpoints need no key
        with urllib.request.urlopen(main.url + path, timeout=30) as r:
            assert r.status == 200
    with urllib.request.urlopen(urllib.request.Request(main.url + "/ping", method="POST"), timeout=30) as r:
        assert json.load(r)["status"] == "ok"  # vLLM's (SageMaker's) health check, GET or POST
    with urllib.request.urlopen(main.url + "/version", timeout=30) as r:
        assert json.load(r)["version"]
    m = main.metrics()  # the gauges autoscalers read, under vLLM's names too
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert m["vllm:" + name] == m["infire:" + name]
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=main.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"


def test_kv_pool_size_and_arithmetic_in_metrics(main, small):
    """The pool's size is exported: SmolLM2's page is 2 (k, v) x 30 layers x 16 tokens x 3 kv heads x 64 x 4 bytes."""
    page = 2 * 30 * PAGE * 3 * 64 * 4
    m = small.metrics()
    assert m["infire:kv_pool_pages"] == 24 and m["infire:kv_pool_page_bytes"] == page  # --num-kv-pages 24
    assert m["infire:kv_pool_bytes"] == 24 * page
    m = main.metrics()  # no device memory figure on CPU
    assert m["infire:kv_pool_pages"] == 512 and m["infire:kv_pool_device_memory_bytes"] == 0


def test_chat_non_streaming_usage_and_session_header(client, tokenizer):
    content = "What is the capital of France? Answer in one word."
    raw = client.chat.completions.with_raw_response.create(
        messages=[{"role": "user", "content": content}], max_tokens=12, extra_headers={"x-session-affinity": "s-42"},
        **greedy())
    assert raw.headers["x-session-affinity"] == "s-42"
    r = raw.parse()
    assert r.object == "chat.completion" and r.model == MODEL and len(r.choices) == 1
    msg = r.choices[0].message
    assert msg.role == "assistant" and "Paris" in msg.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(chat_ids(tokenizer, content))
    assert 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_equals_non_streaming(client):
    kw = greedy(messages=[{"role": "user", "content": "Name three colors."}], max_completion_tokens=16)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completion_prompt_forms(client, tokenizer):
    p1, p2 = "The capital of Italy is", "Water boils at a temperature of"
    kw = greedy(max_tokens=8)
    t1 = client.completions.create(prompt=p1, **kw).choices[0].text
    t2 = client.completions.create(prompt=p2, **kw).choices[0].text
    assert t1 and t2
    ids1, ids2 = tokenizer.encode(p1), tokenizer.encode(p2)
    assert client.completions.create(prompt=ids1, **kw).choices[0].text == t1
    for prompt in ([p1, p2], [ids1, ids2]):
        r = client.completions.create(prompt=prompt, **kw)
        assert [(c.index, c.text) for c in r.choices] == [(0, t1), (1, t2)]
        assert r.usage.prompt_tokens == len(ids1) + len(ids2)
    echoed = client.completions.create(prompt=p1, echo=True, **kw).choices[0].text
    assert echoed == p1 + t1


def test_completion_streaming_n2_usage(client):
    kw = greedy(prompt="Once upon a time", max_tokens=10, n=2)
    whole = client.completions.create(**kw)
    assert [c.text for c in whole.choices] == [whole.choices[0].text] * 2  # greedy: both samples agree
    texts = {0: "", 1: ""}
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    for c in chunks[:-1]:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == {0: whole.choices[0].text, 1: whole.choices[1].text}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 20
    sampled = client.completions.create(prompt="List some random words:", max_tokens=16, n=2, temperature=1.0,
                                        seed=7, model=MODEL)
    assert sorted(c.index for c in sampled.choices) == [0, 1]
    assert sampled.choices[0].text != sampled.choices[1].text  # each sample has its own seed


def test_continuous_usage_stats(client, tokenizer):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage so far;
    the final usage chunk is the request's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    kw = greedy(prompt=["Once upon a time", "The sea is"], max_tokens=6, n=2, logprobs=0)
    chunks = list(client.completions.create(stream=True, stream_options=options, **kw))
    lens = [len(tokenizer.encode(p)) for p in kw["prompt"]]
    counts = [0] * 4
    for c in chunks[:-1]:
        i = c.choices[0].index
        counts[i] += len(c.choices[0].logprobs.tokens)  # a chunk holds the tokens of a decode burst
        assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (lens[i // 2], counts[i]), (i, c.usage)
        assert c.usage.total_tokens == lens[i // 2] + counts[i]
    assert counts == [6] * 4
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == sum(lens)
    chat = list(client.chat.completions.create(
        stream=True, stream_options=options, **greedy(messages=[{"role": "user", "content": "Hi"}], max_tokens=4)))
    prompt = len(chat_ids(tokenizer, "Hi"))
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
    assert [c.usage.prompt_tokens for c in chat] == [prompt] * len(chat)
    done = [c.usage.completion_tokens for c in chat[:-1]]
    assert done == sorted(done) and done[-1] == chat[-1].usage.completion_tokens == 4
    # without include_usage the option asks for nothing, as in vLLM
    plain = list(client.completions.create(stream=True, stream_options={"continuous_usage_stats": True},
                                           **greedy(prompt="Hi", max_tokens=2)))
    assert all(c.usage is None for c in plain)


def test_completions_take_vllms_fields(client):
    """vLLM's completions fields: response_format (as chat's), add_special_tokens, max_tokens null (the
    rest of the context, where absent is OpenAI's 16), spaces_between_special_tokens (no effect)."""
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}
    r = client.completions.create(prompt="Answer in JSON:", max_tokens=12, extra_body={"response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}, **greedy())
    assert json.loads(r.choices[0].text)["a"] in (1, 2)
    kw = greedy(prompt="The capital of France is")
    short = client.completions.create(**kw)
    assert (short.usage.completion_tokens, short.choices[0].finish_reason) == (16, "length")
    whole = client.completions.create(max_tokens=None, **kw)  # sent as null
    assert whole.choices[0].finish_reason == "stop" and whole.usage.completion_tokens > 16
    assert whole.choices[0].text.startswith(short.choices[0].text)
    same = client.completions.create(extra_body={"add_special_tokens": False, "spaces_between_special_tokens": False},
                                     **kw)
    assert same.choices[0].text == short.choices[0].text  # SmolLM2's tokenizer adds no BOS


def test_stop_strings(client):
    kw = greedy(prompt="Here is a list of fruits: apple, banana, cherry,", max_tokens=24)
    full = client.completions.create(**kw).choices[0].text
    words = full.split()
    assert len(words) >= 4, full
    stop = words[2]
    cut = full[:full.index(stop)]
    r = client.completions.create(stop=[stop, "#never#"], **kw).choices[0]
    assert (r.text, r.finish_reason, r.stop_reason) == (cut, "stop", stop)
    many = [f"#never{i}#" for i in range(7)] + [stop]  # more than OpenAI's 4, as vLLM takes them
    assert client.completions.create(stop=many, **kw).choices[0].text == cut
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, stop=stop, **kw))
    assert streamed == cut
    kept = client.completions.create(stop=stop, extra_body={"include_stop_str_in_output": True}, **kw)
    assert kept.choices[0].text == cut + stop


def test_logit_bias_over_http(client, tokenizer):
    """OpenAI's logit_bias, token ids as JSON keys, on both APIs and streamed: banning a greedy
    answer's first token changes it, and the stream equals the non-streamed answer."""
    kw = greedy(prompt="Here is a list of fruits: apple, banana, cherry,", max_tokens=8)
    plain = client.completions.create(**kw).choices[0].text
    first = tokenizer.encode(plain)[0]
    ban = {str(first): -100}
    banned = client.completions.create(logit_bias=ban, **kw).choices[0].text
    assert banned != plain and tokenizer.encode(banned)[0] != first
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, logit_bias=ban, **kw))
    assert streamed == banned
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=6, temperature=0)
    answer = client.chat.completions.create(**chat).choices[0].message.content
    ban = {str(tokenizer.encode(answer)[0]): -100}
    assert client.chat.completions.create(logit_bias=ban, **chat).choices[0].message.content != answer


def test_continue_final_message_and_add_generation_prompt(client, tokenizer):
    """vLLM's chat extensions: a prefilled answer continued from its last character (the prompt is the
    conversation's text with the generation prompt, then the prefix, and answers as that completion
    does), echoed before the answer with `echo` (whole and streamed), and a conversation rendered
    without the assistant header."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prefix = "The capital of France is"
    chat = greedy(messages=[*question, {"role": "assistant", "content": prefix}], max_tokens=5,
                  extra_body={"continue_final_message": True, "add_generation_prompt": False})
    r = client.chat.completions.create(**chat)
    text = tokenizer.apply_chat_template(question, add_generation_prompt=True) + prefix
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == client.completions.create(**greedy(prompt=ids, max_tokens=5)).choices[0].text
    echoed = client.chat.completions.create(**{**chat, "extra_body": {**chat["extra_body"], "echo": True}})
    assert echoed.choices[0].message.content == prefix + r.choices[0].message.content  # vLLM's chat echo
    stream = client.chat.completions.create(stream=True, **{**chat, "extra_body": {**chat["extra_body"], "echo": True}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == echoed.choices[0].message.content
    plain = client.chat.completions.create(**greedy(messages=question, max_tokens=5, extra_body={"echo": True}))
    assert not plain.choices[0].message.content.startswith(question[0]["content"])  # only an assistant's is echoed
    bare = client.chat.completions.create(**greedy(messages=question, max_tokens=2,
                                                   extra_body={"add_generation_prompt": False}))
    without = tokenizer.apply_chat_template(question, add_generation_prompt=False)
    assert bare.usage.prompt_tokens == len(tokenizer.encode(without, add_special_tokens=False)) < len(ids) - 5


def test_open_final_message_cuts_after_the_content():
    """Where the template keeps a message's trailing whitespace, the cut keeps it; where it trims it, the
    cut follows the trimmed text; text it does not write is refused."""
    from infire_jax.errors import InvalidRequestError
    from infire_jax.loaders.tokenizer import open_final_message

    assert open_final_message("<u>hi</u><a>Sure, </a>", "Sure, ") == "<u>hi</u><a>Sure, "
    assert open_final_message("<u>hi</u><a>Sure,</a>", "  Sure, ") == "<u>hi</u><a>Sure,"
    assert open_final_message("<a>yes</a><a>yes</a>", "yes") == "<a>yes</a><a>yes"  # the last occurrence
    with pytest.raises(InvalidRequestError):
        open_final_message("<u>hi</u><a>SURE</a>", "Sure")


def test_truncate_prompt_tokens(client, tokenizer):
    """vLLM's truncate_prompt_tokens keeps a prompt's last k tokens, on both APIs: the same answer as
    those tokens sent as the prompt; echo returns the kept part; -1 keeps a prompt that fits."""
    ids = tokenizer.encode(LONG_TEXT)
    kw = greedy(max_tokens=4)
    cut = client.completions.create(prompt=LONG_TEXT, extra_body={"truncate_prompt_tokens": 12}, **kw)
    assert cut.usage.prompt_tokens == 12
    assert cut.choices[0].text == client.completions.create(prompt=ids[-12:], **kw).choices[0].text
    echoed = client.completions.create(prompt=LONG_TEXT, echo=True, extra_body={"truncate_prompt_tokens": 12}, **kw)
    assert echoed.choices[0].text == tokenizer.decode(ids[-12:]) + cut.choices[0].text
    whole = client.completions.create(prompt=LONG_TEXT, extra_body={"truncate_prompt_tokens": -1}, **kw)
    assert whole.usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": LONG_TEXT}],
                                          extra_body={"truncate_prompt_tokens": 20}, **kw)
    text = tokenizer.apply_chat_template([{"role": "user", "content": LONG_TEXT}], add_generation_prompt=True)
    tail = tokenizer.encode(text, add_special_tokens=False)[-20:]
    assert chat.usage.prompt_tokens == 20
    assert chat.choices[0].message.content == client.completions.create(prompt=tail, **kw).choices[0].text


def test_return_tokens_as_token_ids(client, tokenizer):
    """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:{id}" (the ids the text
    decodes from), with the same values and text offsets; chat's bytes are the name's."""
    kw = greedy(prompt="The capital of France is", max_tokens=6, logprobs=2)
    plain = client.completions.create(**kw).choices[0]
    named = client.completions.create(extra_body={"return_tokens_as_token_ids": True}, **kw).choices[0]
    assert named.text == plain.text
    ids = [int(t.removeprefix("token_id:")) for t in named.logprobs.tokens]
    assert all(t.startswith("token_id:") for t in named.logprobs.tokens)
    assert tokenizer.decode(ids) == plain.text
    assert named.logprobs.token_logprobs == plain.logprobs.token_logprobs
    assert named.logprobs.text_offset == plain.logprobs.text_offset
    for top, plain_top in zip(named.logprobs.top_logprobs, plain.logprobs.top_logprobs):
        assert sorted(top.values()) == sorted(plain_top.values())
        assert all(k.startswith("token_id:") for k in top)
    chat = greedy(messages=[{"role": "user", "content": "Say hello."}], max_tokens=4, logprobs=True, top_logprobs=2,
                  extra_body={"return_tokens_as_token_ids": True})
    r = client.chat.completions.create(**chat)
    content = r.choices[0].logprobs.content
    assert tokenizer.decode([int(t.token.removeprefix("token_id:")) for t in content]) == r.choices[0].message.content
    for t in content:
        assert bytes(t.bytes).decode() == t.token and t.top_logprobs[0].token == t.token


def test_bad_words_over_http(client):
    """vLLM's bad_words on both APIs: the greedy answer's word is never written, streamed the same."""
    kw = greedy(prompt="The capital of France is Paris. The capital of Germany is", max_tokens=8)
    assert "Berlin" in client.completions.create(**kw).choices[0].text
    banned = client.completions.create(extra_body={"bad_words": ["Berlin"]}, **kw).choices[0].text
    assert "Berlin" not in banned
    stream = client.completions.create(stream=True, extra_body={"bad_words": ["Berlin"]}, **kw)
    assert "".join(c.choices[0].text for c in stream) == banned
    chat = greedy(messages=[{"role": "user", "content": "What is the capital of Germany?"}], max_tokens=12)
    assert "Berlin" in client.chat.completions.create(**chat).choices[0].message.content
    answer = client.chat.completions.create(extra_body={"bad_words": ["Berlin"]}, **chat).choices[0].message.content
    assert "Berlin" not in answer


def test_seed_reproducibility(main, client):
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=16, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    assert client.completions.create(seed=1234, **kw).choices[0].text == a
    assert client.completions.create(seed=4321, **kw).choices[0].text != a

    async def under_load() -> str:  # the same seed gives the same sample inside a busy batch
        async with openai.AsyncOpenAI(base_url=main.url + "/v1", api_key=KEY_A, max_retries=0) as ac:
            others = [ac.completions.create(model=MODEL, prompt=f"Count to {i}:", max_tokens=16, temperature=1.0)
                      for i in range(6)]
            results = await asyncio.gather(ac.completions.create(seed=1234, **kw), *others)
            return results[0].choices[0].text

    assert asyncio.run(under_load()) == a


def test_logprobs(client):
    r = client.completions.create(prompt="The capital of France is", max_tokens=6, logprobs=3, **greedy())
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and logprob <= 0
        assert top[tok] == logprob == max(top.values())  # greedy picks the most likely token

    kw = greedy(messages=[{"role": "user", "content": "Say hello."}], max_tokens=6, logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == t.logprob >= t.top_logprobs[1].logprob
        assert bytes(t.bytes).decode() == t.token
    streamed = [t for ch in client.chat.completions.create(stream=True, **kw) if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    # The repeat reuses cached prefix pages, so its prefill runs in other shapes: equal up to rounding.
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-3)
    no_top = client.chat.completions.create(**{**kw, "top_logprobs": None})
    assert all(t.top_logprobs == [] for t in no_top.choices[0].logprobs.content)


# ---- prefix cache, tenants, retention ---------------------------------------------------------------
def test_cached_tokens_and_api_key_tenants(main, tokenizer):
    prompt = "[cache test] " + LONG_TEXT * 3
    n = len(tokenizer.encode(prompt))
    assert n > 3 * PAGE

    def cached(key: str, headers: dict | None = None) -> int:
        c = openai.OpenAI(base_url=main.url + "/v1", api_key=key, max_retries=0)
        r = c.completions.create(prompt=prompt, max_tokens=2, extra_headers=headers, **greedy())
        assert r.usage.prompt_tokens == n
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(KEY_A) == 0
    assert cached(KEY_A) == cached_expected(n)  # a tenant's repeat hits its own pages
    assert cached(KEY_B) == 0  # the other tenant's first request never sees them
    assert cached(KEY_B) == cached_expected(n)
    assert cached(KEY_A, {"x-tenant-id": "beta"}) == cached_expected(n)  # with keys, the header cannot pick a tenant


def test_header_tenants(small, tokenizer):
    prompt = "[tenant test] " + LONG_TEXT * 2
    n = len(tokenizer.encode(prompt))
    c = openai.OpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0)

    def cached(tenant: str | None) -> int:
        headers = {"x-tenant-id": tenant} if tenant else None
        r = c.completions.create(prompt=prompt, max_tokens=2, extra_headers=headers, **greedy())
        return r.usage.prompt_tokens_details.cached_tokens

    assert [cached("t1"), cached("t2"), cached(None), cached("t2"), cached("t1"), cached(None)] == \
        [0, 0, 0] + [cached_expected(n)] * 3

    def salted(salt: str | None, tenant: str | None = None, path: str = "completions") -> int:
        headers = {"x-tenant-id": tenant} if tenant else None
        if path == "chat":
            r = c.chat.completions.create(messages=[{"role": "user", "content": prompt}], max_tokens=2,
                                          extra_body={"cache_salt": salt}, extra_headers=headers, **greedy())
        else:
            r = c.completions.create(prompt=prompt, max_tokens=2, extra_body={"cache_salt": salt},
                                     extra_headers=headers, **greedy())
        return r.usage.prompt_tokens_details.cached_tokens

    # vLLM's cache_salt separates prefixes as a tenant does, within a tenant too
    assert [salted("s1"), salted("s2"), salted("s1"), salted("s1", "t1"), salted("s2")] == \
        [0, 0, cached_expected(n), 0, cached_expected(n)]
    assert salted("s3", path="chat") == 0 and salted("s3", path="chat") > 0
    status, body = post_json(small.url, "/v1/completions", {"model": MODEL, "prompt": "hi", "cache_salt": ""})
    assert status == 400 and body["error"]["param"] == "cache_salt"


# ---- load ----------------------------------------------------------------------------------------
def test_64_concurrent_streams_equal_alone(main):
    topics = ["rivers", "volcanoes", "chess", "bread", "owls", "comets", "jazz", "glaciers", "bees", "castles",
              "deserts", "robots", "tea", "whales", "bridges", "maps"]
    requests = [dict(messages=[{"role": "user", "content": f"Tell me one fact about {t}."}],
                     max_tokens=8 + i % 5 * 3, **greedy()) for i, t in enumerate(topics)]

    async def run(ac: openai.AsyncOpenAI, kw: dict) -> tuple[str, str, int]:
        text, finish, usage = "", None, None
        async for ch in await ac.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                finish = ch.choices[0].finish_reason or finish
            else:
                usage = ch.usage.completion_tokens
        return text, finish, usage

    async def probe(stop: asyncio.Event) -> float:
        """Worst /health latency while the batch runs: the device work must not block the event loop."""
        worst = 0.0
        async with aiohttp.ClientSession() as s:
            while not stop.is_set():
                t0 = time.monotonic()
                async with s.get(main.url + "/health") as r:
                    assert r.status == 200
                worst = max(worst, time.monotonic() - t0)
                await asyncio.sleep(0.2)
        return worst

    async def scenario():
        async with openai.AsyncOpenAI(base_url=main.url + "/v1", api_key=KEY_A, max_retries=0, timeout=300) as ac:
            alone = [await run(ac, kw) for kw in requests]
            stop = asyncio.Event()
            prober = asyncio.create_task(probe(stop))
            together = await asyncio.gather(*(run(ac, requests[i % len(requests)]) for i in range(64)))
            stop.set()
            return alone, together, await prober

    alone, together, worst_health = asyncio.run(scenario())
    for i, out in enumerate(together):
        assert out == alone[i % len(requests)], f"request {i} under load differs from its run alone"
    assert all(text and finish in ("stop", "length") and usage > 0 for text, finish, usage in alone)
    assert worst_health < 2.0
    wait_until(lambda: main.metrics()["infire:num_requests_running"] == 0, 30, "the batch to drain")


def test_disconnect_aborts_and_frees_pages(main):
    idle = main.metrics()
    assert idle["infire:num_requests_running"] == 0
    body = {"model": MODEL, "prompt": "Write a very long story about a dragon.", "max_tokens": 900,
            "ignore_eos": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    url = main.url + "/v1/completions"

    async def mid_stream() -> None:
        async with aiohttp.ClientSession(headers=headers) as s:
            r = await s.post(url, json={**body, "stream": True})
            assert r.status == 200
            events = 0
            async for line in r.content:
                events += line.startswith(b"data: ")
                if events == 3:
                    break
            busy = main.metrics()
            assert busy["infire:num_requests_running"] == 1
            assert busy["infire:kv_cache_usage_perc"] > idle["infire:kv_cache_usage_perc"]
            r.close()  # drop the connection with the stream unfinished

    async def before_first_byte() -> None:
        async with aiohttp.ClientSession(headers=headers) as s:
            with pytest.raises(asyncio.TimeoutError):
                async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=1.5)) as r:
                    await r.read()

    for scenario in (mid_stream, before_first_byte):
        asyncio.run(scenario())
        wait_until(lambda: (m := main.metrics())["infire:num_requests_running"] == 0
                   and m["infire:kv_cache_usage_perc"] == idle["infire:kv_cache_usage_perc"], 20,
                   f"{scenario.__name__}: the aborted request to free its pages")
    generated = main.metrics()["infire:generation_tokens_total"] - idle["infire:generation_tokens_total"]
    assert 3 <= generated < 900  # both were cut off long before max_tokens


def test_openai_client_embeddings(client):
    """The OpenAI client's embeddings call (it asks for base64 and decodes float32 itself) against the
    server's float form (the shared flags run --runner pooling)."""
    texts = ["The capital of France is Paris.", "Bananas are yellow."]
    got = client.embeddings.create(model=MODEL, input=texts)
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in got.data] == [0, 1] and got.usage.prompt_tokens == floats.usage.prompt_tokens > 0
    for a, b in zip(got.data, floats.data):
        assert len(a.embedding) == 576 and abs(np.linalg.norm(a.embedding) - 1) < 1e-5
        np.testing.assert_array_equal(np.float32(a.embedding), np.float32(b.embedding))


def test_generate_runner_refuses_embeddings(small):
    for path, body, param in (("/v1/embeddings", {"input": "a"}, "input"),
                              ("/rerank", {"query": "q", "documents": ["a"]}, "documents")):
        status, out = post_json(small.url, path, {"model": MODEL, **body})
        assert status == 400 and out["error"]["param"] == param
        assert "start it with runner='pooling'" in out["error"]["message"]


def test_embeddings_disconnect_aborts_and_frees_pages(main):
    """A client that leaves before its embeddings are done: every input is aborted and its pages freed."""
    idle = main.metrics()
    body = {"model": MODEL, "input": [f"{i}: " + "Write a very long story about a dragon. " * 60 for i in range(64)]}

    async def leave() -> None:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY_A}"}) as s:
            with pytest.raises(asyncio.TimeoutError):
                async with s.post(main.url + "/v1/embeddings", json=body,
                                  timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                    await r.read()

    asyncio.run(leave())
    assert main.metrics()["infire:prompt_tokens_total"] > idle["infire:prompt_tokens_total"]  # admitted
    # Run to the end, the 35k tokens (no shared prefix) would take minutes in this server's 64-token steps.
    wait_until(lambda: (m := main.metrics())["infire:num_requests_running"] == 0 and m["infire:num_requests_waiting"] == 0
               and m["infire:kv_cache_usage_perc"] == idle["infire:kv_cache_usage_perc"], 10,
               "the aborted embeddings to free their pages")


def test_preemption_completes_every_request(small):
    # Six sequences of 40 + 40 tokens need 30 pages; the pool has 23, so running ones get preempted.
    prompts = [f"Story {i}: " + "one two three four five six seven eight nine ten " * 3 for i in range(6)]
    kw = dict(model=MODEL, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    before = small.metrics()["infire:num_preemptions_total"]

    async def scenario():
        async with openai.AsyncOpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=300) as ac:
            alone = [await ac.completions.create(prompt=p, **kw) for p in prompts]
            assert small.metrics()["infire:num_preemptions_total"] == before  # one at a time fits
            together = await asyncio.gather(*(ac.completions.create(prompt=p, **kw) for p in prompts))
            return alone, together

    alone, together = asyncio.run(scenario())
    assert small.metrics()["infire:num_preemptions_total"] > before
    for a, t in zip(alone, together):
        assert t.choices[0].finish_reason == "length" and t.usage.completion_tokens == 40
        assert t.choices[0].text == a.choices[0].text
    wait_until(lambda: small.metrics()["infire:kv_cache_usage_perc"] == 0, 20, "the pool to be released")


def test_overload_gets_429_then_serves(small):
    url = small.url + "/v1/completions"

    async def one(s: aiohttp.ClientSession, i: int) -> tuple[int, dict]:
        body = {"model": MODEL, "prompt": f"Count from {i}:", "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                "priority": i % 3}
        async with s.post(url, json=body) as r:
            return r.status, await r.json()

    async def burst():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(one(s, i) for i in range(20)))

    results = asyncio.run(burst())
    ok = [b for status, b in results if status == 200]
    rejected = [b for status, b in results if status == 429]
    assert len(ok) + len(rejected) == 20 and len(ok) >= 12 and rejected  # capacity: 8 running + 4 queued
    assert all(b["usage"]["completion_tokens"] == 32 for b in ok)
    assert all(b["error"]["code"] == "queue_full" and b["error"]["message"] for b in rejected)
    c = openai.OpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0)
    assert c.completions.create(prompt="Hello", max_tokens=4, **greedy()).usage.completion_tokens == 4
    wait_until(lambda: small.metrics()["infire:num_requests_running"] == 0, 20, "the burst to drain")


# ---- bad input ---------------------------------------------------------------------------------------
def _is_error_object(body: dict) -> bool:
    err = body.get("error")
    return (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
            and isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str))


def test_bad_input_gets_4xx_error_objects_and_server_keeps_serving(main, small, client):
    auth = {"Authorization": f"Bearer {KEY_A}"}
    cases = []  # (server, method, path, headers, raw body, status, param)
    for path, change, status, param in BAD_BODIES:
        body = {k: v for k, v in {**BASE[path], **change}.items() if v is not DROP}
        cases.append((main, "POST", path, auth, json.dumps(body).encode(), status, param))
    plain = json.dumps(BASE[CMPL]).encode()
    cases += [
        (main, "POST", CMPL, auth, b"{not json", 400, None),
        (main, "POST", CMPL, auth, b"[1, 2]", 400, None),
        (main, "POST", CMPL, auth, b"", 400, None),
        (main, "POST", CMPL, auth, plain.replace(b'"max_tokens": 4', b'"temperature": NaN'), 400, None),
        (main, "POST", CMPL, auth, b'{"prompt": "\xff"}', 400, None),  # not UTF-8
        (main, "POST", CMPL, auth, plain.replace(b'"hi"', b'"\xed\xa0\x80"'), 400, "prompt"),  # a surrogate's bytes
        (main, "POST", CMPL, auth, plain.replace(b'"hi"', b"[" * 100_000 + b"]" * 100_000), 400, None),  # too deep
        (main, "POST", CMPL, {}, plain, 401, None),
        (main, "POST", CMPL, {"Authorization": "Bearer sk-nope"}, plain, 401, None),
        (main, "POST", CMPL, {**auth, "x-prefix-tokens": "many"}, plain, 400, None),
        (main, "POST", CMPL, {**auth, "x-prefix-tokens": "-16"}, plain, 400, None),
        (main, "GET", CMPL, auth, b"", 405, None),
        (main, "POST", "/v1/nowhere", auth, plain, 404, None),
        (small, "POST", CMPL, {"x-tenant-id": "t" * 300}, plain, 400, None),
        (small, "POST", CMPL, {"x-session-affinity": "s" * 300}, plain, 400, None),
        (small, "POST", CMPL, {}, json.dumps({**BASE[CMPL], "n": 13}).encode(), 400, "n"),  # over its capacity
    ]

    async def run_all():
        async with aiohttp.ClientSession() as s:
            out = []
            for server, method, path, headers, data, _, _ in cases:
                async with s.request(method, server.url + path, data=data, headers=headers) as r:
                    out.append((r.status, await r.json()))
            return out

    for case, (status, body) in zip(cases, asyncio.run(run_all())):
        _, method, path, _, data, want_status, want_param = case
        assert (status, _is_error_object(body)) == (want_status, True), (method, path, data[:200], body)
        if want_param is not None:
            assert body["error"]["param"] == want_param, (path, data[:200], body)

    with pytest.raises(openai.BadRequestError) as e:  # the official client parses the error object
        client.completions.create(model=MODEL, prompt="hi", temperature=7)
    assert e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    # a beam search wider than the server (2 prompts x 7 beams, of 12 sequences) is refused before a step runs
    before = small.metrics()["infire:prompt_tokens_total"]
    with pytest.raises(openai.BadRequestError) as e:
        openai.OpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0).completions.create(
            model=MODEL, prompt=["a", "b"], n=7, max_tokens=4, extra_body={"use_beam_search": True})
    assert e.value.param == "n" and small.metrics()["infire:prompt_tokens_total"] == before
    for server in (main, small):  # still healthy and serving
        with urllib.request.urlopen(server.url + "/health", timeout=30) as r:
            assert r.status == 200
    assert client.completions.create(prompt="Hi", max_tokens=3, **greedy()).usage.completion_tokens == 3


def test_openai_fields_that_change_nothing_are_accepted():
    """What clients send as they are (the official ones, or a stored response replayed): null fields,
    OpenAI's defaults, keys the server has no use for; an earlier refusal is what the assistant said."""
    from server.protocol import parse_chat

    replayed = {"role": "assistant", "content": "Hello!", "refusal": None, "audio": None, "function_call": None,
                "annotations": []}
    req = parse_chat({**BASE["/v1/chat/completions"], "metadata": {"run": "7"}, "service_tier": "auto",
                      "modalities": ["text"], "audio": None, "prediction": None, "safety_identifier": "u-1",
                      "prompt_cache_key": "k", "functions": None, "function_call": "none", "store": False,
                      "messages": [{"role": "user", "content": "hi"}, replayed,
                                   {"role": "assistant", "content": None, "refusal": "I can't help with that."},
                                   {"role": "user", "content": "ok"}]})
    assert req.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
                            {"role": "assistant", "content": "I can't help with that."},
                            {"role": "user", "content": "ok"}]


# ---- cache retention ---------------------------------------------------------------------------------
def test_prefix_hint_and_session_keep_pages_warm(small, tokenizer):
    """Three 4-page prefixes, one hinted (x-prefix-tokens), one in a session, one plain; then a filler
    request takes every free page that is not retained. Only the plain prefix is evicted.

    Pool arithmetic (23 usable pages, all free and none retained before this test): each request holds
    5 pages; afterwards 8 are retained (4 hinted + 4 of the session) and 15 are free, the plain prefix's
    first page 13th in LRU order. The filler grows to 14 pages: past that page, short of the retained ones.
    """
    c = openai.OpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0)
    words = LONG_TEXT.split()

    def prefix(tag: str) -> list[int]:
        ids = tokenizer.encode(f"[{tag}] " + " ".join(words[::-1] if tag == "plain" else words) * 3)
        return ids[:4 * PAGE]

    sfx1, sfx2 = tokenizer.encode(" Question: why?"), tokenizer.encode(" Question: when and where?")
    pre = {tag: prefix(tag) for tag in ("plain", "hint", "session")}
    headers = {"plain": {}, "hint": {"x-prefix-tokens": str(4 * PAGE)}, "session": {"x-session-affinity": "sess-1"}}

    def cached(tag: str, suffix: list[int]) -> int:
        r = c.completions.create(prompt=pre[tag] + suffix, max_tokens=2, extra_headers=headers[tag], **greedy())
        return r.usage.prompt_tokens_details.cached_tokens

    assert [cached(tag, sfx1) for tag in ("plain", "hint", "session")] == [0, 0, 0]
    filler = tokenizer.encode("[filler] " + LONG_TEXT * 8)[:215]
    c.completions.create(prompt=filler, max_tokens=9, extra_body={"ignore_eos": True}, **greedy())
    assert cached("plain", sfx2) == 0  # evicted by the filler
    assert cached("hint", sfx2) == 4 * PAGE
    assert cached("session", sfx2) == 4 * PAGE


def test_no_recompiles_after_warmup(servers):
    """Runs last: everything above (prefill chunks, decode, n, logprobs, penalties, preemption) reused warmup's
    compilations."""
    for server in servers:
        assert server.metrics()["infire:compiles_since_warmup"] == 0
