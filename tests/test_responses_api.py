"""The Responses API (`/v1/responses`), reasoning in chat, and the serve flags, live on the shared engine.

The reasoning tests come first: they serve the engine from an app of their own (a reasoning parser
and a chat template of our own), which hands it back before `smol_server` takes it. SmolLM2 does
not think, so a regex (vLLM's `structured_outputs`, which constrains the whole output) makes it
write a think block.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_utils import MODEL, AppThread, wait_until

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
ASK = "What is the weather in Paris?"
THINK = r"<think>[a-z]{3,8}</think>[A-Z][a-z]{2,8}"
# A template of our own (--chat-template): SmolLM2's, with a system line when `thinking` is passed.
THINKING_LINE = "{% if thinking is defined and thinking %}<|im_start|>system\nThink first.<|im_end|>\n{% endif %}"


def client_of(url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300, **kw)


def post(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def assert_error(status: int, body: dict, want_status: int, param: str | None) -> None:
    assert status == want_status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], body
    assert err["type"] == "invalid_request_error" and err["param"] == param, body


def extra(obj, name: str):
    return (obj.model_extra or {}).get(name)


# ---- reasoning, chat_template_kwargs and --chat-template (an app of their own) ---------------------------
@pytest.fixture(scope="class")
def url(smol_llm):
    """The engine served with the deepseek_v3 reasoning parser and our template, until the class ends."""
    from server.app import build_app

    servers = AppThread()
    try:
        template = THINKING_LINE + smol_llm.tokenizer.chat_template
        servers.run(servers.serve(build_app(smol_llm.engine, reasoning_parser="deepseek_v3", chat_template=template)))
        yield servers.urls[0]
    finally:
        servers.close()


class TestReasoning:

    def test_chat_message_and_deltas_carry_the_reasoning(self, url):
        """deepseek_v3 thinks only with chat_template_kwargs {"thinking": true}: then the think block is
        `reasoning`, the rest `content`; without it the whole output is content."""
        c = client_of(url)
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Think, then answer with one word."}],
                  temperature=0, max_tokens=30)
        think = {"structured_outputs": {"regex": THINK}}
        r = c.chat.completions.create(**kw, extra_body=think | {"chat_template_kwargs": {"thinking": True}})
        msg = r.choices[0].message
        reasoning = extra(msg, "reasoning")
        assert re.fullmatch("[a-z]{3,8}", reasoning) and re.fullmatch("[A-Z][a-z]{2,8}", msg.content), msg
        assert r.choices[0].finish_reason == "stop"

        chunks = c.chat.completions.create(**kw, stream=True,
                                           extra_body=think | {"chat_template_kwargs": {"thinking": True}})
        parts = [(k, v) for ch in chunks for k, v in (("reasoning", extra(ch.choices[0].delta, "reasoning")),
                                                       ("content", ch.choices[0].delta.content)) if v]
        kinds = [k for k, _ in parts]
        assert kinds == sorted(kinds, key=["reasoning", "content"].index)  # all reasoning, then the answer
        assert "".join(v for k, v in parts if k == "reasoning") == reasoning
        assert "".join(v for k, v in parts if k == "content") == msg.content

        plain = c.chat.completions.create(**kw, extra_body=think).choices[0].message
        assert extra(plain, "reasoning") is None and re.fullmatch(THINK, plain.content), plain

    def test_chat_template_flag_and_kwargs_reach_the_template(self, url, smol_llm):
        with urllib.request.urlopen(url + "/tokenizer_info", timeout=30) as r:
            assert json.loads(r.read())["chat_template"] == THINKING_LINE + smol_llm.tokenizer.chat_template
        c = client_of(url)
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, temperature=0)
        plain = c.chat.completions.create(**kw).usage.prompt_tokens
        thinking = c.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"thinking": True}})
        assert thinking.usage.prompt_tokens > plain
        history = [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello", "reasoning_content": "x"},
                   {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye", "reasoning": "y"},
                   {"role": "user", "content": "Again"}]
        assert c.chat.completions.create(**kw | {"messages": history}).choices[0].finish_reason == "length"

    def test_answer_constraints_wait_for_the_reasoning_to_end(self, url):
        """response_format and a forced tool_choice constrain the answer only: while the model thinks
        (no </think> within these tokens), its reasoning is what it writes under a constraint that
        allows anything (the same constrained steps, one token at a time), token for token. (The
        answer's side, from </think> on, is test_grammar_backend's: SmolLM2 never ends a think block.)"""
        thinking = {"chat_template_kwargs": {"thinking": True}}
        base = {"model": MODEL, "messages": [{"role": "user", "content": ASK}], "max_tokens": 12, "temperature": 0}
        anything = {"structured_outputs": {"regex": "(?s:.*)"}}
        status, free = post(url, "/v1/chat/completions", base | thinking | anything)
        assert status == 200 and free["choices"][0]["message"]["reasoning"], free
        chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
        with_tools = {"tools": [chat_tool], "tool_choice": "auto"}  # the tools are in the prompt
        for constrained, same_prompt in (({"response_format": {"type": "json_object"}}, {}),
                                         (with_tools | {"tool_choice": "required"}, with_tools)):
            status, want = post(url, "/v1/chat/completions", base | thinking | anything | same_prompt)
            status, body = post(url, "/v1/chat/completions", base | thinking | constrained)
            msg, want = body["choices"][0]["message"], want["choices"][0]["message"]
            assert status == 200 and want["reasoning"] and (msg["reasoning"], msg["content"]) == \
                (want["reasoning"], want["content"]), (constrained, body)
        status, body = post(url, "/v1/responses", {"model": MODEL, "input": ASK, "max_output_tokens": 12,
                                                   "temperature": 0, "text": {"format": {"type": "json_object"}}}
                            | thinking)
        assert status == 200 and body["output"][0]["content"][0]["text"] == free["choices"][0]["message"]["reasoning"]
        status, body = post(url, "/v1/chat/completions", base | {"response_format": {"type": "json_object"}})
        assert status == 200 and body["choices"][0]["message"]["content"].startswith("{"), body  # no thinking asked

    def test_responses_reasoning_item_whole_and_streamed(self, url):
        c = client_of(url)
        kw = dict(model=MODEL, input="Count from one to ten.", max_output_tokens=6, temperature=0,
                  extra_body={"chat_template_kwargs": {"thinking": True}})
        r = c.responses.create(**kw)  # deepseek_v3 thinking: no </think> yet, so all of it is reasoning
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert [o.type for o in r.output] == ["reasoning"] and r.output_text == ""
        text = r.output[0].content[0].text
        assert text and r.output[0].summary == [] and r.output[0].content[0].type == "reasoning_text"
        assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens == 6

        events = list(c.responses.create(**kw, stream=True))
        types = [e.type for e in events]
        assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert types[-4:] == ["response.reasoning_text.done", "response.content_part.done",
                              "response.output_item.done", "response.incomplete"]
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == text
        assert events[-1].response.output[0].content[0].text == text


@pytest.fixture(scope="class", params=["kimi_k2", "deepseek_v3", "deepseek_v31", "qwen3_coder", "glm45", "minimax_m2",
                                                 "gemma4", "pythonic"])
def format_url(request, smol_llm):
    """The engine served with another model family's tool-call format (--tool-call-parser), until the class ends."""
    from server.app import build_app

    servers = AppThread()
    try:
        servers.run(servers.serve(build_app(smol_llm.engine, tool_call_parser=request.param)))
        yield request.param, servers.urls[0]
    finally:
        servers.close()


