"""Binding and serving an aiohttp app until SIGINT/SIGTERM, shared by `serve` and `router` (no jax here)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import ssl

from aiohttp import web


def bind(host: str, port: int) -> socket.socket:
    """A bound socket that does not listen yet: until the app is ready, connections are refused."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    return sock


def make_runner(app: web.Application, access_log: bool = False) -> web.AppRunner:
    """Handler cancellation on: a client that disconnects cancels its handler, which aborts its request.
    `access_log`: a line per request on the aiohttp.access logger, at INFO."""
    log = logging.getLogger("aiohttp.access") if access_log else None
    if log is not None:
        log.setLevel(logging.INFO)
    return web.AppRunner(app, handler_cancellation=True, access_log=log)


async def serve_until_signal(app: web.Application, sock: socket.socket, host: str, *,
                             ssl_context: ssl.SSLContext | None = None, access_log: bool = False) -> None:
    """Listens on `sock` (HTTPS with `ssl_context`), prints the `ready: URL` line, and serves until
    SIGINT or SIGTERM."""
    runner = make_runner(app, access_log)
    await runner.setup()
    await web.SockSite(runner, sock, ssl_context=ssl_context).start()
    print(f"ready: http{'s' if ssl_context else ''}://{host}:{sock.getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
