"""The engine's exceptions as OpenAI errors (server/api_error.py), and the middleware that answers with them."""

from __future__ import annotations

import logging

from aiohttp import web

from infire_jax.engine.async_engine import EngineDeadError, QueueFullError
from infire_jax.errors import DeviceMemoryError, InvalidRequestError
from server.api_error import APIError, http_error

log = logging.getLogger(__name__)


def to_api_error(exc: BaseException) -> APIError:
    """Maps any exception a handler raised to the error the client gets."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), type="rate_limit_error", code="queue_full")
    if isinstance(exc, DeviceMemoryError):  # a model that did not fit on the device (it may fit later)
        return APIError(503, str(exc), type="server_error", code="device_memory")
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc), type="server_error", code="engine_dead")
    if isinstance(exc, web.HTTPException):  # aiohttp's own: unknown route, wrong method, body too large
        return http_error(exc)
    log.error("unhandled error in a request handler", exc_info=exc)
    return APIError(500, f"internal server error: {exc!r}", type="server_error")


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Turns every exception (ours or aiohttp's) into an OpenAI error response."""
    try:
        return await handler(request)
    except Exception as e:  # noqa: BLE001 - the client always gets an error object
        return to_api_error(e).response()
