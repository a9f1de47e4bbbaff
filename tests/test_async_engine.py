"""AsyncEngine threading semantics, on a scripted stand-in for the Engine (no device, no model).

What the live-server tests cannot provoke on demand: a crash of the engine thread, a cancellation
that lands before admission, and the idle engine thread sleeping instead of spinning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from infire_jax.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from infire_jax.engine.stats import EngineStats
from infire_jax.errors import InvalidRequestError
from infire_jax.runner.kv_pool import PoolSizing
from infire_jax.outputs import Delta
from infire_jax.sample.sampling_params import SamplingParams

VOCAB = 1000


class ScriptedEngine:
    """Engine stand-in: every sequence emits tokens 1, 2, ... one per step until max_tokens.

    `fail_at_step` makes that step raise (a device failure); clearing `gate` blocks the next step.
    """

    def __init__(self, max_num_seqs: int = 4, step_seconds: float = 0.002):
        self.config = SimpleNamespace(max_num_seqs=max_num_seqs)
        self.model_name, self.max_model_len = "scripted", 64
        self.kv = SimpleNamespace(usage=0.0, queries=0, hits=0, pages_in_use=lambda: [0])
        self.scheduler = SimpleNamespace(num_preemptions=0)
        self.grammars = SimpleNamespace(clock=SimpleNamespace(seconds=0.0))
        self.stats = EngineStats()
        self.pool_sizing = PoolSizing(num_pages=8, page_bytes=1024, source="num_kv_pages")
        self.compiles_since_warmup = 0
        self.spec = None  # no speculative decoding
        self.sampling_defaults = {}  # no generation config
        self.step_seconds = step_seconds
        self.seqs: dict[str, list[list[int]]] = {}  # request id -> [index, produced, max_tokens] per sample
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.steps = 0
        self.unfinished_checks = 0
        self.fail_at_step: int | None = None
        self.gate = threading.Event()
        self.gate.set()
        self.closed = False

    def add_request(self, prompt, params, *, request_id, **options):
        if any(t >= VOCAB for t in prompt):
            raise InvalidRequestError("token outside the vocabulary", param="prompt")
        if any(t < 0 for t in prompt):
            raise TypeError("a fault of the engine's, not of the request")
        self.seqs[request_id] = [[i, 0, params.max_tokens or 8] for i in range(params.n)]
        self.added.append(request_id)
        return request_id, prompt

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.seqs.pop(request_id, None)

    def close(self) -> None:
        self.closed = True

    def has_unfinished(self) -> bool:
        self.unfinished_checks += 1
        return bool(self.seqs)

    @property
    def num_running(self) -> int:
        return len(self.seqs)

    num_waiting = 0

    def step(self) -> list[Delta]:
        self.gate.wait()
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError("device lost")
        time.sleep(self.step_seconds)
        deltas = []
        for rid, seqs in list(self.seqs.items()):
            for s in seqs:
                if s[1] < s[2]:
                    s[1] += 1
                    deltas.append(Delta(rid, s[0], [s[1]], f"t{s[1]} ", None, "length" if s[1] == s[2] else None))
            if all(s[1] == s[2] for s in seqs):
                del self.seqs[rid]
        return deltas


class Latencies:
    def __init__(self):
        self.ttft, self.itl, self.e2e = [], [], []

    def first_token(self, s: float) -> None:
        self.ttft.append(s)

    def inter_token(self, s: float) -> None:
        self.itl.append(s)

    def finished(self, s: float, reason: str) -> None:
        self.e2e.append((s, reason))


def run_with(engine: ScriptedEngine, scenario, *, max_queue: int = 8, observer=None):
    async def main():
        ae = AsyncEngine(engine, max_queue=max_queue, observer=observer)
        ae.start()
        try:
            return await scenario(ae)
        finally:
            await ae.shutdown()

    return asyncio.run(main())


async def collect(stream) -> dict[tuple[int, int], list[int]]:
    out: dict[tuple[int, int], list[int]] = {}
    async for batch in stream:
        for pi, d in batch:
            out.setdefault((pi, d.index), []).extend(d.token_ids)
    return out


def test_every_sequence_streams_in_order_and_latencies_are_recorded():
    lat = Latencies()

    async def scenario(ae):
        async with ae.generate([[1, 2], [3]], SamplingParams(n=2, max_tokens=5), request_id="r") as s:
            out = await collect(s)
        return out, ae.num_in_flight

    out, in_flight = run_with(ScriptedEngine(), scenario, observer=lat)
    assert out == {(p, i): [1, 2, 3, 4, 5] for p in (0, 1) for i in (0, 1)}
    assert in_flight == 0
    assert (len(lat.ttft), len(lat.itl), [r for _, r in lat.e2e]) == (4, 16, ["length"] * 4)


def test_admission_error_is_raised_and_rolls_back_the_other_prompts():
    engine = ScriptedEngine()

    async def scenario(ae):
        with pytest.raises(InvalidRequestError) as e:
            async with ae.generate([[1], [VOCAB + 5]], SamplingParams(), request_id="bad"):
                pass
        assert e.value.param == "prompt"
        async with ae.generate([[1]], SamplingParams(max_tokens=2), request_id="ok") as s:
            assert await collect(s) == {(0, 0): [1, 2]}  # the engine still serves
        return ae.num_in_flight, ae.healthy

    assert run_with(engine, scenario) == (0, True)
    assert engine.aborted == ["bad-0", "bad-1"] and engine.seqs == {}
    assert engine.closed  # shutdown closes the engine on its own thread


def test_an_unexpected_admission_error_fails_the_request_not_the_engine():
    """An exception other than InvalidRequestError while admitting (a tokenizer's TypeError, say) goes
    to that request's caller, its prompts are rolled back, and the engine thread keeps serving."""
    engine = ScriptedEngine()

    async def scenario(ae):
        with pytest.raises(TypeError, match="a fault of the engine's"):
            async with ae.generate([[1], [-1]], SamplingParams(), request_id="odd"):
                pass
        async with ae.generate([[1]], SamplingParams(max_tokens=2), request_id="ok") as s:
            assert await collect(s) == {(0, 0): [1, 2]}
        return ae.num_in_flight, ae.healthy

    assert run_with(engine, scenario) == (0, True)
    assert engine.aborted == ["odd-0", "odd-1"] and engine.seqs == {}


def test_leaving_or_cancelling_a_stream_aborts_it():
    engine = ScriptedEngine()

    async def scenario(ae):
        async with ae.generate([[1]], SamplingParams(max_tokens=10_000), request_id="left") as s:
            await s.__anext__()  # one batch, then the consumer goes away

        async def consume():
            async with ae.generate([[1]], SamplingParams(max_tokens=10_000), request_id="cancelled") as s:
                await collect(s)

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: not engine.seqs)
        return ae.num_in_flight

    assert run_with(engine, scenario) == 0
    assert engine.aborted == ["left-0", "cancelled-0"]


