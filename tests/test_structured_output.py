"""Structured outputs and tool calling, live: one `infire-jax serve` driven by the official client, and the
offline API. Every constrained output is checked (jsonschema, regex, choice), greedy and sampled.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import jsonschema
import openai
import pytest

from conftest import engine_flags
from server_utils import MODEL, ServerProcess

ARGS = [*engine_flags(), "--grammar-compile-timeout", "1"]
ASK = [{"role": "user", "content": "Describe a person, a city and the weather as JSON."}]

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"], "additionalProperties": False},
        "city": {"type": "string", "maxLength": 12}}, "required": ["person", "city"], "additionalProperties": False},
    "array_enum": {"type": "object", "properties": {
        "days": {"type": "array", "minItems": 1, "maxItems": 3,
                 "items": {"enum": ["monday", "tuesday", "friday"]}},
        "weather": {"enum": ["sunny", "rainy", "cloudy"]}}, "required": ["days", "weather"],
        "additionalProperties": False},
    "numbers": {"type": "object", "properties": {
        "temperature": {"type": "number", "minimum": -40, "maximum": 50},
        "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
        "windy": {"type": "boolean"}}, "required": ["temperature", "humidity", "windy"],
        "additionalProperties": False},
    "optional": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 16}, "tags": {"type": "array", "maxItems": 2,
                                                            "items": {"type": "string", "maxLength": 8}},
        "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 10}}, "required": ["title"],
        "additionalProperties": False},
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
                   "required": ["zone"], "additionalProperties": False}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
TOOL_ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(ARGS)
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300) as c:
        yield c


def gather(server, calls: list) -> list:
    """Runs `calls` (functions of an AsyncOpenAI client returning coroutines) concurrently."""
    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300) as ac:
            return await asyncio.gather(*(c(ac) for c in calls))
    return asyncio.run(run())


def sampling(i: int) -> dict:
    return dict(temperature=0) if i % 2 == 0 else dict(temperature=0.8, seed=i)


def check_calls(calls, names: set[str]) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])


# ---- response_format and structured_outputs ----------------------------------------------------------
def test_json_schemas_validate_greedy_and_sampled_mixed_with_plain_requests(server):
    """Every schema greedy and sampled, in one batch with unconstrained requests."""
    cases = [(name, i) for name in SCHEMAS for i in range(2)]

    def constrained(name, i):
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
        return lambda ac: ac.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=200,
                                                     **sampling(i))

    def plain(i):
        return lambda ac: ac.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, **sampling(i))

    out = gather(server, [constrained(n, i) for n, i in cases] + [plain(i) for i in range(3)])
    for (name, i), r in zip(cases, out):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (name, i, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
    assert all(r.choices[0].message.content for r in out[len(cases):])


def test_json_object_and_vllm_json(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                       max_tokens=300, temperature=0)
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    schema = SCHEMAS["numbers"]
    r = client.completions.create(model=MODEL, prompt="Weather report as JSON:", max_tokens=60, temperature=0,
                                  extra_body={"structured_outputs": {"json": schema}})
    jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_regex_choice_and_grammar(server):
    regex = r"[A-Z][a-z]{2,8}, [0-9]{1,3} (km|miles)"
    choices = ["positive", "negative", "neutral"]
    grammar = 'start: "The answer is " answer "."\nanswer: NUMBER " " UNIT\nNUMBER: /[1-9][0-9]?/\nUNIT: "cm" | "kg"'
    kinds = [("regex", regex), ("choice", choices), ("grammar", grammar)]

    def chat(kind, value, i):
        return lambda ac: ac.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Answer briefly."}], max_tokens=40,
            extra_body={"structured_outputs": {kind: value}}, **sampling(i))

    def completion(kind, value, i):
        return lambda ac: ac.completions.create(model=MODEL, prompt="Answer:", max_tokens=40, n=2,
                                                extra_body={"structured_outputs": {kind: value}}, **sampling(i))

    calls = [chat(k, v, i) for k, v in kinds for i in range(2)] + [completion(k, v, 1) for k, v in kinds]
    out = gather(server, calls)
    texts = {k: [] for k, _ in kinds}
    for (k, _), r in zip([kv for kv in kinds for _ in range(2)], out[:6]):
        texts[k].append(r.choices[0].message.content)
    for (k, _), r in zip(kinds, out[6:]):
        texts[k] += [c.text for c in r.choices]
    assert all(re.fullmatch(regex, t) for t in texts["regex"]), texts["regex"]
    assert all(t in choices for t in texts["choice"]), texts["choice"]
    assert all(re.fullmatch(r"The answer is [1-9][0-9]? (cm|kg)\.", t) for t in texts["grammar"]), texts["grammar"]
    assert all(r.choices[0].finish_reason == "stop" for r in out)


def test_vllm_guided_fields(client):
    """vLLM's older guided_json (a schema, or its JSON text), guided_regex and guided_choice constrain
    as structured_outputs does; guided_decoding_backend is accepted (one backend serves every name)."""
    schema = SCHEMAS["numbers"]
    for value in (schema, json.dumps(schema)):
        r = client.completions.create(model=MODEL, prompt="Weather report as JSON:", max_tokens=60, temperature=0,
                                      extra_body={"guided_json": value, "guided_decoding_backend": "xgrammar"})
        jsonschema.validate(json.loads(r.choices[0].text), schema)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is the sky green?"}],
                                       max_tokens=10, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="A city and a distance:", max_tokens=20, temperature=0,
                                  extra_body={"guided_regex": r"[A-Z][a-z]{2,8}, [0-9]{1,3} km"})
    assert re.fullmatch(r"[A-Z][a-z]{2,8}, [0-9]{1,3} km", r.choices[0].text)


def test_max_tokens_cut_gives_length_and_a_valid_prefix(client):
    schema = SCHEMAS["nested"]
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "n", "schema": schema}})
    full = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, temperature=0,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "n", "schema": schema}})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert full.choices[0].message.content.startswith(r.choices[0].message.content)


# ---- tools ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_calls(server, stream):
    async def run(ac, tool_choice, **kw):
        r = await ac.chat.completions.create(model=MODEL, messages=TOOL_ASK, tools=[WEATHER, TIME], max_tokens=200,
                                             tool_choice=tool_choice, stream=stream, **kw)
        if not stream:
            return r.choices[0].message.tool_calls, r.choices[0].finish_reason, r.choices[0].message.content
        calls, reason, content = {}, None, ""
        async for chunk in r:
            d = chunk.choices[0].delta
            content += d.content or ""
            for tc in d.tool_calls or []:  # OpenAI-style: index, then id/name/arguments pieces
                c = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                c["id"] += tc.id or ""
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
            reason = chunk.choices[0].finish_reason or reason
        return ([openai.types.chat.ChatCompletionMessageFunctionToolCall(
            id=c["id"], type="function", function={"name": c["name"], "arguments": c["arguments"]})
            for _, c in sorted(calls.items())], reason, content or None)

    named = {"type": "function", "function": {"name": "get_time"}}
    greedy, sampled = dict(temperature=0), dict(temperature=0.8, seed=5)
    out = gather(server, [lambda ac, c=c, kw=kw: run(ac, c, **kw) for c in ("required", named) for kw in (greedy, sampled)]
                 + [lambda ac: run(ac, "required", temperature=0, parallel_tool_calls=False)])
    for calls, reason, content in out[:2]:
        check_calls(calls, {"get_weather", "get_time"})
        assert reason == "tool_calls" and not content
    for calls, reason, _ in out[2:4]:
        check_calls(calls, {"get_time"})
        assert len(calls) == 1 and reason == "tool_calls"
    assert len(out[4][0]) == 1


def test_tool_choice_none_and_auto(server):
    none, r = gather(server, [lambda ac, c=c, n=n: ac.chat.completions.create(
        model=MODEL, messages=TOOL_ASK, tools=[WEATHER], max_tokens=n, temperature=0, **c)
        for c, n in ((dict(tool_choice="none"), 30), ({}, 80))])
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    assert none.choices[0].finish_reason in ("stop", "length")
    m = r.choices[0].message
    if m.tool_calls:  # the model decides; whatever it does, the answer is well formed
        check_calls(m.tool_calls, {"get_weather"})
        assert r.choices[0].finish_reason == "tool_calls"
    else:
        assert m.content and "<tool_call>" not in m.content


def test_tool_results_and_calls_in_the_history(client):
    messages = TOOL_ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": '{"temperature": 21, "sky": "clear"}'}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                       max_tokens=30, temperature=0)
    assert r.choices[0].message.content and r.usage.prompt_tokens > 100  # the tools prompt and the history


# ---- bad input --------------------------------------------------------------------------------------
def js(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


BAD = [  # (changes to a chat body, param)
    (js({"type": "bogus"}), "response_format.json_schema.schema"),
    (js({"type": "array", "uniqueItems": True}), "response_format.json_schema.schema"),  # unsupported keyword
    (js("not an object"), "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"yaml": "a"}}, "structured_outputs.yaml"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": {}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_whitespace_pattern": 5}, "guided_whitespace_pattern"),
    ({"guided_decoding_backend": 3}, "guided_decoding_backend"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "bad name!"}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name"),
]


def test_bad_input_gets_400_naming_the_field(client):
    for change, param in BAD:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | change
        with pytest.raises(openai.BadRequestError) as e:
            client.post("/chat/completions", body=body, cast_to=object)
        assert e.value.body["param"] == param, (change, e.value.body)


def test_a_slow_grammar_compile_is_bounded(server, client):
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[a-z]{3,9}x[0-9]{2,7}"}
                                            for i in range(8000)}}  # about 4 s to compile here; the limit is 1 s
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **js(big))
    assert time.monotonic() - start < 3.5
    assert "did not compile within 1 s" in e.value.body["message"]
    assert e.value.body["param"] == "response_format.json_schema.schema"
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=0)  # still serving
    assert r.choices[0].message.content


# ---- offline, and no compiles -------------------------------------------------------------------------
def test_offline_llm_generate_with_structured_outputs(smol_llm):
    from infire_jax import SamplingParams, StructuredOutputs

    schema = SCHEMAS["array_enum"]
    outs = smol_llm.generate(["The weather this week, as JSON:", "Yes or no?"], [
        SamplingParams(max_tokens=60, temperature=0, structured_outputs=StructuredOutputs(json=schema)),
        SamplingParams(max_tokens=10, temperature=0.7, seed=1, n=2,
                       structured_outputs=StructuredOutputs(choice=["yes", "no"]))])
    jsonschema.validate(json.loads(outs[0].text), schema)
    assert {o.text for o in outs[1].outputs} <= {"yes", "no"}
    assert all(o.finish_reason == "stop" for out in outs for o in out.outputs)
    assert smol_llm.engine.compiles_since_warmup == 0


def test_no_compiles_after_warmup(server):
    """Runs last in this module: constrained and unconstrained requests, mixed, compiled nothing."""
    assert server.metrics()["infire:compiles_since_warmup"] == 0
