"""`infire-jax router`: the flags, the aiohttp application, and `run_router(args)` for the CLI.

Pools: `--worker` replicas (role `both`) serve requests whole; `--prefill` and `--decode` workers
split them (the prefill worker computes the prompt's KV, the decode worker pulls it and generates).
Both forms may be mixed: replicas then join the decode workers as targets, and only requests sent
to a `decode` worker are prefilled remotely. The router is a light process: no engine, no JAX.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections import OrderedDict
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from infire_jax import __version__
from router.errors import error_middleware
from router.passthrough import (OWNERS, create_response, detokenize, retrieve_response, tokenize,
                                tokenizer_info)
from router.metrics import CONTENT_TYPE, RouterMetrics
from router.policy import POLICIES, Policy
from router.proxy import (DECODE_ROLES, STATE, RouterState, chat_completions, completions, embeddings, models, rerank,
                          score)
from router.workers import HealthMonitor, Worker
from server.listen import bind, serve_until_signal

MONITOR = web.AppKey("monitor", HealthMonitor)
_MAX_BODY = 64 << 20  # bytes, as the workers take


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """workers: (url, role) pairs, role one of prefill, decode, both; validated on construction."""

    workers: tuple[tuple[str, str], ...]
    policy: str = "cache_aware"
    affinity: bool = True
    disagg_min_tokens: int = 256
    health_interval: float = 1.0
    health_timeout: float = 2.0
    request_timeout: float = 600.0

    def __post_init__(self) -> None:
        roles = [role for _, role in self.workers]
        if not roles:
            raise ValueError("give --worker URLs, or --prefill and --decode URLs")
        if ("prefill" in roles) != ("decode" in roles):
            raise ValueError("disaggregation needs at least one --prefill and one --decode worker")
        urls = [url for url, _ in self.workers]
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.path or parts.query:
                raise ValueError(f"worker URL {url!r}: expected http://HOST:PORT")
        if len(set(urls)) != len(urls):
            raise ValueError("a worker URL is given twice")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}")
        if self.disagg_min_tokens < 0:
            raise ValueError("--disagg-min-tokens must be >= 0")
        for name in ("health_interval", "health_timeout", "request_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (the ready line names it)")
    p.add_argument("--prefill", action="append", default=[], metavar="URL", help="a prefill worker (repeatable)")
    p.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode worker (repeatable)")
    p.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="a replica that prefills and decodes (role both; repeatable)")
    p.add_argument("--policy", default="cache_aware", choices=POLICIES,
                   help="how requests without a session choose their worker (default cache_aware)")
    p.add_argument("--no-affinity", action="store_true",
                   help="route x-session-affinity requests by --policy too (default: by rendezvous hashing)")
    p.add_argument("--disagg-min-tokens", type=int, default=256,
                   help="prefill remotely only when the decode worker lacks this many prompt tokens (default 256; "
                        "0 always)")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between /health probes (default 1)")
    p.add_argument("--health-timeout", type=float, default=2.0, help="seconds a probe may take (default 2)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds until a worker's first byte (default 600)")


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The config of the flags; raises ValueError for bad ones."""
    workers = [(url.rstrip("/"), role) for flag, role in (("prefill", "prefill"), ("decode", "decode"),
                                                           ("worker", "both")) for url in getattr(args, flag)]
    return RouterConfig(workers=tuple(workers), policy=args.policy, affinity=not args.no_affinity,
                        disagg_min_tokens=args.disagg_min_tokens, health_interval=args.health_interval,
                        health_timeout=args.health_timeout, request_timeout=args.request_timeout)


def build_router_app(config: RouterConfig) -> web.Application:
    """The app; starting it probes every worker once, then keeps probing in the background."""
    workers = [Worker(url, role) for url, role in config.workers]
    app = web.Application(middlewares=[error_middleware], client_max_size=_MAX_BODY)
    app[STATE] = RouterState(workers=workers, policy=Policy(config.policy, affinity=config.affinity),
                             metrics=RouterMetrics(workers), disagg_min_tokens=config.disagg_min_tokens,
                             request_timeout=config.request_timeout)
    app[MONITOR] = HealthMonitor(workers, config.health_interval, config.health_timeout)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/embeddings", embeddings)
    for path in ("/score", "/v1/score"):
        app.router.add_post(path, score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.router.add_post(path, rerank)
    app.router.add_get("/v1/models", models)
    app[OWNERS] = OrderedDict()
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/health", _health)
    for method in ("GET", "POST"):  # vLLM's (SageMaker's health check): /health's answer
        app.router.add_route(method, "/ping", _health)
    app.router.add_get("/version", _version)
    app.router.add_get("/metrics", _metrics)
    app.on_startup.append(_start)
    app.on_cleanup.append(_stop)
    return app


async def _start(app: web.Application) -> None:
    # One session for all proxied requests: no connection limit, no total timeout (streams are long).
    app[STATE].session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                               timeout=aiohttp.ClientTimeout(total=None))
    await app[MONITOR].start()


async def _stop(app: web.Application) -> None:
    await app[MONITOR].stop()
    await asyncio.gather(*app[STATE].releases, return_exceptions=True)  # holds released for cancelled requests
    await app[STATE].session.close()


async def _health(request: web.Request) -> web.Response:
    """Ok while some decode target is healthy (without prefill workers, decode workers prefill locally)."""
    st = request.app[STATE]
    ok = bool(st.healthy(DECODE_ROLES))
    workers = [{"url": w.url, "role": w.role, "healthy": w.healthy, "in_flight": w.in_flight} for w in st.workers]
    return web.json_response({"status": "ok" if ok else "unhealthy", "workers": workers}, status=200 if ok else 503)


async def _version(request: web.Request) -> web.Response:
    """vLLM's `/version`: this engine's (the router's package, jax-free)."""
    return web.json_response({"version": __version__})


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[STATE].metrics.render(), headers={"Content-Type": CONTENT_TYPE})


def run_router(args: argparse.Namespace) -> int:
    """`infire-jax router`: bind, probe the workers, listen, print the ready line, serve until SIGINT/SIGTERM."""
    try:
        config = config_from_args(args)
        sock = bind(args.host, args.port)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with sock:
        asyncio.run(serve_until_signal(build_router_app(config), sock, args.host))
    return 0
