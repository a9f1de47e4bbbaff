"""Tool-call formats on literal model-like outputs, whole and streamed, and tools in the prompt (no model)."""

from __future__ import annotations

import json
import random

import pytest

from infire_jax.structured import TOOL_PARSERS, parse_tool_calls, stream_tool_calls
from infire_jax.structured.tool_parsers import TOOL_PARSER_NAMES
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


# ---- every parser through the parse surface (infire_jax.structured) ----

KIMI_SB, KIMI_SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CB, KIMI_AB, KIMI_CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
DS_SB, DS_SE, DS_CB, DS_SEP, DS_CE = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                                      "<｜tool▁sep｜>", "<｜tool▁call▁end｜>")


def kimi(call_id: str, args: str) -> str:
    return f"{KIMI_CB}{call_id}{KIMI_AB}{args}{KIMI_CE}"


def ds3(name: str, args: str) -> str:
    return f"{DS_CB}function{DS_SEP}{name}\n```json\n{args}\n```{DS_CE}"


def ds31(name: str, args: str) -> str:
    return f"{DS_CB}{name}{DS_SEP}{args}{DS_CE}"


def coder(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={p}>\n{v}\n</parameter>\n" for p, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


RUN_TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {
    "cmd": {"type": "string"}, "timeout": {"type": "integer"}, "env": {"type": "object"},
    "verbose": {"type": "boolean"}, "tag": {"type": "string"}, "limit": {"type": ["integer", "null"]},
    "ratio": {"anyOf": [{"type": "number"}, {"type": "string"}]}}}}}]
RUN = coder("run", ("cmd", "ls -la"), ("timeout", "30"), ("env", '{"A": "1"}'), ("verbose", "true"), ("tag", "007"))


def glm(name: str, *args: tuple[str, str]) -> str:
    """A call as GLM-4.5's chat template writes one."""
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args)
    return f"<tool_call>{name}\n{body}</tool_call>"


def minimax(*calls: tuple[str, tuple[tuple[str, str], ...]]) -> str:
    """A block of calls as MiniMax-M2's chat template writes one."""
    invokes = "".join(f'<invoke name="{name}">\n' + "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in args)
                      + "</invoke>\n" for name, args in calls)
    return f"<minimax:tool_call>\n{invokes}</minimax:tool_call>"


GLM_RUN = glm("run", ("cmd", "ls -la"), ("timeout", "30"), ("env", '{"A": "1"}'), ("verbose", "true"), ("tag", "007"))
KIMI_TWO = (kimi("functions.get_weather:0", '{"city": "Lagos"}') + kimi("functions.get_time:1", '{"tz": "WAT"}'))
KIMI_BAD = kimi("functions.f:2", '{"a": ')
Q = '<|"|>'  # Gemma 4's string delimiter


def gemma(name: str, args: str) -> str:
    return f"<|tool_call>call:{name}{{{args}}}<tool_call|>"


# vLLM's documented example (gemma4_tool_parser.py's docstring), and one with every kind of value
GEMMA_DOC = gemma("get_weather", f"location:{Q}Tokyo{Q},num:42")
GEMMA_ALL = gemma("run", f"cmd:{Q}ls -la, then {{x}}: [y]{Q},opts:{{deep:{{k:{Q}v{Q}}},on:true}},"
                         f"xs:[1,-2.5e3,{Q}a,b{Q},[]],none:null,word:LA,flag:false")
GEMMA_ALL_ARGS = {"cmd": "ls -la, then {x}: [y]", "opts": {"deep": {"k": "v"}, "on": True},
                  "xs": [1, -2500.0, "a,b", []], "none": None, "word": "LA", "flag": False}

