"""The aiohttp application: routes, middlewares, start-up and shut-down, and `serve(args)` for the CLI.

Threads: the event loop (HTTP, tokenization, response building) and the engine thread (scheduling
and device steps, see infire_jax.async_engine). Nothing on the event loop waits for the device.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from aiohttp import web

from infire_jax.async_engine import AsyncEngine
from infire_jax.engine import Engine
from server.auth import AUTH, Auth, auth_middleware, parse_api_keys
from server.endpoints import (KV_PULLED, SESSION_HEADER, STATE, ServerState, chat_completions, completions,
                              release_kv)
from server.errors import error_middleware
from server.listen import bind, serve_until_signal
from server.kv_handoff import RELEASE_PATH, ROLES, KVHandoff
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.responses import TokenText

METRICS = web.AppKey("metrics", ServerMetrics)
_MAX_BODY = 64 << 20  # bytes; prompts of token ids are large


def build_app(engine: Engine, *, model_name: str | None = None, api_keys: dict[str, str] | None = None,
              max_queue: int = 1024, role: str = "both", kv_buffer_bytes: int = 512 << 20,
              kv_host: str = "127.0.0.1", kv_hold_seconds: float = 30.0) -> web.Application:
    """The app over an engine that is warmed up; the engine thread starts with the app.

    A prefill or decode worker (`role`) also runs a Mooncake transfer engine with a staging buffer
    of `kv_buffer_bytes` on `kv_host`, whose holds expire after `kv_hold_seconds`.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    name = model_name or engine.model_name
    metrics = ServerMetrics(name)
    async_engine = AsyncEngine(engine, max_queue=max_queue, observer=metrics)
    metrics.track_engine(lambda: async_engine.snapshot, engine.pool_sizing)
    handoff = None if role == "both" else KVHandoff(async_engine, role, buffer_bytes=kv_buffer_bytes, host=kv_host,
                                                    hold_seconds=kv_hold_seconds, metrics=metrics)
    if handoff is not None:
        metrics.track_holds(lambda: handoff.num_holds)

    app = web.Application(middlewares=[error_middleware, auth_middleware], client_max_size=_MAX_BODY)
    app[STATE] = ServerState(engine=async_engine, tokenizer=engine.tokenizer, token_text=TokenText(engine.tokenizer),
                             model_name=name, max_model_len=engine.max_model_len, role=role, handoff=handoff)
    app[AUTH] = Auth(api_keys or {})
    app[METRICS] = metrics
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post(RELEASE_PATH, release_kv)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.on_response_prepare.append(_routing_headers)
    app.on_startup.append(_start_engine)
    app.on_cleanup.append(_stop_engine)
    return app


async def _start_engine(app: web.Application) -> None:
    st = app[STATE]
    st.engine.start()
    if st.handoff is not None:
        await st.handoff.start()


async def _stop_engine(app: web.Application) -> None:
    st = app[STATE]
    if st.handoff is not None:
        await st.handoff.stop()
    await st.engine.shutdown()


async def _routing_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Echoes the session-affinity header (the router's routing key) and reports a KV import."""
    session = request.headers.get(SESSION_HEADER)
    if session is not None:
        response.headers[SESSION_HEADER] = session
    if KV_PULLED in request:
        pulled = request[KV_PULLED]
        response.headers["x-infire-kv-transfer"] = "imported" if pulled is not None else "failed"
        if pulled is not None:
            response.headers["x-infire-kv-bytes"] = str(pulled.num_bytes)
            response.headers["x-infire-kv-seconds"] = f"{pulled.seconds:.6f}"


async def _models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    return web.json_response({"object": "list", "data": [{
        "id": st.model_name, "object": "model", "created": int(time.time()), "owned_by": "infire-jax",
        "max_model_len": st.max_model_len}]})


async def _health(request: web.Request) -> web.Response:
    """Liveness and load, for routers: the role, sequences running and waiting, KV pool usage."""
    st = request.app[STATE]
    engine = st.engine
    if not engine.healthy:
        return web.json_response({"status": "unhealthy", "role": st.role, "error": repr(engine.error)}, status=503)
    s = engine.snapshot
    return web.json_response({"status": "ok", "role": st.role, "running": s.num_running, "waiting": s.num_waiting,
                              "kv_usage": s.kv_usage})


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE})


def serve(args: argparse.Namespace) -> int:
    """`infire-jax serve`: bind, load and warm up (with a progress bar), listen, print the ready line, serve."""
    from infire_jax.cli import engine_config, init_distributed, progress_bar

    if args.max_queue < 0:
        print("error: --max-queue must be >= 0", file=sys.stderr)
        return 2
    if args.kv_buffer_mb < 1 or args.kv_hold_seconds <= 0:
        print("error: --kv-buffer-mb must be >= 1 and --kv-hold-seconds > 0", file=sys.stderr)
        return 2
    try:
        keys = parse_api_keys(args.api_key or [])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if init_distributed(args):  # a multi-host follower: run process 0's steps, serve nothing
        Engine(engine_config(args)).follow()
        return 0
    try:
        sock = bind(args.host, args.port)  # before the slow warmup, so a taken port fails at once
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with sock:
        engine = Engine(engine_config(args), progress=progress_bar())
        print(engine.pool_sizing.describe(), file=sys.stderr, flush=True)
        app = build_app(engine, model_name=args.served_model_name, api_keys=keys, max_queue=args.max_queue,
                        role=args.role, kv_buffer_bytes=args.kv_buffer_mb << 20, kv_host=args.kv_host,
                        kv_hold_seconds=args.kv_hold_seconds)
        asyncio.run(serve_until_signal(app, sock, args.host))
    return 0