def test_cancel_before_admission_never_runs_the_request():
    engine = ScriptedEngine()

    async def scenario(ae):
        async with ae.generate([[1]], SamplingParams(max_tokens=10_000), request_id="busy") as busy:
            await busy.__anext__()
            engine.gate.clear()  # the engine thread blocks in its next step
            await asyncio.sleep(0.05)
            task = asyncio.create_task(ae.generate([[1]], SamplingParams(), request_id="late").__aenter__())
            await asyncio.sleep(0.05)
            assert not task.done()  # its add is still queued behind the blocked step
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            engine.gate.set()
            await wait_for(lambda: "late-0" in engine.aborted)
        await wait_for(lambda: not engine.seqs)
        return ae.num_in_flight

    assert run_with(engine, scenario) == 0
    assert engine.added == ["busy-0"]  # the cancelled request never reached the engine


def test_capacity_limits():
    async def scenario(ae):  # capacity: 2 running + 1 queued sequences
        with pytest.raises(InvalidRequestError) as e:
            async with ae.generate([[1]], SamplingParams(n=4), request_id="huge"):
                pass
        assert e.value.param == "n"
        async with ae.generate([[1]], SamplingParams(n=2, max_tokens=10_000), request_id="a"):
            with pytest.raises(QueueFullError):
                async with ae.generate([[1]], SamplingParams(n=2), request_id="b"):
                    pass
            async with ae.generate([[1]], SamplingParams(max_tokens=1), request_id="c") as s:
                assert await collect(s) == {(0, 0): [1]}
        return ae.num_in_flight

    assert run_with(ScriptedEngine(max_num_seqs=2), scenario, max_queue=1) == 0


def test_idle_engine_thread_sleeps():
    engine = ScriptedEngine()

    async def scenario(ae):
        async with ae.generate([[1]], SamplingParams(max_tokens=3), request_id="r") as s:
            await collect(s)
        await asyncio.sleep(0.05)
        checks, steps = engine.unfinished_checks, engine.steps
        await asyncio.sleep(0.5)
        return engine.unfinished_checks - checks, engine.steps - steps

    assert run_with(engine, scenario) == (0, 0)


def test_engine_crash_fails_open_requests_and_refuses_new_ones():
    engine = ScriptedEngine()
    engine.fail_at_step = 5

    async def scenario(ae):
        with pytest.raises(EngineDeadError):
            async with ae.generate([[1]], SamplingParams(max_tokens=100), request_id="r") as s:
                await collect(s)
        assert not ae.healthy and isinstance(ae.error, RuntimeError)
        with pytest.raises(EngineDeadError):
            async with ae.generate([[1]], SamplingParams(), request_id="after"):
                pass
        return ae.num_in_flight

    assert run_with(engine, scenario) == 0