# (parser, output, content, [(name, arguments)], tools)
SURFACE_CASES = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\nAnything else?',
     "Sure.\n\nAnything else?", [("f", {"a": 1})], None),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
               '<tool_call>{"name": "g", "arguments": {</tool_call>',
     '<tool_call>{"name": "g", "arguments": {</tool_call>', [("f", {})], None),
    ("llama3_json", '{"name": "f", "parameters": {"a": [1, 2]}} and then some text',
     '{"name": "f", "parameters": {"a": [1, 2]}} and then some text', [], None),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Rome"}[TOOL_CALLS]get_time{"tz": "CET"}', "",
     [("get_weather", {"city": "Rome"}), ("get_time", {"tz": "CET"})], None),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', "Sure.",
     [("get_weather", {"city": "Rome"})], None),
    ("mistral", '[TOOL_CALLS]get_weather{"city": [TOOL_CALLS]get_time{}',
     '[TOOL_CALLS]get_weather{"city": ', [("get_time", {})], None),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"k": "v"}}] that is all', " that is all",
     [("a", {"k": "v"})], None),
    ("mistral", '[TOOL_CALLS]f{"a": NaN}', '[TOOL_CALLS]f{"a": NaN}', [], None),  # NaN is not JSON
    ("mistral", "No tools needed [TOOL_CALLS] here", "No tools needed [TOOL_CALLS] here", [], None),
    ("pythonic", "[get_weather(city='LA', n=3), other(x=[1, 2], flag=True, v=None)]", "",
     [("get_weather", {"city": "LA", "n": 3}), ("other", {"x": [1, 2], "flag": True, "v": None})], None),
    ("pythonic", " [f(d={'a': (1, 2.5), 'b': -4}, s=\"it's ]\"), g()]\nDone.", "\nDone.",
     [("f", {"d": {"a": [1, 2.5], "b": -4}, "s": "it's ]"}), ("g", {})], None),
    ("pythonic", "[get_weather(city=LA)]", "[get_weather(city=LA)]", [], None),  # a variable, not a literal
    ("pythonic", "[f(1)] and [f(a=1+2)]", "[f(1)] and [f(a=1+2)]", [], None),  # positional; an expression
    ("pythonic", "[1, 2] are the numbers", "[1, 2] are the numbers", [], None),
    ("pythonic", "[f(a='x'", "[f(a='x'", [], None),  # ended inside the list
    ("llama4_pythonic", "Let me check.<|python_start|>[get_weather(city='Oslo')]<|python_end|> Done.",
     "Let me check. Done.", [("get_weather", {"city": "Oslo"})], None),
    ("llama4_pythonic", "<|python_start|>[f(x=)]<|python_end|>", "<|python_start|>[f(x=)]<|python_end|>", [], None),
    ("kimi_k2", f"I'll look both up.{KIMI_SB}{KIMI_TWO}{KIMI_SE}", "I'll look both up.",
     [("get_weather", {"city": "Lagos"}), ("get_time", {"tz": "WAT"})], None),
    ("kimi_k2", f"{KIMI_SB}{kimi('functions.get_weather:0', '{}')}{KIMI_SE}Back soon.", "Back soon.",
     [("get_weather", {})], None),
    ("kimi_k2", f"{KIMI_SB}{KIMI_BAD}{kimi('functions.g:3', '{}')}{KIMI_SE}", KIMI_BAD, [("g", {})], None),
    ("deepseek_v3",
     "Checking." + DS_SB + ds3("get_weather", '{"city": "Hanoi"}') + "\n" + ds3("get_time", "{}") + DS_SE,
     "Checking.", [("get_weather", {"city": "Hanoi"}), ("get_time", {})], None),
    ("deepseek_v3", f"{DS_SB}{ds3('f', '{oops}')}{DS_SE}", ds3("f", "{oops}"), [], None),
    ("deepseek_v31", DS_SB + ds31("search", '{"q": "jax", "k": 5}') + ds31("open", '{"id": 2}') + DS_SE + "ok",
     "ok", [("search", {"q": "jax", "k": 5}), ("open", {"id": 2})], None),
    ("deepseek_v31", f"{DS_SB}{ds3('f', '{}')}{DS_SE}", ds3("f", "{}"), [], None),  # V3's layout is not V3.1's
    ("qwen3_coder", f"Let me run it.\n{RUN}\n", "Let me run it.\n",
     [("run", {"cmd": "ls -la", "timeout": 30, "env": {"A": "1"}, "verbose": True, "tag": "007"})], RUN_TOOLS),
    ("qwen3_coder", RUN, "", [("run", {"cmd": "ls -la", "timeout": 30, "env": {"A": "1"}, "verbose": True,
                                       "tag": "007"})], None),  # untyped: JSON where it is JSON
    ("qwen3_coder", coder("run", ("limit", "null"), ("ratio", "0.5"), ("cmd", "def f():\n    return [1]")) +
     coder("other", ("n", "nope")) + "\nSent both.", "\nSent both.",
     [("run", {"limit": None, "ratio": 0.5, "cmd": "def f():\n    return [1]"}), ("other", {"n": "nope"})], RUN_TOOLS),
    ("qwen3_coder", "<tool_call>\n<function=run>\n<parameter=cmd>\nls\n</parameter>\nstray\n</function>\n</tool_call>",
     "<tool_call>\n<function=run>\n<parameter=cmd>\nls\n</parameter>\nstray\n</function>\n</tool_call>", [], RUN_TOOLS),
    ("qwen3_coder", "<tool_call>\nrun(cmd='ls')\n</tool_call>", "<tool_call>\nrun(cmd='ls')\n</tool_call>", [], None),
    ("glm45", f"Let me run it.\n{GLM_RUN}", "Let me run it.\n",
     [("run", {"cmd": "ls -la", "timeout": 30, "env": {"A": "1"}, "verbose": True, "tag": "007"})], RUN_TOOLS),
    ("glm45", GLM_RUN, "", [("run", {"cmd": "ls -la", "timeout": 30, "env": {"A": "1"}, "verbose": True,
                                     "tag": "007"})], None),  # untyped: JSON where it is JSON
    ("glm45", glm("run", ("limit", "null"), ("ratio", "0.5"), ("cmd", "def f():\n    return [1]")) + "\n" +
     glm("get_time") + "\nSent both.", "\nSent both.",
     [("run", {"limit": None, "ratio": 0.5, "cmd": "def f():\n    return [1]"}), ("get_time", {})], RUN_TOOLS),
    ("glm45", "<tool_call>run\n<arg_key>cmd</arg_key>\n<arg_value>ls</arg_value>\nstray\n</tool_call>",
     "<tool_call>run\n<arg_key>cmd</arg_key>\n<arg_value>ls</arg_value>\nstray\n</tool_call>", [], RUN_TOOLS),
    ("minimax_m2", "Checking." + minimax(("run", (("cmd", "ls -la"), ("timeout", "30"), ("env", '{"A": "1"}'))),
                                         ("get_time", ())) + "\nDone.", "Checking.\nDone.",
     [("run", {"cmd": "ls -la", "timeout": 30, "env": {"A": "1"}}), ("get_time", {})], RUN_TOOLS),
    ("minimax_m2", minimax(("run", (("tag", "007"), ("limit", "null"))),), "",
     [("run", {"tag": "007", "limit": None})], None),  # untyped: JSON where it is JSON
    ("minimax_m2", '<minimax:tool_call>\n<invoke name="run">\nstray<parameter name="cmd">ls</parameter>\n'
                   '</invoke>\n</minimax:tool_call>', '<minimax:tool_call>\n<invoke name="run">\nstray'
     '<parameter name="cmd">ls</parameter>\n</invoke>\n</minimax:tool_call>', [], RUN_TOOLS),
    ("minimax_m2", "<minimax:tool_call>\n</minimax:tool_call>", "<minimax:tool_call>\n</minimax:tool_call>", [],
     None),  # a block with no call
    ("glm45", "<tool_call>\n<arg_key>cmd</arg_key>\n<arg_value>ls</arg_value>\n</tool_call>",
     "<tool_call>\n<arg_key>cmd</arg_key>\n<arg_value>ls</arg_value>\n</tool_call>", [], None),  # no name
    ("gemma4", f"Let me check.\n{GEMMA_DOC}", "Let me check.\n", [("get_weather", {"location": "Tokyo", "num": 42})],
     None),
    ("gemma4", GEMMA_ALL + GEMMA_DOC + gemma("noop", ""), "",  # several calls, one after another
     [("run", GEMMA_ALL_ARGS), ("get_weather", {"location": "Tokyo", "num": 42}), ("noop", {})], None),
    ("gemma4", gemma("f", f"{Q}odd key{Q}:1, b : {Q}x{Q} ") + "\nDone.", "\nDone.", [("f", {"odd key": 1, "b": "x"})],
     None),
    ("gemma4", gemma("f", f"a:{Q}open"), gemma("f", f"a:{Q}open"), [], None),  # an unterminated string
    ("gemma4", gemma("f", "a:1,,b:2"), gemma("f", "a:1,,b:2"), [], None),
    ("gemma4", gemma("f", "a:1") + "}", "}", [("f", {"a": 1})], None),  # after the call, text goes on
    ("gemma4", "<|tool_call>f{a:1}<tool_call|>", "<|tool_call>f{a:1}<tool_call|>", [], None),  # no call:
    ("gemma4", "<|tool_call>call:f{a:1}", "", [("f", {"a": 1})], None),  # ended (a stop token) before its closer
    ("gemma4", "<|tool_call>call:f{a:1", "<|tool_call>call:f{a:1", [], None),  # cut off inside
    ("gemma4", "<tool_call>call:f{a:1}</tool_call>", "<tool_call>call:f{a:1}</tool_call>", [], None),  # Hermes'
]
# An argument's string holding the block's closer (a forced call's grammar lets it): the call ends at the
# closer after which its body reads, and a body that never reads still ends at its first closer.
CODE = {"code": "print('</tool_call>')"}
CLOSER_CASES = [
    ("hermes", f'<tool_call>\n{{"name": "f", "arguments": {json.dumps(CODE)}}}\n</tool_call>\nDone.', "\nDone.",
     [("f", CODE)], None),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": </tool_call> ok</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"a": </tool_call> ok</tool_call>', [], None),
    ("qwen3_coder", coder("run", ("cmd", "x</tool_call>y"), ("tag", "1")), "",
     [("run", {"cmd": "x</tool_call>y", "tag": "1"})], RUN_TOOLS),
    ("glm45", glm("run", ("cmd", "echo '</tool_call>'")), "", [("run", {"cmd": "echo '</tool_call>'"})], RUN_TOOLS),
    ("minimax_m2", minimax(("run", (("cmd", "a</minimax:tool_call>b"),))), "",
     [("run", {"cmd": "a</minimax:tool_call>b"})], RUN_TOOLS),
    ("gemma4", gemma("run", f"cmd:{Q}echo '}}<tool_call|>'{Q}"), "", [("run", {"cmd": "echo '}<tool_call|>'"})], None),
    # arguments under "parameters" (Llama 3's key) are arguments; a number past a double's range is no JSON
    ("hermes", '<tool_call>{"name": "f", "parameters": {"a": 7}}</tool_call>', "", [("f", {"a": 7})], None),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1e400}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"a": 1e400}}</tool_call>', [], None),
]
SHORT_CASES = [  # every split point of these, and of some of the cases above
    ("kimi_k2", f"Hi{KIMI_SB}{kimi('functions.f:0', '{}')}{KIMI_SE}", "Hi", [("f", {})], None),
    ("deepseek_v31", f"Hi{DS_SB}{ds31('f', '{}')}{DS_SE}", "Hi", [("f", {})], None),
    ("mistral", 'Hi[TOOL_CALLS]f[ARGS]{"a": 1}', "Hi", [("f", {"a": 1})], None),
    ("llama4_pythonic", "Hi<|python_start|>[f(a=1)]<|python_end|>", "Hi", [("f", {"a": 1})], None),
    ("hermes", 'Hi<tool_call>{"name": "f", "arguments": {}}</tool_call>', "Hi", [("f", {})], None),
    ("glm45", "Hi<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", "Hi",
     [("f", {"a": 1})], None),
    ("minimax_m2", 'Hi<minimax:tool_call><invoke name="f"><parameter name="a">1</parameter></invoke>'
                   "</minimax:tool_call>", "Hi", [("f", {"a": 1})], None),
    ("gemma4", f"Hi{gemma('f', f'a:1,b:{Q}x{Q}')}", "Hi", [("f", {"a": 1, "b": "x"})], None),
]


