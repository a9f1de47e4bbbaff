"""CORS as vLLM's --allowed-origins/--allowed-methods/--allowed-headers/--allow-credentials set it up
(Starlette's CORSMiddleware): browsers on other origins may call the API. Off unless origins are given."""

from __future__ import annotations

import dataclasses

from aiohttp import web

_ALL_METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"


@dataclasses.dataclass(frozen=True)
class CorsPolicy:
    origins: tuple[str, ...]
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    def allow_origin(self, origin: str) -> str | None:
        """The Access-Control-Allow-Origin answer to `origin`, or None when it is not allowed."""
        if "*" in self.origins:
            return origin if self.credentials else "*"  # a credentialed answer may not be "*"
        return origin if origin in self.origins else None


CORS = web.AppKey("cors", CorsPolicy)


@web.middleware
async def cors_middleware(request: web.Request, handler):
    """Answers preflights (OPTIONS with Access-Control-Request-Method) before auth and routing."""
    policy = request.app.get(CORS)
    origin = request.headers.get("Origin")
    if policy is None or origin is None or request.method != "OPTIONS" \
            or "Access-Control-Request-Method" not in request.headers:
        return await handler(request)
    allowed = policy.allow_origin(origin)
    if allowed is None:
        return web.Response(status=400, text="Disallowed CORS origin")
    asked = request.headers.get("Access-Control-Request-Headers", "")
    return web.Response(headers={
        "Access-Control-Allow-Methods": _ALL_METHODS if "*" in policy.methods else ", ".join(policy.methods),
        "Access-Control-Allow-Headers": asked if "*" in policy.headers else ", ".join(policy.headers),
        "Access-Control-Max-Age": "600"})


async def cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer (streamed ones too, before their headers go) to an allowed origin says so."""
    policy = request.app.get(CORS)
    origin = request.headers.get("Origin")
    allowed = policy.allow_origin(origin) if policy is not None and origin is not None else None
    if allowed is None:
        return
    response.headers["Access-Control-Allow-Origin"] = allowed
    if allowed != "*":
        response.headers["Vary"] = "Origin"
    if policy.credentials:
        response.headers["Access-Control-Allow-Credentials"] = "true"
