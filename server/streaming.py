"""Server-sent events, as the OpenAI streaming APIs frame them: chat and completions send `data: <json>`
events, then `data: [DONE]`; the Responses API sends `event: <type>` and `data: <json>` pairs, its
last event being the end."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

_DONE = b"data: [DONE]\n\n"


class SSEWriter:
    """Writes events to one client. All events of one engine step go out in a single write."""

    def __init__(self, request: web.Request):
        self._request = request
        self.response = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})

    async def start(self) -> None:
        await self.response.prepare(self._request)

    async def send(self, events: list[dict[str, Any]]) -> None:
        if events:
            await self.response.write(b"".join(
                b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n" for e in events))

    async def send_typed(self, events: list[dict[str, Any]]) -> None:
        """Events named by their `type` (the Responses API's framing)."""
        if events:
            await self.response.write(b"".join(
                b"event: " + e["type"].encode() + b"\ndata: " + json.dumps(e, ensure_ascii=False).encode() + b"\n\n"
                for e in events))

    async def done(self) -> None:
        await self.response.write(_DONE)
        await self.response.write_eof()

    async def close(self) -> None:
        """The end of a stream whose last event says it ended (no `[DONE]`)."""
        await self.response.write_eof()