class TestForcedCallsInSpecialTokenFormats:

    def test_required_and_named_calls_are_written_and_read_in_the_format(self, format_url):
        """A forced tool_choice writes the call in the served format's own markers (text here: SmolLM2's
        tokenizer has no such special tokens) through the grammar, and the format's parser reads it back
        as an OpenAI tool call whose arguments fit the schema; Kimi's call id is its functions.NAME:IDX."""
        fmt, url = format_url
        client = client_of(url)
        fn = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}

        def ask(choice):  # one call (greedy SmolLM2 would repeat calls while the grammar lets it, to the token limit)
            return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=[fn],
                                                  tool_choice=choice, max_tokens=200, temperature=0,
                                                  parallel_tool_calls=False)

        with ThreadPoolExecutor(2) as pool:  # both in one batch
            answers = list(pool.map(ask, ("required", {"type": "function", "function": {"name": "get_weather"}})))
        for r in answers:
            calls = r.choices[0].message.tool_calls
            assert calls and r.choices[0].finish_reason == "tool_calls", (fmt, r.choices[0].message.content)
            (call,) = calls
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["parameters"])
            if fmt == "kimi_k2":
                assert re.fullmatch(r"functions\.get_weather:\d{1,2}", call.id), call.id
            assert not r.choices[0].message.content


