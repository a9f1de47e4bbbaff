"""gpt-oss's harmony format served: SmolLM2 behind our harmony template writes harmony under a regex
(chat whole and streamed, a Responses turn after a call, free text, forced calls and answer schemas).
A module of its own: while its server runs, that server's engine thread owns the shared engine."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from server_utils import MODEL, AppThread
from test_responses_api import ASK, WEATHER, assert_error, client_of, extra, post

# gpt-oss's harmony, written by SmolLM2 under a regex: its markers are text here (SmolLM2's tokenizer
# has no such special tokens), which the harmony parsers read the same.
HARMONY_CALL = (re.escape("<|channel|>analysis<|message|>") + "[a-z]{3,8}" +
                re.escape("<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                          '<|message|>{"city": "') + "[A-Z][a-z]{2,8}" + re.escape('", "unit": "celsius"}<|call|>'))


@pytest.fixture(scope="module")
def harmony_url(smol_llm):
    """The engine served with our harmony template (--chat-template): its parsers are then the default."""
    from server.app import build_app

    from infire_jax.structured import harmony

    servers = AppThread()
    try:
        servers.run(servers.serve(build_app(smol_llm.engine, chat_template=harmony.chat_template())))
        yield servers.urls[0]
    finally:
        servers.close()


def test_chat_reads_channels_and_calls_whole_and_streamed(harmony_url, smol_llm):
    """The analysis channel is `reasoning`, the commentary message to functions.get_weather a call;
    streamed, every chunk carries one kind. reasoning_effort reaches the template: the prompt counts
    the tokens of the conversation rendered with it."""
    from infire_jax.structured import harmony
    from infire_jax.structured.tool_prompt import render_inputs

    client = client_of(harmony_url)
    fn = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": ASK}]
    kw = dict(model=MODEL, messages=messages, tools=[fn], max_tokens=80, temperature=0, reasoning_effort="high",
              extra_body={"structured_outputs": {"regex": HARMONY_CALL}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and not msg.content, msg
    assert re.fullmatch("[a-z]{3,8}", extra(msg, "reasoning")), msg
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "celsius"
    tk = smol_llm.engine.tokenizer.with_chat_template(harmony.chat_template())
    rendered, extra_args = render_inputs(tk.chat_template, messages, [fn])
    text = tk.apply_chat_template(rendered, reasoning_effort="high", **extra_args)
    assert "Reasoning: high" in text and r.usage.prompt_tokens == len(tk.encode(text, add_special_tokens=False))

    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    kinds = [[k for k in ("reasoning", "content", "tool_calls")
              if (extra(d, k) if k == "reasoning" else getattr(d, k))] for d in deltas]
    assert all(len(k) <= 1 for k in kinds), kinds
    assert "".join(extra(d, "reasoning") or "" for d in deltas) == extra(msg, "reasoning")
    (streamed,) = [t for d in deltas for t in d.tool_calls or []]
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_responses_turn_after_a_call_and_output_that_is_not_harmony(harmony_url):
    """A Responses conversation with an earlier reasoning item, call and its output renders through
    the template; SmolLM2's free text (no channels) is the answer, never an error. An unknown
    effort is a 400."""
    client = client_of(harmony_url)
    r = client.responses.create(model=MODEL, max_output_tokens=6, temperature=0, reasoning={"effort": "low"},
                                tools=[WEATHER], input=[
                                    {"role": "user", "content": ASK},
                                    {"type": "reasoning", "id": "rs_1", "summary": [],
                                     "content": [{"type": "reasoning_text", "text": "Look it up."}]},
                                    {"type": "function_call", "call_id": "c1", "name": "get_weather",
                                     "arguments": '{"city": "Paris", "unit": "celsius"}'},
                                    {"type": "function_call_output", "call_id": "c1", "output": "21 C"}])
    assert r.status == "incomplete" and [o.type for o in r.output] == ["message"] and r.output_text, r
    assert r.reasoning.effort == "low" and r.usage.output_tokens_details.reasoning_tokens == 0
    status, body = post(harmony_url, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "chat_template_kwargs": {"reasoning_effort": "extreme"}})
    assert_error(status, body, 400, "messages")


def test_forced_call_and_answer_schema_let_the_analysis_through(harmony_url):
    """Under a forced call or a response_format the output may think first (free analysis text), then
    writes what the grammar allows: a call whose arguments fit the schema, or the answer's JSON
    (whole, or cut off by the token limit: SmolLM2 runs on inside a string)."""
    fn = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
    for extra_fields in ({"tools": [fn], "tool_choice": "required"}, {"response_format": {"type": "json_object"}}):
        status, body = post(harmony_url, "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": ASK}], "max_tokens": 60, "temperature": 0,
            **extra_fields})
        assert status == 200, body
        choice = body["choices"][0]
        msg, reason = choice["message"], choice["finish_reason"]
        if "tools" in extra_fields:  # greedy SmolLM2 calls at once
            assert reason == "tool_calls", choice
            jsonschema.validate(json.loads(msg["tool_calls"][0]["function"]["arguments"]), WEATHER["parameters"])
        elif "tools" not in extra_fields:
            assert not msg["content"] or msg["content"].startswith("{"), choice
            if reason == "stop":
                assert isinstance(json.loads(msg["content"]), dict), choice
