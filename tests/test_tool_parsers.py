"""Tool-call formats on literal model-like outputs, whole and streamed, and tools in the prompt (no model)."""

from __future__ import annotations

import json

import pytest

from infire_jax.structured.tool_parsers import HERMES, LLAMA3_JSON, MISTRAL, ToolCallStream, detect_format
from infire_jax.structured.tool_prompt import render_inputs

QWEN_LIKE = "{% if tools %}...<tool_call>...{% endif %}{% for message in messages %}{{ message.content }}{% endfor %}"
LLAMA_LIKE = '{% if tools %}{"name": function name, "parameters": ...}<|python_tag|>{% endif %}'
MISTRAL_LIKE = "{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]"
PLAIN = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']}}{% endfor %}"


def whole(fmt: str, text: str) -> tuple[str, list[tuple[str, dict]]]:
    s = ToolCallStream(fmt)
    content = s.feed(text)[0] + s.finish()[0]
    return content, [(c.name, json.loads(c.arguments)) for c in s.calls]


def streamed(fmt: str, text: str, step: int) -> tuple[str, list[tuple[str, dict]], list[int]]:
    """Fed `step` characters at a time; also where (which feed) each call came out."""
    s = ToolCallStream(fmt)
    content, calls, at = "", [], []
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        c, new = s.feed(piece)
        content += c
        calls += new
        at += [i] * len(new)
    c, new = s.finish()
    return content + c, [(x.name, json.loads(x.arguments)) for x in calls + new], at + [len(pieces)] * len(new)


def test_format_comes_from_the_template():
    assert detect_format(QWEN_LIKE) == HERMES
    assert detect_format(LLAMA_LIKE) == LLAMA3_JSON
    assert detect_format(MISTRAL_LIKE) == MISTRAL
    assert detect_format(PLAIN) == HERMES  # no tool support: we prompt for Hermes
    assert detect_format(None) == HERMES


HERMES_OUT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
CASES = [
    (HERMES, HERMES_OUT, "Let me check.\n", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {}}', "", [("f", {})]),  # ended inside the block
    (HERMES, "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    (HERMES, "a < b and <tool_ is not a call", "a < b and <tool_ is not a call", []),
    (HERMES, "Plain answer.", "Plain answer.", []),
    (LLAMA3_JSON, ' {"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", {"city": "Oslo"})]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', "",
     [("a", {"x": 1}), ("b", {})]),
    (LLAMA3_JSON, "{not a call", "{not a call", []),
    (LLAMA3_JSON, "Sure: {\"name\": 1}", "Sure: {\"name\": 1}", []),
    (MISTRAL, 'Hm.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
              '{"name": "noop", "arguments": {}}]', "Hm.", [("get_weather", {"city": "Rome"}), ("noop", {})]),
    (MISTRAL, "[TOOL_CALLS][broken", "[TOOL_CALLS][broken", []),
]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_parsers_whole_and_streamed(fmt, text, content, calls):
    assert whole(fmt, text) == (content, calls)
    for step in (1, 3, 7):
        got_content, got_calls, _ = streamed(fmt, text, step)
        assert (got_content, got_calls) == (content, calls), step


def test_hermes_calls_stream_out_as_each_block_closes():
    _, calls, at = streamed(HERMES, HERMES_OUT, 5)
    first_close = HERMES_OUT.index("</tool_call>") + len("</tool_call>")
    assert len(calls) == 2 and at[0] == (first_close - 1) // 5 and at[1] > at[0]


def test_call_ids_are_unique_openai_objects():
    s = ToolCallStream(HERMES)
    s.feed(HERMES_OUT)
    s.finish()
    objs = [c.to_openai() for c in s.calls]
    assert len({o["id"] for o in objs}) == 2 and all(o["id"].startswith("call_") for o in objs)
    assert objs[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
]


def test_plain_template_gets_hermes_messages():
    messages, extra = render_inputs(PLAIN, HISTORY, TOOLS)
    assert extra == {}
    assert messages[0]["role"] == "system" and "<tools>\n" + json.dumps(TOOLS[0]) in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content":
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content":
                           "<tool_response>\n21 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"}
    assert len(messages) == 4
    # without tools offered, the history still renders (and no system prompt is added)
    assert render_inputs(PLAIN, HISTORY, None)[0][0] == HISTORY[0]


def test_tool_template_gets_tools_and_object_arguments():
    messages, extra = render_inputs(QWEN_LIKE, HISTORY, TOOLS)
    assert extra == {"tools": TOOLS}
    assert messages[1]["content"] == "" and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2]["tool_call_id"] == "call_1"