def plain(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(len(text) - 1, 40)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("parser,text,content,calls,tools", SURFACE_CASES + SHORT_CASES + CLOSER_CASES)
def test_every_parser_whole(parser, text, content, calls, tools):
    got_content, got_calls = parse_tool_calls(text, parser, tools)
    assert (got_content, plain(got_calls)) == (content, calls)
    assert all(isinstance(json.loads(c.arguments), dict) and c.id for c in got_calls)


@pytest.mark.parametrize("parser,text,content,calls,tools", SURFACE_CASES + SHORT_CASES + CLOSER_CASES)
def test_every_split_gives_the_same(parser, text, content, calls, tools):
    rng = random.Random(f"{parser}:{text}")
    splits = [random_split(text, rng) for _ in range(60)] + [list(text)]
    if len(text) <= 120:
        splits += [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for deltas in splits:
        got_content, got_calls = stream_tool_calls(deltas, parser, tools)
        assert (got_content, plain(got_calls)) == (content, calls), deltas


def test_kimi_ids_are_its_own_and_mistral_ids_nine_alphanumerics():
    _, calls = parse_tool_calls(KIMI_TWO, "kimi_k2")
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]
    assert calls[0].to_openai()["function"]["name"] == "get_weather"
    _, calls = parse_tool_calls('[TOOL_CALLS]a{}[TOOL_CALLS][{"name": "b", "arguments": {}}]', "mistral")
    assert len(calls) == 2 and all(len(c.id) == 9 and c.id.isalnum() for c in calls)


def test_calls_and_content_stream_out_as_they_complete():
    text = f"I'll look both up.{KIMI_SB}{KIMI_TWO}{KIMI_SE}"
    s = ToolCallStream("kimi_k2")
    assert s.feed("I'll look both up.<|tool_ca") == ("I'll look both up.", [])  # a marker's start is held
    first_end = text.index(KIMI_CE) + len(KIMI_CE)
    content, calls = s.feed(text[len("I'll look both up.<|tool_ca"):first_end])
    assert content == "" and plain(calls) == [("get_weather", {"city": "Lagos"})]
    content, calls = s.feed(text[first_end:])
    assert content == "" and plain(calls) == [("get_time", {"tz": "WAT"})]
    assert s.finish() == ("", []) and len(s.calls) == 2


def test_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'.*kimi_k2.*qwen3_coder"):
        parse_tool_calls("x", "nope")
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic", "llama4_pythonic", "kimi_k2",
                                 "deepseek_v3", "deepseek_v31", "qwen3_coder", "glm45", "minimax_m2", "gemma4"}


