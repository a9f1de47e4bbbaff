"""gpt-oss's harmony format: the chat template we ship against the format documentation's own examples
(openai/harmony docs/format.md), its output read whole and over every split, the chat and Responses
layers that carry it, and the request fields that reach it. No model: the served end to end is in
test_responses_api's TestHarmony, on the shared SmolLM2 engine."""

from __future__ import annotations

import datetime
import json
import random
import types

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from infire_jax.errors import InvalidRequestError
from infire_jax.loaders.tokenizer import Tokenizer
from infire_jax.outputs import Delta
from infire_jax.structured import harmony
from infire_jax.structured.harmony import CALLS, CONTENT, REASONING, HarmonyStream, parse_harmony, stream_harmony
from infire_jax.structured.reasoning_parsers import reasoning_markers
from infire_jax.structured.tool_parsers import ToolCallStream, detect_format
from infire_jax.structured.tool_prompt import render_inputs
from server import tool_calls
from server.errors import APIError

TEMPLATE = harmony.chat_template()
FORMAT = {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}
DOC_TOOLS = [
    {"type": "function", "function": {"name": "get_location", "description": "Gets the location of the user."}},
    {"type": "function", "function": {
        "name": "get_current_weather", "description": "Gets the current weather in the provided location.",
        "parameters": {"type": "object", "required": ["location"], "properties": {
            "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
            "format": FORMAT}}}},
    {"type": "function", "function": {
        "name": "get_multiple_weathers", "description": "Gets the current weather in the provided list of locations.",
        "parameters": {"type": "object", "required": ["locations"], "properties": {
            "locations": {"type": "array", "items": {"type": "string"},
                          "description": 'List of city and state, e.g. ["San Francisco, CA", "New York, NY"]'},
            "format": FORMAT}}}}]
# The documentation's complete input after a function call ("Handling tool calls"), verbatim but its date.
DOC_PROMPT = """<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06
Current date: 2025-06-28

Reasoning: high

# Valid channels: analysis, commentary, final. Channel must be included for every message.
Calls to these tools must go to the commentary channel: 'functions'.<|end|><|start|>developer<|message|># Instructions

Use a friendly tone.

# Tools

## functions

namespace functions {

// Gets the location of the user.
type get_location = () => any;

// Gets the current weather in the provided location.
type get_current_weather = (_: {
// The city and state, e.g. San Francisco, CA
location: string,
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

// Gets the current weather in the provided list of locations.
type get_multiple_weathers = (_: {
// List of city and state, e.g. ["San Francisco, CA", "New York, NY"]
locations: string[],
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

} // namespace functions<|end|><|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant\
<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>commentary \
to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}<|call|>\
<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"sunny": true, "temperature": 20}<|end|>\
<|start|>assistant"""
# The documentation's example output of the call (its "Receiving tool calls") and of an answer.
DOC_CALL = ('<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>'
            'commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}<|call|>')
DOC_ANSWER = ('<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
              '<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>')


def tokenizer(template: str = TEMPLATE, model_type: str | None = None) -> Tokenizer:
    """A word-level tokenizer whose only words are harmony's special tokens (the template needs no more)."""
    tk = HFTokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in harmony.SPECIAL_TOKENS])
    return Tokenizer(tk, bos_token=None, eos_token=None, chat_template=template, model_type=model_type)


def render(messages: list[dict], tools: list[dict] | None = None, **kwargs) -> str:
    """As the server renders a chat (server/endpoints.py chat_prompt)."""
    msgs, extra = render_inputs(TEMPLATE, messages, tools)
    return tokenizer().apply_chat_template(msgs, add_generation_prompt=True, **kwargs, **extra)


def today(text: str) -> str:
    return text.replace("2025-06-28", datetime.date.today().isoformat())


