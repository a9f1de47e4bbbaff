"""OpenAI error objects, as the workers send them: `{"error": {message, type, param, code}}`.

The router's own copy: server.errors imports the engine (and JAX), which the router never loads.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web

log = logging.getLogger(__name__)


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


def worker_unavailable(url: str, why: str, status: int = 503) -> APIError:
    """A worker failed this request: 502 when its connection broke, 503 when it was marked down."""
    return APIError(status, f"worker {url} {why}", type="server_error", code="worker_unavailable")


def no_healthy_worker(pool: str) -> APIError:
    return APIError(503, f"no healthy {pool} worker", type="server_error", code="no_healthy_worker")


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Turns every exception (ours or aiohttp's) into an OpenAI error response."""
    try:
        return await handler(request)
    except APIError as e:
        return e.response()
    except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body too large
        return APIError(e.status, e.reason, type="invalid_request_error" if e.status < 500 else "server_error"
                        ).response()
    except Exception as e:  # noqa: BLE001 - the client always gets an error object
        log.error("unhandled error in a router handler", exc_info=e)
        return APIError(500, f"internal router error: {e!r}", type="server_error").response()
