"""Helpers of the live-server tests: start `infire-jax serve` (or `router`) as a subprocess, read its metrics."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Callable

from aiohttp import web
from conftest import dying_with_parent
from prometheus_client.parser import text_string_to_metric_families

MODEL = "SmolLM2-135M-Instruct"
_READY_TIMEOUT_S = 600  # a first start compiles every bucket; later starts hit the on-disk cache



def post_json(url: str, path: str, body: dict) -> tuple[int, dict]:
    """POSTs `body` to a server; (status, its JSON answer), an error's too."""
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)

class ServerProcess:
    """One server on a free port (`--port 0`; the ready line names the port). `command` "router"
    starts a router instead, whose arguments carry no engine flags."""

    def __init__(self, args: list[str], command: str = "serve"):
        self._log = tempfile.NamedTemporaryFile(prefix=f"infire-{command}-", suffix=".log", delete=False)
        engine_args = ["--dtype", "float32"] if command == "serve" else []
        self.proc = subprocess.Popen(dying_with_parent(
            [sys.executable, "-m", "infire_jax", command, "--host", "127.0.0.1", "--port", "0", *engine_args, *args]),
            stdout=subprocess.PIPE, stderr=self._log, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.url = ""

    def wait_ready(self) -> None:
        """Returns once the server has said it is ready (at once if it already has)."""
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not self.url and time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            readable, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if readable:
                line = self.proc.stdout.readline()
                if line.startswith("ready: "):
                    self.url = line.split(" ", 1)[1].strip()
        if not self.url:
            raise TimeoutError(f"the server was not ready after {_READY_TIMEOUT_S}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        with open(self._log.name, errors="replace") as f:
            return f.read()[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self._log.close()
        os.unlink(self._log.name)

    def kill(self) -> None:
        """SIGKILL: a crash, with no chance to close connections cleanly."""
        self.proc.kill()
        self.proc.wait()

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: sample name -> value (each metric has one model_name label)."""
        return {s.name: s.value for s in self.metric_samples()
                if "le" not in s.labels and "finished_reason" not in s.labels and "reason" not in s.labels}

    def metric_samples(self) -> list:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


class AppThread:
    """aiohttp apps served in this process, on an event loop of its own thread (the engines' threads
    beside it); `run` runs a coroutine there. Servers without a subprocess: no second compile."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.runners: list[web.AppRunner] = []
        self.urls: list[str] = []

    def run(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def serve(self, app: web.Application) -> None:
        from server.listen import bind, make_runner

        runner = make_runner(app)  # the workers' own: a client that leaves cancels its handler
        await runner.setup()
        sock = bind("127.0.0.1", 0)
        await web.SockSite(runner, sock).start()
        self.runners.append(runner)
        self.urls.append(f"http://127.0.0.1:{sock.getsockname()[1]}")

    def close(self) -> None:
        for runner in self.runners:
            self.run(runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


def disaggregate_over_http(prefill, decode, prompts: list[list[int]], want: list[tuple[list[int], list[float]]],
                           *, max_tokens: int, atol: float) -> None:
    """Serves engines `prefill` and `decode` as a prefill and a decode worker behind a router, in this
    process, and sends each prompt through (greedy, `max_tokens`): the decode worker answers; a prompt
    longer than a page arrives over Mooncake, its full pages before the last token being the decode
    worker's prefix hit (in every group of a hybrid cache); tokens and logprobs are `want`'s (token ids,
    logprobs) within `atol`. Afterwards no hold, staging byte or page is left on either worker. It takes
    the engines over (their serving threads): nothing may step them afterwards."""
    import aiohttp
    import numpy as np

    from infire_jax.engine.detokenizer import TokenText
    from router.app import RouterConfig, build_router_app
    from server.app import build_app
    from server.endpoints import STATE

    ps, text = decode.runner.rc.page_size, TokenText(decode.tokenizer)
    servers = AppThread()
    try:
        servers.run(servers.serve(build_app(prefill, role="prefill", kv_buffer_bytes=4 << 20, kv_hold_seconds=30)))
        servers.run(servers.serve(build_app(decode, role="decode", kv_buffer_bytes=4 << 20)))
        handoffs = [r.app[STATE].handoff for r in servers.runners]
        free = [h.free_bytes for h in handoffs]
        router = RouterConfig(workers=((servers.urls[0], "prefill"), (servers.urls[1], "decode")),
                              disagg_min_tokens=0, health_interval=0.5)
        servers.run(servers.serve(build_router_app(router)))

        async def complete(prompt: list[int]) -> tuple[dict, dict]:
            body = {"model": decode.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "logprobs": 1}
            async with aiohttp.ClientSession() as s:
                async with s.post(servers.urls[2] + "/v1/completions", json=body,
                                  headers={"x-tenant-id": "fleet"}) as r:
                    assert r.status == 200, await r.text()
                    return await r.json(), dict(r.headers)

        for prompt, (tokens, lps) in zip(prompts, want):
            got, headers = servers.run(complete(prompt))
            assert headers["x-infire-decode-worker"] == servers.urls[1]
            moved = len(prompt) > ps
            assert (headers.get("x-infire-kv-transfer") == "imported") == moved, headers
            cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == ((len(prompt) - 1) // ps * ps if moved else 0)
            logprobs = got["choices"][0]["logprobs"]
            assert logprobs["tokens"] == [text(t) for t in tokens]
            np.testing.assert_allclose(logprobs["token_logprobs"], lps, rtol=0, atol=atol)

        async def drained() -> None:
            for _ in range(200):
                if handoffs[0].num_holds == 0 and [h.free_bytes for h in handoffs] == free:
                    return
                await asyncio.sleep(0.05)

        servers.run(drained())
        assert handoffs[0].num_holds == 0 and [h.free_bytes for h in handoffs] == free
    finally:
        servers.close()
    for engine in (prefill, decode):
        assert engine.kv.num_free_pages == engine.kv.num_usable_pages and not any(engine.kv.pages_in_use())
