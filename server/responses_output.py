"""The output of a Responses API response (server/responses_api.py): its items and the stream events
that build them.

One choice's text goes through the chat path's ChoiceParser (server/tool_calls.py): its reasoning,
answer text and function calls, in the order they complete. Reasoning and answer text become a `reasoning`
and a `message` item whose text streams in; each call becomes a `function_call` item, sent whole.
A whole (non-streaming) response is built the same way with its events dropped, so both give the
same items.
"""

from __future__ import annotations

import uuid
from typing import Any

from infire_jax.structured.harmony import CALLS
from infire_jax.structured.tool_parsers import ToolCall
from server.tool_calls import ChoiceParser

COMPLETED, INCOMPLETE, IN_PROGRESS = "completed", "incomplete", "in_progress"
REASONING, MESSAGE = "reasoning", "message"


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseOutput:
    """A response's output items, and the events (numbered from 0 with `sequence_number`) that a
    stream sends as they grow. `event` numbers the response's own lifecycle events too."""

    def __init__(self, parser: ChoiceParser):
        self._parser = parser
        self.items: list[dict[str, Any]] = []
        self.reasoning = ""  # all reasoning text (usage counts its tokens)
        self._open: dict[str, Any] | None = None  # the reasoning or message item whose text is streaming
        self._text = ""  # its text so far
        self._seq = 0

    def event(self, type: str, **fields: Any) -> dict[str, Any]:
        out = {"type": type, "sequence_number": self._seq} | fields
        self._seq += 1
        return out

    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The events of one delta of the output; `finished`: it is the last."""
        events = []
        for kind, value in self._parser.feed(text, finished):
            if kind == CALLS:
                events += self._close(COMPLETED) + self._call(value)
            elif kind == REASONING:
                self.reasoning += value
                events += self._stream_text(REASONING, value)
            else:
                events += self._stream_text(MESSAGE, value)
        return events

    def finish(self, status: str) -> list[dict[str, Any]]:
        """The events that end the output, `status` being the response's: the streaming item ends
        with it. An output with nothing in it still has its (empty) message."""
        events = [] if self.items else self._open_item(MESSAGE)
        return events + self._close(status)

    # ---- items ---------------------------------------------------------------------------------
    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _open_item(self, kind: str) -> list[dict[str, Any]]:
        if kind == REASONING:
            item = {"type": REASONING, "id": new_id("rs"), "summary": [], "content": [], "status": IN_PROGRESS}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": MESSAGE, "id": new_id("msg"), "role": "assistant", "status": IN_PROGRESS, "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
        self.items.append(item)
        self._open, self._text = item, ""
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)),
                self.event("response.content_part.added", **self._where(), content_index=0, part=part)]

    def _stream_text(self, kind: str, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = []
        if self._open is None or self._open["type"] != kind:
            events = self._close(COMPLETED) + self._open_item(kind)
        self._text += text
        extra = {"logprobs": []} if kind == MESSAGE else {}
        name = "response.reasoning_text.delta" if kind == REASONING else "response.output_text.delta"
        return events + [self.event(name, **self._where(), content_index=0, delta=text, **extra)]

    def _close(self, status: str) -> list[dict[str, Any]]:
        """Ends the streaming item, if any, with `status`."""
        item = self._open
        if item is None:
            return []
        if item["type"] == REASONING:
            part = {"type": "reasoning_text", "text": self._text}
            done = self.event("response.reasoning_text.done", **self._where(), content_index=0, text=self._text)
        else:
            part = {"type": "output_text", "text": self._text, "annotations": []}
            done = self.event("response.output_text.done", **self._where(), content_index=0, text=self._text,
                              logprobs=[])
        item.update(content=[part], status=status)
        events = [done, self.event("response.content_part.done", **self._where(), content_index=0, part=part),
                  self.event("response.output_item.done", output_index=len(self.items) - 1, item=item)]
        self._open = None
        return events

    def _call(self, call: ToolCall) -> list[dict[str, Any]]:
        item = {"type": "function_call", "id": new_id("fc"), "call_id": call.id, "name": call.name, "arguments": "",
                "status": IN_PROGRESS}
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        events = [self.event("response.output_item.added", output_index=where["output_index"], item=dict(item)),
                  self.event("response.function_call_arguments.delta", **where, delta=call.arguments),
                  self.event("response.function_call_arguments.done", **where, arguments=call.arguments)]
        item.update(arguments=call.arguments, status=COMPLETED)
        return events + [self.event("response.output_item.done", output_index=where["output_index"], item=item)]