def test_serve_flags_are_checked_before_loading(tmp_path, capsys):
    from infire_jax.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--reasoning-parser", "bogus"])
    assert e.value.code == 2 and "deepseek_r1" in capsys.readouterr().err  # names the known ones
    assert main(["serve", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "--chat-template" in capsys.readouterr().err
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% if %}")
    assert main(["serve", "--chat-template", str(bad)]) == 2
    assert "not a valid Jinja template" in capsys.readouterr().err


def test_output_items_and_events_of_reasoning_text_and_a_call():
    """The output builder alone, on a whole think-answer-call output split at random: the items, and
    the events in the API's order, numbered, whose deltas join to the items' text."""
    from server.responses_output import ResponseOutput
    from server.tool_calls import ChoiceParser

    text = ('<think>plan it</think>Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call>')
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), 6))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        out = ResponseOutput(ChoiceParser("hermes", None, "deepseek_r1"))
        events = [e for i, p in enumerate(pieces) for e in out.feed(p, i == len(pieces) - 1)] + out.finish("completed")
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert [i["type"] for i in out.items] == ["reasoning", "message", "function_call"]
        assert out.items[0]["content"] == [{"type": "reasoning_text", "text": "plan it"}]
        assert out.items[1]["content"] == [{"type": "output_text", "text": "Sure.", "annotations": []}]
        call = out.items[2]
        assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris", "unit": "celsius"}
        assert all(i["status"] == "completed" for i in out.items)
        types = [e["type"] for e in events if not e["type"].endswith(".delta")]
        item = ["response.output_item.added", "response.content_part.added"]
        done = ["response.content_part.done", "response.output_item.done"]
        assert types == (item + ["response.reasoning_text.done"] + done + item + ["response.output_text.done"] + done
                         + ["response.output_item.added", "response.function_call_arguments.done",
                            "response.output_item.done"])
        for kind, want in (("reasoning_text", "plan it"), ("output_text", "Sure."),
                           ("function_call_arguments", call["arguments"])):
            assert "".join(e["delta"] for e in events if e["type"] == f"response.{kind}.delta") == want


# ---- the Responses API on the shared server --------------------------------------------------------
@pytest.fixture(scope="module")
def client(smol_server):
    with client_of(smol_server) as c:
        yield c


def test_plain_response_is_the_chat_answer(client):
    r = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=12,
                                temperature=0, instructions="Answer briefly.")
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"}])
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL and r.created_at > 0
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output[0].content[0].type == "output_text" and r.output[0].content[0].annotations == []
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.output[0].status == r.status
    u = r.usage
    assert (u.input_tokens, u.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    assert r.instructions == "Answer briefly." and r.store is True and r.previous_response_id is None
    raw = json.loads(client.responses.with_raw_response.create(model=MODEL, input="Hi", max_output_tokens=2).text)
    assert "output_text" not in raw and set(raw["usage"]["input_tokens_details"]) == {"cached_tokens"}


def test_streamed_events_build_the_whole_response(client):
    kw = dict(model=MODEL, input="Name three colors.", max_output_tokens=20, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * len(deltas) + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        f"response.{whole.status}"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    assert "".join(d.delta for d in deltas) == events[-4].text == final.output_text == whole.output_text
    assert len({e.response.id for e in (events[0], events[1], events[-1])}) == 1
    assert {d.item_id for d in deltas} == {final.output[0].id}


def test_forced_function_call_streamed_by_the_sdk_helper_and_answered(client):
    """A named tool_choice forces one call whose arguments fit the schema; the SDK's stream helper
    accumulates our events; its output and a function_call_output are the next turn's input."""
    kw = dict(model=MODEL, input=ASK, tools=[WEATHER], temperature=0, max_output_tokens=60)
    r = client.responses.create(**kw, tool_choice={"type": "function", "name": "get_weather"})
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"] and r.output_text == ""
    call = r.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])

    with client.responses.stream(**kw, tool_choice="required", parallel_tool_calls=False) as s:
        events = list(s)
        final = s.get_final_response()
    assert [o.type for o in final.output] == ["function_call"] and final.output[0].name == "get_weather"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [final.output[0].arguments]

    result = '{"temperature": 21, "sky": "clear"}'
    turn = [{"role": "user", "content": ASK}, *[o.model_dump(exclude_unset=True) for o in r.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": result}]
    answer = client.responses.create(model=MODEL, input=turn, tools=[WEATHER], max_output_tokens=12, temperature=0)
    assert answer.output[0].type == "message" and answer.output_text
    history = [{"role": "user", "content": ASK}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result}]
    chat = client.chat.completions.create(model=MODEL, messages=history, max_tokens=1, tools=[
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}])
    assert answer.usage.input_tokens == chat.usage.prompt_tokens  # the prompt chat renders for that history