# ---- rendering --------------------------------------------------------------------------------------
def test_the_documentations_function_calling_conversation_renders_verbatim():
    messages = [
        {"role": "system", "content": "Use a friendly tone."},
        {"role": "user", "content": "What is the weather like in SF?"},
        {"role": "assistant", "content": None, "reasoning_content": "Need to use function get_weather.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"location":"San Francisco"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sunny": true, "temperature": 20}'}]
    assert render(messages, DOC_TOOLS, reasoning_effort="high") == today(DOC_PROMPT)


def test_plain_chat_drops_reasoning_of_answered_turns_and_defaults_to_medium():
    """The documentation's follow-up: the earlier turn's chain of thought is dropped once it was answered
    in `final`; no tools and no instructions: no developer message, no functions line."""
    messages = [{"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "2 + 2 = 4.", "reasoning": "Simple arithmetic."},
                {"role": "user", "content": "What about 9 / 2?"}]
    from server.protocol import parse_chat
    req = parse_chat({"model": "m", "messages": messages})
    assert render(req.messages) == today(
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: medium\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
        "<|start|>user<|message|>What is 2 + 2?<|end|>"
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|end|>"
        "<|start|>user<|message|>What about 9 / 2?<|end|><|start|>assistant")


def test_json_schema_types_become_typescript():
    schema = {"type": "object", "required": ["query", "filters"], "properties": {
        "query": {"type": "string", "description": "What to look for.\nPlain words."},
        "limit": {"type": "integer", "default": 10},
        "exact": {"type": "boolean", "default": False},
        "score": {"type": ["number", "null"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
        "ids": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        "filters": {"type": "object", "required": ["field"], "properties": {
            "field": {"type": "string", "description": "A column"}, "values": {"type": "array"}}},
        "extra": {"type": "object"},
        "rows": {"type": "array", "items": {"type": "object", "properties": {"n": {"const": 1}}}},
        "anything": {}}}
    tools = [{"type": "function", "function": {"name": "search", "parameters": schema}},
             {"type": "function", "function": {"name": "ping", "description": "Two\nlines",
                                               "parameters": {"type": "object", "properties": {}}}}]
    text = render([{"role": "user", "content": "hi"}], tools)
    # no instructions: the developer message holds the tools alone
    assert "<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n" in text
    assert """type search = (_: {
// What to look for.
// Plain words.
query: string,
limit?: number, // default: 10
exact?: boolean, // default: false
score?: number | null,
tags?: ("a" | "b")[],
ids?: string | number,
filters: {
// A column
field: string,
values?: any[],
},
extra?: object,
rows?: {
n?: 1,
}[],
anything?: any,
}) => any;

// Two
// lines
type ping = () => any;

} // namespace functions<|end|>""" in text


def test_preambles_later_instructions_and_several_calls_render_in_place():
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": f"f{i}", "arguments": {"x": i}}} for i in (1, 2)]
    text = render([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "go"},
                   {"role": "assistant", "content": "Doing both.", "tool_calls": calls},
                   {"role": "tool", "tool_call_id": "c2", "content": "two"},
                   {"role": "tool", "tool_call_id": "c1", "content": "one"},
                   {"role": "system", "content": "Now answer."}], reasoning_effort="low")
    assert "Reasoning: low\n" in text and "\nCalls to these tools" not in text
    assert text.split("<|end|>", 2)[1] == "<|start|>developer<|message|># Instructions\n\nBe brief."
    assert text.endswith(
        "<|start|>assistant<|channel|>commentary<|message|>Doing both.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.f1 <|constrain|>json<|message|>{"x":1}<|call|>'
        '<|start|>assistant<|channel|>commentary to=functions.f2 <|constrain|>json<|message|>{"x":2}<|call|>'
        "<|start|>functions.f2 to=assistant<|channel|>commentary<|message|>two<|end|>"
        "<|start|>functions.f1 to=assistant<|channel|>commentary<|message|>one<|end|>"
        "<|start|>developer<|message|># Instructions\n\nNow answer.<|end|><|start|>assistant")


@pytest.mark.parametrize("messages, kwargs, match", [
    ([{"role": "user", "content": "hi"}], {"reasoning_effort": "extreme"}, "reasoning_effort must be low"),
    ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "nope", "content": "x"}], {},
     "tool_call_id 'nope' names no earlier assistant tool call"),
])
def test_what_the_template_cannot_render_is_a_request_error(messages, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        render(messages, **kwargs)


def test_a_gpt_oss_model_renders_with_our_template(tmp_path):
    """The engine's tokenizer (harmony.model_tokenizer) for config.json's model_type gpt_oss, over the
    model's own template, also once restored from a checkpoint; other models keep theirs. The server
    then reads harmony by default."""
    from server.app import _default_reasoning
    tokenizer(template="{{ messages }}").tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    for model_type, want in (("gpt_oss", TEMPLATE), ("llama", "{{ messages }}")):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
        tk = harmony.model_tokenizer(Tokenizer.from_dir(str(tmp_path)))
        assert tk.chat_template == want and tk.model_type == model_type
        Tokenizer.from_dir(str(tmp_path)).save(str(tmp_path / "saved"))  # as a checkpoint keeps it: no config.json
        assert harmony.model_tokenizer(Tokenizer.from_dir(str(tmp_path / "saved"))).chat_template == want
    assert detect_format(TEMPLATE) == "openai" and _default_reasoning(TEMPLATE) == "openai_gptoss"
    assert _default_reasoning("{{ messages }}") is None


# ---- parsing ----------------------------------------------------------------------------------------
ARGS = {"location": "San Francisco"}
# (output, reasoning, content, calls as (name, arguments))
CASES = [
    (DOC_ANSWER, 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = 4.", []),
    (DOC_CALL, "Need to use function get_weather.", "", [("get_weather", ARGS)]),
    # the recipient in the role's part, "json" without <|constrain|> (as gpt-oss's own template writes it)
    ('<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": [1, 2]}<|call|>', "", "",
     [("f", {"a": [1, 2]})]),
    # a preamble on commentary, then two calls, each its own message
    ('<|channel|>analysis<|message|>plan<|end|><|start|>assistant<|channel|>commentary<|message|>Doing both.<|end|>'
     '<|start|>assistant<|channel|>commentary to=functions.a<|constrain|>json<|message|>{}<|end|>'
     '<|start|>assistant<|channel|>commentary to=functions.b <|constrain|>json<|message|> {"k": "v"} <|call|>',
     "plan", "Doing both.", [("a", {}), ("b", {"k": "v"})]),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
     "<|start|>assistant<|channel|>final<|message|>c<|end|>\n<|start|>assistant<|channel|>final<|message|>d",
     "ab", "cd", []),
    ("<|channel|>final<|message|>Only the answer.", "", "Only the answer.", []),  # cut off: no end
    # the stop token's text left out of the output: a whole call still is one
    ('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}', "", "", [("f", {"a": 1})]),
    ("", "", "", []),
    # not harmony: content, whole
    ("Hello there, no channels at all.", "", "Hello there, no channels at all.", []),
    ("<|channel|>analysis<|mess", "", "<|channel|>analysis<|mess", []),  # cut off inside the header
    ("<|channel|>final<|end|>x", "", "<|channel|>finalx", []),  # a header that never opened a body
    ("x" * 300 + "<|message|>y<|end|>", "", "x" * 300 + "<|message|>y", []),  # too long for a header
    ('<|channel|>commentary to=functions.f<|message|>{"a": <|call|>', "", '{"a": ', []),  # broken arguments
    ('<|channel|>commentary to=functions.f<|message|>[1]<|call|>', "", "[1]", []),  # not an object
    ('<|channel|>commentary to=functions.f<|message|>{"a": 1', "", '{"a": 1', []),  # cut off mid-call
    ("<|channel|>final<|message|>a<|end|> stray <|start|>assistant<|channel|>final<|message|>b", "", "a stray b", []),
    ("<|channel|>analysis<|message|>t<|start|>assistant<|channel|>final<|message|>u<|return|>", "t", "u", []),
    ("<|channel|>analysis to=browser.search<|message|>q<|end|>", "q", "", []),  # a built-in tool: not a function
]


def plain(result) -> tuple:
    reasoning, content, calls = result
    return reasoning, content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("text, reasoning, content, calls", CASES)
def test_whole_output(text, reasoning, content, calls):
    assert plain(parse_harmony(text)) == (reasoning, content, calls)


@pytest.mark.parametrize("text, reasoning, content, calls", CASES)
def test_every_split_gives_the_same(text, reasoning, content, calls):
    """Every one split point, every two for the shorter outputs, character by character, and random
    chunkings: each gives the whole text's parse."""
    want = (reasoning, content, calls)
    n = len(text)
    splits = [[text[:i], text[i:]] for i in range(n + 1)] + [list(text)]
    if n <= 200:
        splits += [[text[:i], text[i:j], text[j:]] for i in range(n + 1) for j in range(i, n + 1)]
    rng = random.Random(n)
    for _ in range(50):
        cuts = sorted(rng.sample(range(n + 1), min(n + 1, rng.randint(1, 12))))
        splits.append([text[a:b] for a, b in zip([0] + cuts, cuts + [n])])
    for pieces in splits:
        assert plain(stream_harmony(pieces)) == want, pieces


def test_without_tools_or_reasoning_those_bodies_are_content():
    assert plain(parse_harmony(DOC_CALL, reasoning=True, calls=False)) == \
        ("Need to use function get_weather.", '{"location":"San Francisco"}', [])
    assert plain(parse_harmony(DOC_ANSWER, reasoning=False)) == \
        ("", 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.2 + 2 = 4.', [])


def test_parts_keep_their_order_and_a_marker_is_held_only_while_it_may_be_one():
    s = HarmonyStream()
    assert s.feed("<|channel|>analysis<|message|>think<|e") == [(REASONING, "think")]
    assert s.feed("nd|><|start|>assistant<|channel|>commentary<|message|>Pre<|") == [(CONTENT, "Pre")]
    assert s.feed("x") == [(CONTENT, "<|x")]
    parts = s.feed('<|end|><|start|>assistant<|channel|>commentary to=functions.f<|message|>{}<|call|>'
                   '<|start|>assistant<|channel|>analysis<|message|>more')
    assert [k for k, _ in parts] == [CALLS, REASONING] and parts[0][1].name == "f" and parts[1][1] == "more"
    assert s.finish() == []


# ---- the chat and Responses layers ------------------------------------------------------------------
def test_chat_deltas_never_mix_kinds_and_add_up_to_the_message():
    """One engine step may complete the reasoning and begin the answer (a burst of tokens): its chunks
    carry one kind each, the finish reason on the last."""
    from server.responses import ChatFormatter
    text = DOC_CALL.replace("<|call|>", "") + "<|call|>"
    fmt = ChatFormatter("id", "m", None, top_logprobs=0, want_logprobs=False, include_usage=False,
                        tool_format="openai", tools=[], reasoning_parser="openai_gptoss")
    cut = text.index("<|start|>") + 40
    chunks = fmt.chunks(0, Delta("r", 0, [1], text[:cut], None)) + \
        fmt.chunks(0, Delta("r", 0, [2], text[cut:], None, finish_reason="stop"))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert all(len(d) == 1 for d in deltas) and [next(iter(d)) for d in deltas] == ["reasoning", "tool_calls"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "tool_calls"]
    msg, reason = tool_calls.message(tool_calls.ChoiceParser("openai", [], "openai_gptoss"), text, "stop", True)
    assert reason == "tool_calls" and msg["reasoning"] == deltas[0]["reasoning"] and msg["content"] is None
    assert [c["function"] for c in msg["tool_calls"]] == [c["function"] for c in deltas[1]["tool_calls"]]

    mixed = tool_calls.ChoiceParser(None, None, "openai_gptoss")  # no tools offered: the call's body is content
    parts, reason = tool_calls.deltas(mixed, DOC_ANSWER.replace("<|return|>", ""), True, "stop")
    assert parts == [{"reasoning": 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.'},
                     {"content": "2 + 2 = 4."}] and reason == "stop"


def test_responses_output_items_follow_the_channels():
    from server.responses_output import ResponseOutput
    out = ResponseOutput(tool_calls.ChoiceParser("openai", [], "openai_gptoss"))
    text = DOC_CALL.replace("<|channel|>commentary to", "<|channel|>commentary<|message|>Checking.<|end|>"
                            "<|start|>assistant<|channel|>commentary to")
    for ch in text:
        out.feed(ch, False)
    out.feed("", True)
    out.finish("completed")
    assert [i["type"] for i in out.items] == ["reasoning", "message", "function_call"]
    assert out.items[0]["content"][0]["text"] == "Need to use function get_weather."
    assert out.items[1]["content"][0]["text"] == "Checking."
    assert (out.items[2]["name"], json.loads(out.items[2]["arguments"])) == ("get_weather", ARGS)


def test_the_openai_names_are_not_think_blocks_or_call_formats():
    assert reasoning_markers("openai_gptoss") == harmony.SPECIAL_TOKENS
    with pytest.raises(ValueError, match="HarmonyStream"):
        ToolCallStream("openai")


# ---- constraints: an answer's schema and a forced call, after the analysis -------------------------------
@pytest.fixture(scope="module")
def byte_tokenizer():
    """Byte-level BPE over the 256 byte symbols (no merges) plus harmony's special tokens."""
    from tokenizers import decoders, models, pre_tokenizers
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = HFTokenizer(models.BPE(vocab, [], fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in harmony.SPECIAL_TOKENS])
    return Tokenizer(tk, bos_token=None, eos_token=None, chat_template=TEMPLATE)


def accepts(tk: Tokenizer, spec, text: str, special: bool) -> bool:
    """Whether the grammar takes all of `text` (its markers special tokens, or spelled out) and is then
    complete; the text round-trips through the harmony parser."""
    from infire_jax.structured.backend import GrammarBackend
    backend = GrammarBackend(tk.tk.to_str(), tk.vocab_size, (tk.token_to_id(harmony.RETURN),), timeout=30.0)
    try:
        matcher = backend.compile(spec).matcher()
    finally:
        backend.close()
    ids = tk.encode(text, add_special_tokens=False)
    if not special:  # the markers as their characters' tokens: text, as in a vocabulary without them
        ids = [t for ch in text for t in tk.encode(ch, add_special_tokens=False)]
    return matcher.accept_tokens(ids) == len(ids) and matcher.is_terminated()


@pytest.mark.parametrize("special", [True, False])
def test_an_answers_schema_and_a_forced_call_come_after_the_analysis(byte_tokenizer, special):
    from infire_jax.structured import StructuredOutputs
    from infire_jax.structured.tool_grammar import tool_call_constraint
    tk = byte_tokenizer
    ids = {t: tk.special_token_id(t) for t in harmony.SPECIAL_TOKENS} if special else {}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    answer = StructuredOutputs(json=schema, after=harmony.answer_grammar(ids))
    thought = "<|channel|>analysis<|message|>Think < twice.<|end|><|start|>assistant"
    for text, ok in ((thought + '<|channel|>final<|message|>{"a": 1}', True),
                     ('<|channel|>final<|message|>{"a": 1}', True),
                     (thought + thought + '<|channel|>final<|message|>{"a": 1}', True),
                     (thought + '<|channel|>final<|message|>{"b": 1}', False),
                     ('<|channel|>commentary<|message|>{"a": 1}', False)):
        assert accepts(tk, answer, text, special) == ok, text
    forced = tool_call_constraint("openai", [{"name": "f", "parameters": schema}, {"name": "g"}], parallel=True,
                                  special_token_ids=ids)
    for text, ok in ((thought + '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>',
                      True),
                     ('<|channel|>commentary to=functions.g <|constrain|>json<|message|>{}<|call|>', True),
                     ('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>', False),
                     ('<|channel|>commentary to=functions.h <|constrain|>json<|message|>{}<|call|>', False)):
        assert accepts(tk, forced, text, special) == ok, text
        if ok:
            assert [c.name for c in parse_harmony(text)[2]] == [text.split("functions.")[1].split(" ")[0]]


def test_a_harmony_request_stops_at_return_and_call_and_keeps_the_special_tokens():
    from server.endpoints import _harmony_stops, _reasoning
    from server.protocol import parse_chat
    tk = tokenizer()
    m = types.SimpleNamespace(tokenizer=tk, reasoning_parser="openai_gptoss")
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [5]})
    _harmony_stops(m, req)
    _reasoning(m, req)
    assert req.params.stop_token_ids == [5, tk.token_to_id("<|return|>"), tk.token_to_id("<|call|>")]
    assert req.params.skip_special_tokens is False
    constrained = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object"}})
    _reasoning(m, constrained)  # the answer's constraint waits for the final channel
    ids = {t: tk.special_token_id(t) for t in harmony.SPECIAL_TOKENS}
    assert constrained.params.structured_outputs.after == harmony.answer_grammar(ids)


def test_reasoning_effort_reaches_the_template_from_chat_and_responses():
    from server.protocol import parse_chat
    from server.responses_api import ResponseStore, parse_request
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat(base | {"reasoning_effort": "high"}).chat_template_kwargs == {"reasoning_effort": "high"}
    assert parse_chat(base).chat_template_kwargs == {}
    r = parse_request({"model": "m", "input": "hi", "reasoning": {"effort": "low"}}, ResponseStore(), None)
    assert r.chat.chat_template_kwargs == {"reasoning_effort": "low"}
    assert r.echo["reasoning"] == {"effort": "low", "summary": None}
    assert "Reasoning: low\n" in render(r.chat.messages, **r.chat.chat_template_kwargs)
    for body, param in ((base | {"reasoning_effort": "max"}, "reasoning_effort"),
                        (base | {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
                         "reasoning_effort")):
        with pytest.raises(APIError) as e:
            parse_chat(body)
        assert e.value.status == 400 and e.value.param == param
    for reasoning, param in (({"effort": "max"}, "reasoning.effort"), ({"summary": "auto"}, "reasoning.summary")):
        with pytest.raises(APIError) as e:
            parse_request({"model": "m", "input": "hi", "reasoning": reasoning}, ResponseStore(), None)
        assert e.value.status == 400 and e.value.param == param, e.value.message
