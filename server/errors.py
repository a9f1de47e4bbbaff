"""OpenAI error objects: every failure a client sees is `{"error": {message, type, param, code}}`."""

from __future__ import annotations

import logging

from aiohttp import web

from infire_jax.async_engine import EngineDeadError, QueueFullError
from infire_jax.errors import InvalidRequestError

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

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def to_api_error(exc: BaseException) -> APIError:
    """Maps any exception a handler raised to the error the client gets."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), type="rate_limit_error", code="queue_full")
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc), type="server_error", code="engine_dead")
    if isinstance(exc, web.HTTPException):  # aiohttp's own: unknown route, wrong method, body too large
        return APIError(exc.status, exc.reason, type="invalid_request_error" if exc.status < 500 else "server_error")
    log.error("unhandled error in a request handler", exc_info=exc)
    return APIError(500, f"internal server error: {exc!r}", type="server_error")


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Turns every exception (ours or aiohttp's) into an OpenAI error response."""
    try:
        return await handler(request)
    except Exception as e:  # noqa: BLE001 - the client always gets an error object
        return to_api_error(e).response()