def test_previous_response_id_continues_and_stays_with_its_tenant(client, smol_server):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=8, temperature=0)
    alone = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=8, temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=8, temperature=0,
                                     previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_unknown")
    assert e.value.body["param"] == "previous_response_id" and e.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    other = client_of(smol_server, default_headers={"x-tenant-id": "other"})
    for call in (lambda: other.responses.retrieve(first.id),
                 lambda: other.responses.create(model=MODEL, input="Hi", previous_response_id=first.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_text_format_json_schema_and_json_object(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Describe the weather in Paris as JSON.", temperature=0,
                                max_output_tokens=60, text={"format": {"type": "json_schema", "name": "weather",
                                                                       "schema": schema, "strict": True}})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)
    r = client.responses.create(model=MODEL, input="Describe a person, a city and the weather as JSON.",
                                temperature=0, max_output_tokens=300,
                                text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(r.output_text), dict)


BAD = [  # (changes to a body, param)
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice.name"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER | {"parameters": {"type": "bogus"}}]}, "tools[0].parameters"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}, "text.format.schema"),
    ({"background": True}, "background"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),  # the client's own key
    ({"frequency": 1}, "frequency"),
]


def test_bad_input_gets_400_with_the_error_shape(smol_server):
    for change, param in BAD:
        assert_error(*post(smol_server, "/v1/responses", {"model": MODEL, "input": "Hi"} | change), 400, param)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    for change, param in (({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
                          ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages")):
        assert_error(*post(smol_server, "/v1/chat/completions", chat | change), 400, param)
    status, body = post(smol_server, "/v1/responses", {"model": "nope", "input": "Hi"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if "le" not in s.labels and "finished_reason" not in s.labels}


def test_disconnect_mid_stream_aborts_and_stores_nothing(smol_server):
    idle = metrics(smol_server)
    body = {"model": MODEL, "input": "Write a very long story about a dragon.", "max_output_tokens": 600,
            "temperature": 0, "stream": True}

    async def mid_stream() -> str:
        async with aiohttp.ClientSession() as s:
            r = await s.post(smol_server + "/v1/responses", json=body)
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            response_id, deltas = None, 0
            async for line in r.content:
                if line.startswith(b"data: "):
                    event = json.loads(line[6:])
                    response_id = response_id or event["response"]["id"]
                    deltas += event["type"] == "response.output_text.delta"
                    if deltas == 3:
                        break
            assert metrics(smol_server)["infire:num_requests_running"] == 1
            r.close()
            return response_id

    response_id = asyncio.run(mid_stream())
    wait_until(lambda: (m := metrics(smol_server))["infire:num_requests_running"] == 0
               and m["infire:kv_cache_usage_perc"] == idle["infire:kv_cache_usage_perc"], 20,
               "the aborted response to free its pages")
    assert metrics(smol_server)["infire:generation_tokens_total"] - idle["infire:generation_tokens_total"] < 600
    status, err = post(smol_server, "/v1/responses", {"model": MODEL, "input": "Hi",
                                                      "previous_response_id": response_id})
    assert status == 404, err


def test_an_openai_agents_sdk_agent_calls_its_tool_and_answers(smol_server):
    """The OpenAI Agents SDK (`openai-agents`) runs a one-tool agent against /v1/responses, as agent
    runtimes do by default: the model must call the tool (tool_choice "required"; the SDK then lets it
    answer), the tool is called with arguments that fit its schema, and a final text comes back."""
    import agents

    agents.set_tracing_disabled(True)
    cities = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        cities.append(city)
        return f"It is sunny and 21 degrees in {city}."

    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=smol_server + "/v1", api_key="none", max_retries=0))
    agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                         model=model, model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                                          max_tokens=100))
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert cities and all(isinstance(c, str) and c for c in cities)
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_reasoning_markers_that_are_special_tokens_stay_in_the_decoded_text():
    """A request that may think keeps special tokens in its decoded text where the parser's markers
    are special tokens (the parser must see them), and its answer's grammar writes them as tokens;
    where they are plain text, or the request does not think, nothing changes."""
    import types

    from server.endpoints import _reasoning
    from server.protocol import parse_chat

    def served(parser: str, special: dict[str, int]):
        tokenizer = types.SimpleNamespace(special_token_id=special.get, added_token_id=special.get)
        return types.SimpleNamespace(reasoning_parser=parser, tokenizer=tokenizer)

    def request(**body):
        return parse_chat({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **body})

    req = request(response_format={"type": "json_object"})
    _reasoning(served("qwen3", {"<think>": 7, "</think>": 8}), req)
    assert req.params.skip_special_tokens is False
    assert "<[7]>" in req.params.structured_outputs.after and "<[8]>" in req.params.structured_outputs.after
    plain = request()
    _reasoning(served("qwen3", {}), plain)
    assert plain.params.skip_special_tokens is True and plain.params.structured_outputs is None
    off = request(chat_template_kwargs={"enable_thinking": False})
    _reasoning(served("qwen3", {"<think>": 7, "</think>": 8}), off)
    assert off.params.skip_special_tokens is True
