"""Binding and serving an aiohttp app until SIGINT/SIGTERM, shared by `serve` and `router` (no jax here)."""

from __future__ import annotations

import asyncio
import signal
import socket

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


def make_runner(app: web.Application) -> web.AppRunner:
    """Handler cancellation on: a client that disconnects cancels its handler, which aborts its request."""
    return web.AppRunner(app, handler_cancellation=True, access_log=None)


async def serve_until_signal(app: web.Application, sock: socket.socket, host: str) -> None:
    """Listens on `sock`, prints the `ready: URL` line, and serves until SIGINT or SIGTERM."""
    runner = make_runner(app)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    print(f"ready: http://{host}:{sock.getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
