"""The router's own OpenAI errors, and its middleware. `APIError` comes from server/api_error.py, not
server/errors.py: that one maps the engine's exceptions and imports the engine (and jax)."""

from __future__ import annotations

import logging

from aiohttp import web

from server.api_error import APIError, http_error

log = logging.getLogger(__name__)


def worker_unavailable(url: str, why: str, status: int = 503) -> APIError:
    """A worker failed this request: 502 when its connection broke, 503 when it was marked down."""
    return APIError(status, f"worker {url} {why}", type="server_error", code="worker_unavailable")


def no_healthy_worker(pool: str | None) -> APIError:
    """`pool`: the role the request needed, where the fleet has workers of several roles."""
    return APIError(503, f"no healthy {pool + ' ' if pool else ''}worker", type="server_error",
                    code="no_healthy_worker")


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Turns every exception (ours or aiohttp's) into an OpenAI error response."""
    try:
        return await handler(request)
    except APIError as e:
        return e.response()
    except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body too large
        return http_error(e).response()
    except Exception as e:  # noqa: BLE001 - the client always gets an error object
        log.error("unhandled error in a router handler", exc_info=e)
        return APIError(500, f"internal router error: {e!r}", type="server_error").response()
