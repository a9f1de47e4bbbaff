"""Tool calls in chat responses: `message.tool_calls` whole, or OpenAI-style `delta.tool_calls` chunks.

Each choice's text goes through a ToolCallStream (infire_jax/structured/tool_parsers.py) in the
model's format; a choice that called tools and stopped on its own finishes with "tool_calls".
"""

from __future__ import annotations

from typing import Any

from infire_jax.structured.tool_parsers import ToolCall, ToolCallStream


def finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def message(fmt: str, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole choice's assistant message and finish reason."""
    stream = ToolCallStream(fmt)
    content, _ = stream.feed(text)
    rest, _ = stream.finish()
    content += rest
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not stream.calls else None}
    if stream.calls:
        msg["tool_calls"] = [c.to_openai() for c in stream.calls]
    return msg, finish_reason(reason, stream.calls)


class StreamedToolCalls:
    """The deltas of the choices of one streamed response."""

    def __init__(self, fmt: str):
        self._fmt = fmt
        self._streams: dict[int, ToolCallStream] = {}

    def delta(self, index: int, text: str, finished: bool, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(the `delta` object, the finish reason) of one step of choice `index`."""
        stream = self._streams.setdefault(index, ToolCallStream(self._fmt))
        before = len(stream.calls)
        content, _ = stream.feed(text)
        if finished:
            rest, _ = stream.finish()
            content += rest
        out: dict[str, Any] = {"content": content} if content else {}
        new = stream.calls[before:]
        if new:
            out["tool_calls"] = [c.to_openai() | {"index": before + i} for i, c in enumerate(new)]
        return out, finish_reason(reason, stream.calls)
