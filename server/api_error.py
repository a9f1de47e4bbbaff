"""OpenAI error objects: every failure a client sees is `{"error": {message, type, param, code}}`.

No engine and no jax here: the workers (server/errors.py maps the engine's exceptions) and the
router (router/errors.py) both build their answers from this.
"""

from __future__ import annotations

import json

from aiohttp import web


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def event(self) -> bytes:
        """The error as the last server-sent event of a stream whose headers are already sent."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def http_error(exc: web.HTTPException) -> APIError:
    """aiohttp's own errors (unknown route, wrong method, body too large) as OpenAI errors."""
    return APIError(exc.status, exc.reason, type="invalid_request_error" if exc.status < 500 else "server_error")
