"""Reasoning and tool calls in chat responses: `message.reasoning` and `message.tool_calls` whole, or
`delta.reasoning` and OpenAI-style `delta.tool_calls` chunks.

Each choice's text goes first through the model's reasoning parser, when the server has one
(infire_jax/structured/reasoning_parsers.py), then its answer alone through a ToolCallStream in the
model's call format (infire_jax/structured/tool_parsers.py): a call written while thinking is not
a call. gpt-oss's harmony output (infire_jax/structured/harmony.py) names its channels itself: one
HarmonyStream splits it into reasoning, content and calls. A choice that called tools and stopped on
its own finishes with "tool_calls".

The parts of a choice keep their order, and a streamed delta carries one kind of part only: a step
that ends the reasoning and begins the answer is sent as two chunks.
"""

from __future__ import annotations

from typing import Any

from infire_jax.structured import harmony
from infire_jax.structured.harmony import CALLS, CONTENT, REASONING, HarmonyStream, Part
from infire_jax.structured.reasoning_parsers import ReasoningStream
from infire_jax.structured.tool_parsers import ToolCall, ToolCallStream

_DELTA_KEY = {REASONING: "reasoning", CONTENT: "content"}


def finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


class ChoiceParser:
    """One choice's output split into reasoning, content and tool calls, delta by delta.

    `tool_format`: the call format when the request offers tools (None: the answer is all content);
    `tools`: the request's tools, which typing Qwen3-Coder's raw values needs; `reasoning_parser`:
    the server's (None: no reasoning), with the request's `chat_template_kwargs`."""

    def __init__(self, tool_format: str | None, tools: list[dict[str, Any]] | None = None,
                 reasoning_parser: str | None = None, chat_template_kwargs: dict[str, Any] | None = None):
        harmony_reasoning = reasoning_parser == harmony.REASONING_PARSER
        harmony_calls = tool_format == harmony.TOOL_PARSER
        self._harmony = HarmonyStream(harmony_reasoning, harmony_calls) if harmony_reasoning or harmony_calls else None
        self._reasoning = ReasoningStream(reasoning_parser, chat_template_kwargs) \
            if reasoning_parser and self._harmony is None else None
        self._tools = ToolCallStream(tool_format, tools) if tool_format and not harmony_calls else None
        self.calls: list[ToolCall] = []  # every call handed out so far

    def feed(self, text: str, finished: bool) -> list[Part]:
        """The parts that `text` completes, in order; `finished`: it ends the output."""
        if self._harmony is not None:
            parts = self._harmony.feed(text) + (self._harmony.finish() if finished else [])
        else:
            reasoning = ""
            if self._reasoning is not None:
                reasoning, text = self._reasoning.feed(text)
                if finished:
                    more, rest = self._reasoning.finish()
                    reasoning, text = reasoning + more, text + rest
            parts = [(REASONING, reasoning), (CONTENT, text)]
        if self._tools is not None:
            parts = self._answer_calls(parts, finished)
        out = harmony.merged(parts)
        self.calls += [v for k, v in out if k == CALLS]
        return out

    def _answer_calls(self, parts: list[Part], finished: bool) -> list[Part]:
        """The content parts through the call format's stream."""
        out: list[Part] = []
        for kind, value in parts:
            if kind == CONTENT:
                content, calls = self._tools.feed(value)
                out += [(CONTENT, content)] + [(CALLS, c) for c in calls]
            else:
                out.append((kind, value))
        if finished:
            content, calls = self._tools.finish()
            out += [(CONTENT, content)] + [(CALLS, c) for c in calls]
        return out


def message(parser: ChoiceParser, text: str, reason: str | None,
            with_reasoning: bool) -> tuple[dict[str, Any], str | None]:
    """A whole choice's assistant message and finish reason; `with_reasoning`: the server has a
    reasoning parser, so the message carries `reasoning` (null when there is none)."""
    parts = parser.feed(text, finished=True)
    reasoning = "".join(v for k, v in parts if k == REASONING)
    content = "".join(v for k, v in parts if k == CONTENT)
    calls = [v for k, v in parts if k == CALLS]
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if with_reasoning:
        msg["reasoning"] = reasoning or None
    if calls:
        msg["tool_calls"] = [c.to_openai() for c in calls]
    return msg, finish_reason(reason, calls)


def deltas(parser: ChoiceParser, text: str, finished: bool,
           reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """(the `delta` objects, one per run of a kind of part, the finish reason) of one step of a
    streamed choice."""
    before = len(parser.calls)
    out: list[dict[str, Any]] = []
    for kind, value in parser.feed(text, finished):
        if kind != CALLS:
            out.append({_DELTA_KEY[kind]: value})
            continue
        call = value.to_openai() | {"index": before}
        before += 1
        if out and "tool_calls" in out[-1]:
            out[-1]["tool_calls"].append(call)
        else:
            out.append({"tool_calls": [call]})
    return out, finish_reason(reason, parser.calls)
