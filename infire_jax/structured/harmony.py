"""gpt-oss's harmony format: its chat template (templates/gpt_oss.jinja), its output read as it streams,
and the grammars that constrain an answer or force a call after the model's free analysis.

The output is a series of messages, each `{header}<|message|>{body}` ended by `<|end|>`, `<|return|>`
(the answer is done) or `<|call|>` (a tool is called); the next begins with `<|start|>assistant`. The
header names the channel (`<|channel|>analysis`, `commentary` or `final`) and, for a call, its recipient
(`to=functions.NAME`, in the role's part or the channel's, with an optional `<|constrain|>json`).

`HarmonyStream` turns the text into ordered parts, as vLLM's `openai_gptoss` reasoning parser and
`openai` tool-call parser read it: `analysis` bodies are reasoning, a body to `functions.NAME` is a call
with JSON arguments, any other body (`final`, a `commentary` preamble) is content. Output that is not
harmony (a header that never ends, text between messages, a call whose arguments are not a JSON object,
an output cut off mid-header) is content, never an error. As in tool_parsers, the stream decides only
on the text it has, so every split of one output gives the same parts.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import re
from collections.abc import Callable, Iterable
from typing import Any

from infire_jax.loaders.tokenizer import Tokenizer
from infire_jax.structured.backend import inline_json
from infire_jax.structured.tool_formats.base import ToolCall, dumps, held_back, json_object

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
STOP_TOKENS = (RETURN, CALL)  # where generation ends (the format's two stop tokens)
SPECIAL_TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
REASONING_PARSER, TOOL_PARSER = "openai_gptoss", "openai"  # vLLM's names for the two halves
REASONING, CONTENT, CALLS = "reasoning", "content", "call"  # the kinds of parts
MODEL_TYPE = "gpt_oss"  # config.json's model_type of the models trained on it

_TERMINATORS = (END, RETURN, CALL)
_BODY_ENDS = _TERMINATORS + (START,)  # a body also ends where a new message begins without an end
_MAX_HEADER = 256  # characters: a longer header is not one (the text is content)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"\s*([A-Za-z_]+)")
_HEADER, _BODY, _BETWEEN = "header", "body", "between"

Part = tuple[str, "str | ToolCall"]  # (REASONING or CONTENT, text) or (CALLS, the call)


@functools.cache
def chat_template() -> str:
    """The harmony chat template we ship (the engine's for model_type gpt_oss, or `--chat-template`)."""
    return importlib.resources.files("infire_jax.structured").joinpath("templates/gpt_oss.jinja").read_text()


def model_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer an engine renders chats with: for a gpt_oss model, with our harmony template in
    place of the model's own (ours passes the reasoning of earlier tool-calling turns back, and the
    harmony parsers are tested against what it writes)."""
    return tokenizer.with_chat_template(chat_template()) if tokenizer.model_type == MODEL_TYPE else tokenizer


def is_harmony(chat_template_text: str | None) -> bool:
    """Whether a chat template writes harmony (ours or gpt-oss's own)."""
    return bool(chat_template_text) and START in chat_template_text and CHANNEL in chat_template_text


class HarmonyStream:
    """One choice's harmony output as ordered parts, delta by delta.

    `reasoning`: analysis bodies are reasoning (else content, as without a reasoning parser);
    `calls`: bodies to `functions.NAME` are calls (else their text is content, as when no tools were
    offered)."""

    def __init__(self, reasoning: bool = True, calls: bool = True):
        self._reasoning, self._calls = reasoning, calls
        self._state = _HEADER  # the prompt ends in `<|start|>assistant`: the output opens with a header
        self._buf = ""  # text not decided yet
        self._kind = CONTENT  # the open body's
        self._name = ""  # the open call's function
        self._args = ""  # the open call's body so far

    def feed(self, delta: str) -> list[Part]:
        self._buf += delta
        return merged(self._advance(final=False))

    def finish(self) -> list[Part]:
        """What is left at the end of the output (a body cut off is still its kind; a cut-off call is
        content unless its arguments are already a whole JSON object)."""
        return merged(self._advance(final=True))

    def _advance(self, final: bool) -> list[Part]:
        out: list[Part] = []
        while True:
            step = {_HEADER: self._header, _BODY: self._body, _BETWEEN: self._between}[self._state]
            if not step(final, out):
                return out

    # Each step consumes what it can decide from self._buf and says whether to go on.
    def _header(self, final: bool, out: list[Part]) -> bool:
        at, marker = _first(self._buf, (MESSAGE,) + _BODY_ENDS)
        if 0 <= at <= _MAX_HEADER:
            header, self._buf = self._buf[:at], self._buf[at + len(marker):]
            if marker == MESSAGE:
                self._open(header)
                return True
            out.append((CONTENT, header))  # a header with no body is not harmony
            self._state = _HEADER if marker == START else _BETWEEN
            return True
        if len(self._buf) > _MAX_HEADER + len(MESSAGE) or final:  # no header ends here: free text
            self._state, self._kind = _BODY, CONTENT
            return True
        return False

    def _open(self, header: str) -> None:
        recipient = _RECIPIENT.search(header)
        _, _, channel_part = header.partition(CHANNEL)
        channel = _CHANNEL_NAME.match(channel_part)
        self._state, self._kind = _BODY, CONTENT
        if recipient is not None and recipient.group(1).startswith("functions.") and self._calls:
            self._kind, self._name, self._args = CALLS, recipient.group(1).removeprefix("functions."), ""
        elif channel is not None and channel.group(1) == "analysis" and self._reasoning:
            self._kind = REASONING

    def _body(self, final: bool, out: list[Part]) -> bool:
        at, marker = _first(self._buf, _BODY_ENDS)
        if at < 0:
            keep = 0 if final else max(held_back(self._buf, m) for m in _BODY_ENDS)
            self._emit(self._buf[:len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep:]
            if final:
                self._close(out)
            return False
        self._emit(self._buf[:at], out)
        self._buf = self._buf[at + len(marker):]
        self._close(out)
        self._state = _HEADER if marker == START else _BETWEEN
        return True

    def _emit(self, text: str, out: list[Part]) -> None:
        if self._kind == CALLS:
            self._args += text
        elif text:
            out.append((self._kind, text))

    def _close(self, out: list[Part]) -> None:
        """Ends the open body: a call's arguments are read now, and are content if not a JSON object."""
        if self._kind == CALLS:
            args = json_object(self._args.strip())
            if args is None or not self._name:
                out.append((CONTENT, self._args))
            else:
                out.append((CALLS, ToolCall(self._name, dumps(args))))
        self._kind, self._args = CONTENT, ""

    def _between(self, final: bool, out: list[Part]) -> bool:
        """After a message: blank space up to the next `<|start|>` is nothing; other text is content."""
        at = self._buf.find(START)
        gap = self._buf[:at] if at >= 0 else self._buf[:len(self._buf) - (0 if final else held_back(self._buf, START))]
        if gap.strip():
            self._state, self._kind = _BODY, CONTENT
            return True
        if at >= 0:
            self._buf, self._state = self._buf[at + len(START):], _HEADER
            return True
        if final:
            self._buf = ""
        return False


def _marks(special_ids: dict[str, int | None] | None) -> Callable[[str], str]:
    """A marker in Lark: the special token where the tokenizer has it (text never spells one), else text."""
    ids = special_ids or {}
    return lambda m: f"<[{ids[m]}]>" if ids.get(m) is not None else json.dumps(m)


def _analysis_rules(mark: Callable[[str], str]) -> list[str]:
    """Lark: `analysis`, one analysis message of free text and the header of the message after it.
    The text ends at the first `<|end|>` (a lazy lexeme where `<|end|>` is text)."""
    head = f'{mark(CHANNEL)} "analysis" {mark(MESSAGE)}'
    after = f'{mark(START)} "assistant"'
    if mark(END).startswith("<["):
        return ["THOUGHT: /(?s:.*)/", f"analysis: {head} THOUGHT {mark(END)} {after}"]
    return [f"THOUGHT: /(?s:.*)/ {mark(END)}", "thought[lazy]: THOUGHT", f"analysis: {head} thought {after}"]


def answer_grammar(special_ids: dict[str, int | None] | None = None) -> str:
    """The Lark grammar of what a harmony output holds before a constrained answer (`response_format`):
    analysis messages, then the final channel's header; its start rule ends in `@answer`
    (`StructuredOutputs.after`). `special_ids`: harmony's special tokens that the tokenizer has."""
    mark = _marks(special_ids)
    return "\n".join([f'start: analysis* {mark(CHANNEL)} "final" {mark(MESSAGE)} @answer',
                      *_analysis_rules(mark)]) + "\n"


def call_grammar(functions: list[dict[str, Any]], special_ids: dict[str, int | None] | None = None) -> str:
    """The Lark grammar of a forced call (`tool_choice` required or named) in harmony: analysis
    messages, then one commentary message to one of `functions` whose body is its arguments' JSON
    object, ended by `<|call|>` (which stops generation: one call a turn)."""
    mark = _marks(special_ids)
    calls = []
    for i, f in enumerate(functions):
        schema = (f.get("parameters") or {"type": "object", "properties": {}}) | {"type": "object"}
        calls.append(f'call{i}: {mark(CHANNEL)} {json.dumps("commentary to=functions." + f["name"] + " ")} '
                     f'{mark(CONSTRAIN)} "json" {mark(MESSAGE)} {inline_json(schema)} {mark(CALL)}')
    return "\n".join(["start: analysis* call", f"call: {' | '.join(f'call{i}' for i in range(len(functions)))}",
                      *calls, *_analysis_rules(mark)]) + "\n"


def _first(text: str, markers: Iterable[str]) -> tuple[int, str]:
    """The first of `markers` in `text` (position, marker); (-1, "") when none is there."""
    found = [(at, m) for m in markers if (at := text.find(m)) >= 0]
    return min(found) if found else (-1, "")


def merged(parts: list[Part]) -> list[Part]:
    """Adjacent texts of one kind as one part; empty texts dropped (a delta's parts are sent this way)."""
    out: list[Part] = []
    for kind, value in parts:
        if kind != CALLS and not value:
            continue
        if out and kind != CALLS and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + value)
        else:
            out.append((kind, value))
    return out


def parse_harmony(text: str, reasoning: bool = True, calls: bool = True) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, content, calls) of a whole output."""
    return stream_harmony([text], reasoning, calls)


def stream_harmony(deltas: Iterable[str], reasoning: bool = True,
                   calls: bool = True) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, content, calls) of an output given as deltas: the same as `parse_harmony` of their
    concatenation, whatever the split."""
    stream = HarmonyStream(reasoning, calls)
    parts = [p for d in deltas for p in stream.feed(d)] + stream.finish()
    return ("".join(v for k, v in parts if k == REASONING), "".join(v for k, v in parts if k == CONTENT),
            [v for k, v in parts if k == CALLS])
