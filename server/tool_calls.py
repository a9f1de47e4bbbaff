"""Reasoning and tool calls in chat responses: `message.reasoning` and `message.tool_calls` whole, or
`delta.reasoning` and OpenAI-style `delta.tool_calls` chunks.

Each choice's text goes first through the model's reasoning parser, when the server has one
(infire_jax/structured/reasoning_parsers.py), then its answer alone through a ToolCallStream in the
model's call format (infire_jax/structured/tool_parsers.py): a call written while thinking is not
a call. A choice that called tools and stopped on its own finishes with "tool_calls".
"""

from __future__ import annotations

from typing import Any

from infire_jax.structured.reasoning_parsers import ReasoningStream
from infire_jax.structured.tool_parsers import ToolCall, ToolCallStream


def finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


class ChoiceParser:
    """One choice's output split into reasoning, content and tool calls, delta by delta.

    `tool_format`: the call format when the request offers tools (None: the answer is all content);
    `tools`: the request's tools, which typing Qwen3-Coder's raw values needs; `reasoning_parser`:
    the server's (None: no reasoning), with the request's `chat_template_kwargs`."""

    def __init__(self, tool_format: str | None, tools: list[dict[str, Any]] | None = None,
                 reasoning_parser: str | None = None, chat_template_kwargs: dict[str, Any] | None = None):
        self._reasoning = ReasoningStream(reasoning_parser, chat_template_kwargs) if reasoning_parser else None
        self._tools = ToolCallStream(tool_format, tools) if tool_format else None

    @property
    def calls(self) -> list[ToolCall]:
        """Every call handed out so far."""
        return self._tools.calls if self._tools is not None else []

    def feed(self, text: str, finished: bool) -> tuple[str, str, list[ToolCall]]:
        """(reasoning, content, calls) that `text` completes; `finished`: it ends the output."""
        reasoning = ""
        if self._reasoning is not None:
            reasoning, text = self._reasoning.feed(text)
            if finished:
                more, rest = self._reasoning.finish()
                reasoning, text = reasoning + more, text + rest
        calls: list[ToolCall] = []
        if self._tools is not None:
            text, calls = self._tools.feed(text)
            if finished:
                rest, more_calls = self._tools.finish()
                text, calls = text + rest, calls + more_calls
        return reasoning, text, calls


def message(parser: ChoiceParser, text: str, reason: str | None,
            with_reasoning: bool) -> tuple[dict[str, Any], str | None]:
    """A whole choice's assistant message and finish reason; `with_reasoning`: the server has a
    reasoning parser, so the message carries `reasoning` (null when there is none)."""
    reasoning, content, calls = parser.feed(text, finished=True)
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if with_reasoning:
        msg["reasoning"] = reasoning or None
    if calls:
        msg["tool_calls"] = [c.to_openai() for c in calls]
    return msg, finish_reason(reason, calls)


def delta(parser: ChoiceParser, text: str, finished: bool, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """(the `delta` object, the finish reason) of one step of a streamed choice."""
    before = len(parser.calls)
    reasoning, content, calls = parser.feed(text, finished)
    out: dict[str, Any] = {}
    if reasoning:
        out["reasoning"] = reasoning
    if content:
        out["content"] = content
    if calls:
        out["tool_calls"] = [c.to_openai() | {"index": before + i} for i, c in enumerate(calls)]
    return out, finish_reason(reason, parser.calls)