def test_call_runs_between_steps_on_the_engine_thread_and_reports_errors():
    """`call` (KV export and import) runs on the engine thread while requests stream; its exception
    reaches the caller and the engine keeps serving; a crash fails pending calls."""
    engine = ScriptedEngine()

    async def scenario(ae):
        async with ae.generate([[1]], SamplingParams(max_tokens=6), request_id="r") as s:
            ran_on = await ae.call(lambda e: (threading.current_thread().name, e.steps))
            out = await collect(s)
        with pytest.raises(ZeroDivisionError):
            await ae.call(lambda e: 1 / 0)
        assert ae.healthy and await ae.call(lambda e: e.model_name) == "scripted"
        engine.fail_at_step = engine.steps + 1
        engine.gate.clear()  # the next step waits: the call below is queued behind it, then the step fails
        async with ae.generate([[1]], SamplingParams(max_tokens=4), request_id="crash") as s:
            pending = asyncio.ensure_future(ae.call(lambda e: "never"))
            await asyncio.sleep(0.05)
            engine.gate.set()
            with pytest.raises(EngineDeadError):
                await collect(s)
        return ran_on, out, pending

    (thread, _), out, pending = run_with(engine, scenario)
    assert thread == "infire-engine" and out == {(0, 0): [1, 2, 3, 4, 5, 6]}
    assert isinstance(pending.exception(), EngineDeadError)


def scripted_http_engine() -> ScriptedEngine:
    from infire_jax.loaders.dummy import CONFIGS, dummy_tokenizer
    from infire_jax.models.hf_config import config_from_hf

    engine = ScriptedEngine(step_seconds=0.01)
    engine.tokenizer = dummy_tokenizer(config_from_hf(CONFIGS["smollm2-135m"]))
    return engine


@contextlib.asynccontextmanager
async def served(engine: ScriptedEngine):
    """The HTTP server on `engine`, with the server's own runner and socket handling; yields its URL."""
    from server.app import build_app
    from server.listen import make_runner

    runner = make_runner(build_app(engine))
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


def test_http_engine_crash_gives_500_then_503_and_unhealthy():
    engine = scripted_http_engine()
    engine.fail_at_step = 20
    body = {"model": "scripted", "prompt": "hi", "max_tokens": 50}

    async def scenario():
        async with served(engine) as url:
            async with aiohttp.ClientSession() as s:
                async def plain():
                    async with s.post(url + "/v1/completions", json=body) as r:
                        return r.status, await r.json()

                async def streamed():
                    async with s.post(url + "/v1/completions", json={**body, "stream": True}) as r:
                        return r.status, (await r.read()).decode()

                (st1, b1), (st2, text) = await asyncio.gather(plain(), streamed())
                async with s.get(url + "/health") as r:
                    health = r.status, await r.json()
                async with s.post(url + "/v1/completions", json=body) as r:
                    after = r.status, await r.json()
            return st1, b1, st2, text, health, after

    st1, b1, st2, text, health, after = asyncio.run(scenario())
    assert (st1, b1["error"]["type"], b1["error"]["code"]) == (500, "server_error", "engine_dead")
    assert st2 == 200 and '"code": "engine_dead"' in text and text.endswith("data: [DONE]\n\n")
    assert health[0] == 503 and health[1]["status"] == "unhealthy"
    assert (after[0], after[1]["error"]["code"]) == (503, "engine_unavailable")


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_client_gone_before_the_stream_starts_is_no_server_error(monkeypatch, caplog):
    """A streaming client that resets its connection before the response's headers go out (aiohttp then
    raises ConnectionResetError from `prepare`) is a quiet disconnect, as one mid-stream is: no
    "unhandled error" logged, no 500 attempted, the request aborted and the engine serving."""
    from server import streaming

    engine = scripted_http_engine()
    body = {"model": "scripted", "prompt": "hi", "max_tokens": 50}

    async def gone(self):
        raise ConnectionResetError("Cannot write to closing transport")

    async def scenario():
        async with served(engine) as url:
            async with aiohttp.ClientSession() as s:
                with monkeypatch.context() as m:
                    m.setattr(streaming.SSEWriter, "start", gone)
                    async with s.post(url + "/v1/completions", json={**body, "stream": True}) as r:
                        await r.read()
                await wait_for(lambda: engine.aborted)
                async with s.post(url + "/v1/completions", json={**body, "max_tokens": 2}) as r:
                    return r.status, await r.json()

    with caplog.at_level(logging.ERROR):
        status, after = asyncio.run(scenario())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert len(engine.aborted) == 1 and (status, after["usage"]["completion_tokens"]) == (200, 2)