@pytest.mark.parametrize("template,fmt", [
    ("{{ '<|tool_calls_section_begin|>' }}{% for c in m.tool_calls %}<|tool_call_begin|>{% endfor %}", "kimi_k2"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n' + '```json' }}",
     "deepseek_v3"),
    ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + args + '<｜tool▁call▁end｜>'}}",
     "deepseek_v31"),
    ("{% if tools %}<|python_start|>{% endif %}", "llama4_pythonic"),
    ("Respond as [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]",
     "pythonic"),
    ("<tool_call>\n<function={{ name }}>\n<parameter={{ p }}>", "qwen3_coder"),
    ("{{ '\\n<tool_call>' + tc.name }}{% for k, v in args.items() %}<arg_key>{{ k }}</arg_key>{% endfor %}", "glm45"),
    ('{{- "<minimax:tool_call>" }}{% for tc in m.tool_calls %}<invoke name="{{ tc.name }}">', "minimax_m2"),
    # Gemma 4's (vLLM's examples/tool_chat_template_gemma4.jinja): <|tool_call>, not Hermes' <tool_call>
    ("{%- for tool_call in message['tool_calls'] -%}{{- '<|tool_call>call:' + function['name'] + '{' -}}", "gemma4"),
])
def test_new_formats_come_from_the_template(template, fmt):
    assert detect_format(template) == fmt


def test_random_marker_soup_parses_the_same_however_streamed():
    """Outputs made of pieces of every format's markers and JSON: never an exception, the split never
    matters, and whatever is not a call comes back as content."""
    atoms = ["<tool_call>", "</tool_call>", "\n", " ", "{", "}", "[", "]", '"name"', ": ", '"f"', ", ", '"arguments"',
             '"parameters"', "{}", "[TOOL_CALLS]", "[ARGS]", "f", "<|python_tag|>", "<|python_start|>",
             "<|python_end|>", "f(", "a=1", ")", "'x'", '"', "'", ";", "\\", "NaN", KIMI_SB, KIMI_SE, KIMI_CB, "functions.f:0", KIMI_AB,
             KIMI_CE, DS_SB, DS_SE, DS_CB, DS_SEP, DS_CE, "function", "```json", "```", "<function=f>", "</function>",
             "<parameter=p>", "</parameter>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "f\n",
             "<minimax:tool_call>", "</minimax:tool_call>", '<invoke name="f">', "</invoke>", '<parameter name="a">',
             "<|", "<", "<|tool_call>", "<tool_call|>", "call:f{", Q, "a:", ",", "true"]
    rng = random.Random(11)
    for _ in range(300):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 14)))
        for parser in TOOL_PARSERS:
            content, calls = parse_tool_calls(text, parser)
            got_content, got_calls = stream_tool_calls(random_split(text, rng), parser)
            assert (got_content, plain(got_calls)) == (content, plain(calls)), (parser, text)
            assert calls or content == text or parser in ("kimi_k2", "deepseek_v3", "deepseek_v31")


def test_every_format_has_a_forced_call_grammar():
    """tool_choice "required" or named writes the call through a grammar in the model's own format
    (test_grammar_backend checks what they take); a format without one is refused by name (the server
    answers 400) rather than forced into another format's call that its parser would not read back."""
    from infire_jax.structured.tool_grammar import FORCEABLE_FORMATS, tool_call_constraint

    assert set(FORCEABLE_FORMATS) == set(TOOL_PARSER_NAMES)
    for fmt in FORCEABLE_FORMATS:
        assert tool_call_constraint(fmt, [{"name": "f"}], parallel=False).grammar
    with pytest.raises(ValueError, match="harmony"):
        tool_call_constraint("harmony", [{"name": "f", "parameters": {"type": "object"}}], parallel=False)


GEMMA_REFERENCE_CASES = [  # outputs whose reading transformers' Gemma 4 response template agrees on
    f"Sure.{GEMMA_DOC}",
    GEMMA_ALL.replace(",word:LA", "") + gemma("noop", ""),
    gemma("search", f"q:{Q}a:b, {{c}}{Q},filters:{{lang:[{Q}en{Q},{Q}fr{Q}],max:10,score:0.5}},exact:true"),
    f"<|channel>thought\nThe user wants Paris.<channel|>{gemma('get_weather', f'city:{Q}Paris{Q}')}",
    "<|channel>thought\nNothing to call.<channel|>It is 4.",
]


@pytest.mark.parametrize("text", GEMMA_REFERENCE_CASES)
def test_gemma4_reads_as_transformers_reads_it(text):
    """transformers' own reader of Gemma 4's output (its serving fallback response template, a
    different implementation) finds the same reasoning, content and typed calls as our gemma4
    reasoning parser followed by the gemma4 tool parser."""
    from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS
    from transformers.utils.chat_parsing import parse_response

    from infire_jax.structured import parse_reasoning

    ref = parse_response(text, _RESPONSE_TEMPLATE_FALLBACKS[("gemma4",)], prefix="<|turn>model\n")
    reasoning, rest = parse_reasoning(text, "gemma4")
    content, calls = parse_tool_calls(rest, "gemma4")
    assert (reasoning, content) == (ref.get("reasoning_content", ""), ref.get("content", ""))
    assert plain(calls) == [(c["function"]["name"], c["function"]["arguments"]) for c in ref.get("tool_calls", [])]
