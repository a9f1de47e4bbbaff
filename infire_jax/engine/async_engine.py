"""Serves the Engine to asyncio code from a dedicated engine thread.

The Engine is not thread-safe and `step()` blocks on the device, so one thread owns it: between
steps it applies add/abort commands taken from a thread-safe queue, it steps while anything is
unfinished, and it sleeps on that queue when idle (no busy loop). Each step's deltas go back to
the event loop in one `call_soon_threadsafe` callback, which fans them out to per-request asyncio
queues and records latencies, so the event loop never waits on the device.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

from infire_jax.engine.engine import Engine
from infire_jax.errors import DeviceMemoryError, InvalidRequestError
from infire_jax.lora.adapters import Adapter
from infire_jax.outputs import Delta
from infire_jax.runner.image_pool import ImagePoolFull
from infire_jax.sample.sampling_params import SamplingParams
from infire_jax.speculative.controller import SpecStats
from infire_jax.structured.backend import CompiledGrammar

if TYPE_CHECKING:
    from infire_jax.engine.residency import Residency

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (it crashed, or the server is shutting down)."""


class QueueFullError(RuntimeError):
    """Accepting the request would put more sequences in flight than the server allows."""


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """Engine counters, copied on the engine thread after every step, so readers need no lock."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    compiles_since_warmup: int = 0
    step_seconds: float = 0.0
    device_wait_seconds: float = 0.0
    spec: SpecStats | None = None  # speculative decoding's counters, when the engine speculates
    grammar_seconds: float = 0.0  # of the host time: in the grammar engine (structured outputs)
    kv_group_pages: tuple[int, ...] = ()  # KV pages held by requests, per group of layers (hybrid_kv_cache.py)
    images_encoded: int = 0  # images through the vision tower (none whose tokens were cached or imported)


class LatencyObserver(Protocol):
    """Receives per-sequence latencies (seconds), measured on the event loop's clock."""

    def first_token(self, seconds: float) -> None: ...

    def inter_token(self, seconds: float) -> None: ...

    def finished(self, seconds: float, reason: str) -> None: ...


@dataclasses.dataclass
class _Add:
    stream: RequestStream
    prompts: list[list[int]]
    params: SamplingParams
    options: dict[str, Any]  # priority, tenant, prefix_hint_tokens, session_id, grammar, lora_request


@dataclasses.dataclass
class _Abort:
    engine_ids: list[str]


@dataclasses.dataclass
class _Call:
    fn: Callable[[Engine], Any]
    future: asyncio.Future


_STOP = object()
_RESIDENCY_WAIT = 0.05  # seconds an engine thread waits for the device (or a drain) before serving its commands


class RequestStream:
    """The sequences of one API request: its prompts times `params.n`.

    `async with` admits it, raising InvalidRequestError, QueueFullError or EngineDeadError before
    anything was generated (so a server can still choose the HTTP status). Iterating yields lists
    of (prompt index, Delta) in arrival order. Leaving the block early, or being cancelled (a client
    that disconnected), aborts every unfinished sequence and frees its KV pages.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, prompts: list[list[int]], params: SamplingParams,
                 options: dict[str, Any]):
        self.request_id = request_id
        self.engine_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.num_seqs = len(prompts) * params.n
        self._engine = engine
        self._command = _Add(self, prompts, params, options)
        self._remaining = self.num_seqs
        self._queue: asyncio.Queue[tuple[int, Delta] | BaseException] = asyncio.Queue()
        self._admitted: asyncio.Future[BaseException | None] | None = None
        self._arrival = time.monotonic()
        self._last_token: dict[tuple[int, int], float] = {}
        self.active = False  # registered with the engine: admitted or waiting for admission

    @property
    def finished(self) -> bool:
        return self._remaining == 0

    async def __aenter__(self) -> RequestStream:
        self._admitted = asyncio.get_running_loop().create_future()
        self._engine._submit(self)
        try:
            error = await self._admitted
        except BaseException:
            self._engine._cancel(self)
            raise
        if error is not None:
            self._engine._unregister(self)
            raise error
        return self

    async def __aexit__(self, *exc_info) -> None:
        self._engine._cancel(self)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[tuple[int, Delta]]:
        if self.finished and self._queue.empty():
            raise StopAsyncIteration
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        for item in items:
            if isinstance(item, BaseException):
                self._remaining = 0  # nothing more will come
                raise item
        return items  # type: ignore[return-value]

    # ---- called on the event loop by the AsyncEngine ----------------------------------------
    def _admit(self, error: BaseException | None) -> None:
        if self._admitted is not None and not self._admitted.done():
            self._admitted.set_result(error)

    def _fail(self, error: BaseException) -> None:
        if self._admitted is not None and not self._admitted.done():
            self._admitted.set_result(error)
        else:
            self._queue.put_nowait(error)

    def _push(self, prompt_index: int, d: Delta, now: float, observer: LatencyObserver | None) -> None:
        key = (prompt_index, d.index)
        last = self._last_token.get(key)
        if observer is not None:
            if last is None:
                observer.first_token(now - self._arrival)
            else:
                observer.inter_token(now - last)
            if d.finished:
                observer.finished(now - self._arrival, d.finish_reason)
        self._last_token[key] = now
        if d.finished:
            self._remaining -= 1
        self._queue.put_nowait((prompt_index, d))


class AsyncEngine:
    """Owns the engine thread. `max_queue` bounds the sequences allowed to wait beyond a full batch."""

    def __init__(self, engine: Engine, *, max_queue: int, observer: LatencyObserver | None = None,
                 residency: Residency | None = None, name: str | None = None):
        """With `residency` (hot standby of several models), `name` is this engine's model there."""
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.residency = residency
        self.name = name
        self._deferred: list[_Add] = []  # admissions held back while this model drains (residency.py)
        self._image_waiting: list[_Add] = []  # requests whose images wait for image pool rows, in order
        self.capacity = engine.config.max_num_seqs + max_queue
        self.observer = observer
        self.snapshot = EngineSnapshot()
        self.error: BaseException | None = None  # why the engine thread stopped, once it has
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[RequestStream, int]] = {}  # engine request id -> (stream, prompt index)
        self._in_flight = 0  # sequences of registered streams
        self._calls: set[asyncio.Future] = set()  # futures of `call`s the engine thread has not answered
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def start(self) -> None:
        """Starts the engine thread; deltas will be delivered to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self.snapshot = self._take_snapshot()
        self._thread = threading.Thread(target=self._run, name="infire-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stops the engine thread after its current step; open requests fail with EngineDeadError."""
        if self._thread is None:
            return
        self._commands.put(_STOP)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        if self.error is None:
            self.error = EngineDeadError("the engine was shut down")
        self._fail_all(EngineDeadError(f"the engine is not running: {self.error!r}"))

    def generate(self, prompts: list[list[int]], params: SamplingParams, *, request_id: str, priority: int = 0,
                 tenant: str | None = None, prefix_hint_tokens: int = 0,
                 session_id: str | None = None, grammar: CompiledGrammar | None = None,
                 lora_request: str | Adapter | None = None, images: list | None = None) -> RequestStream:
        """A stream of the deltas of `prompts` (token ids); use it as `async with ... as stream`.
        `grammar`: `params.structured_outputs`, compiled off the engine thread (GrammarBackend);
        `lora_request`: the name of a loaded LoRA adapter, or one held (`Adapters.hold`); `images`: the prompt's images (their tiles,
        engine/images.py), its image placeholders expanded already."""
        options = dict(priority=priority, tenant=tenant, prefix_hint_tokens=prefix_hint_tokens,
                       session_id=session_id, grammar=grammar, lora_request=lora_request, images=images)
        return RequestStream(self, request_id, prompts, params, options)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Runs `fn(engine)` on the engine thread between two steps and returns its result (or raises
        its exception), for work that must not race a step: exporting or importing KV pages."""
        if self.error is not None or self._thread is None:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        future = asyncio.get_running_loop().create_future()
        self._calls.add(future)
        self._commands.put(_Call(fn, future))
        try:
            return await future
        finally:
            self._calls.discard(future)

    # ---- event-loop side ------------------------------------------------------------------
    def _submit(self, stream: RequestStream) -> None:
        if self.error is not None or self._thread is None:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        if stream.num_seqs > self.capacity:
            raise InvalidRequestError(
                f"the request asks for {stream.num_seqs} sequences (prompts x n); this server accepts at most "
                f"{self.capacity}", param="n")
        if self._in_flight + stream.num_seqs > self.capacity:
            raise QueueFullError(f"the server is at capacity ({self._in_flight} sequences in flight, "
                                 f"limit {self.capacity}); retry later")
        for i, eid in enumerate(stream.engine_ids):
            self._streams[eid] = (stream, i)
        self._in_flight += stream.num_seqs
        stream.active = True
        self._commands.put(stream._command)

    def _unregister(self, stream: RequestStream) -> None:
        if not stream.active:
            return
        stream.active = False
        for eid in stream.engine_ids:
            self._streams.pop(eid, None)
        self._in_flight -= stream.num_seqs

    def _cancel(self, stream: RequestStream) -> None:
        """Aborts the unfinished sequences of a stream its consumer gave up on."""
        if stream.active and self.error is None:
            self._commands.put(_Abort(list(stream.engine_ids)))
        self._unregister(stream)

    def _deliver(self, deltas: list[Delta], now: float) -> None:
        for d in deltas:
            entry = self._streams.get(d.request_id)
            if entry is None:
                continue  # aborted while the step was in flight
            stream, prompt_index = entry
            stream._push(prompt_index, d, now, self.observer)
            if stream.finished:
                self._unregister(stream)

    def _fail_streams(self, error: BaseException) -> None:
        streams = {id(s): s for s, _ in self._streams.values()}
        for stream in streams.values():
            self._unregister(stream)
            stream._fail(error)

    def _fail_all(self, error: BaseException) -> None:
        self._fail_streams(error)
        for future in self._calls:
            if not future.done():
                future.set_exception(error)

    @staticmethod
    def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
        if future.done():  # its caller was cancelled, or the engine failed it first
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def _on_thread_exit(self, error: BaseException) -> None:
        self.error = error
        self._fail_all(EngineDeadError(f"the engine failed: {error!r}"))

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished() and not self._image_waiting
                wait = 0 if not idle else _RESIDENCY_WAIT if self._deferred else None
                draining = self.residency is not None and self.residency.should_drain(self.name)
                for cmd in self._take_commands(wait):
                    if cmd is _STOP:
                        self.engine.close()  # releases multi-host followers
                        return
                    if isinstance(cmd, _Add) and (draining or self._deferred):
                        self._deferred.append(cmd)
                    elif isinstance(cmd, _Add) and self._image_waiting and cmd.options.get("images"):
                        self._image_waiting.append(cmd)  # behind those already waiting for image rows
                    else:
                        self._apply(cmd)
                if self._image_waiting:
                    self._admit_image_waiting()
                if self._deferred and not draining:
                    for cmd in self._deferred:
                        self._apply(cmd)
                    self._deferred.clear()
                if self.engine.has_unfinished() and self._on_device():
                    deltas = self.engine.step()
                    # Published before the deltas: a client that has its last token then reads
                    # (/health, /metrics) the engine as that step left it.
                    self.snapshot = self._take_snapshot()
                    if deltas:
                        self._loop.call_soon_threadsafe(self._deliver, deltas, time.monotonic())
                if self.residency is not None and not self.engine.has_unfinished():
                    self.residency.release(self.name)  # before the thread sleeps: the model may leave
                self.snapshot = self._take_snapshot()
        except BaseException as e:  # noqa: BLE001 - any failure must reach the waiting clients
            log.exception("the engine thread crashed")
            self.error = e
            try:
                self._loop.call_soon_threadsafe(self._on_thread_exit, e)
            except RuntimeError:  # the event loop is already closed
                pass

    def _on_device(self) -> bool:
        """The model is on the device for the next step; waits a moment for it otherwise (residency.py).

        If it does not fit (the device out of memory), its requests fail with that error and the
        thread goes on: the model stays off the device until a later request promotes it."""
        if self.residency is None:
            return True
        try:
            return self.residency.acquire(self.name, timeout=_RESIDENCY_WAIT)
        except DeviceMemoryError as e:
            log.error("%s", e)
            for engine_id in list(self._streams):  # none runs: a model off the device holds no pages
                self.engine.abort(engine_id)
            self._loop.call_soon_threadsafe(self._fail_streams, e)
            return False

    def _take_commands(self, wait: float | None) -> list:
        """The queued commands; first waits up to `wait` seconds for one (None: until one comes)."""
        cmds = []
        if wait != 0:
            try:
                cmds.append(self._commands.get(timeout=wait))
            except queue.Empty:
                pass
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _admit_image_waiting(self) -> None:
        """Admits the requests waiting for image pool rows, in order, until one still does not fit."""
        waiting, self._image_waiting = self._image_waiting, []
        for i, cmd in enumerate(waiting):
            self._apply(cmd)
            if self._image_waiting:  # it waits again; the rest keep their places behind it
                self._image_waiting += waiting[i + 1:]
                return

    def _apply(self, cmd: _Add | _Abort | _Call) -> None:
        if isinstance(cmd, _Abort):
            for eid in cmd.engine_ids:
                self.engine.abort(eid)
            return
        if isinstance(cmd, _Call):
            result, error = None, None
            try:
                result = cmd.fn(self.engine)
            except Exception as e:  # noqa: BLE001 - the caller gets it; the engine keeps running
                error = e
            self._loop.call_soon_threadsafe(self._settle, cmd.future, result, error)
            return
        if not cmd.stream.active:
            return  # its consumer left before it was admitted
        error: Exception | None = None
        try:
            for eid, prompt in zip(cmd.stream.engine_ids, cmd.prompts):
                self.engine.add_request(prompt, cmd.params, request_id=eid, **cmd.options)
        except Exception as e:  # noqa: BLE001 - the request fails, not the engine
            if not isinstance(e, InvalidRequestError):
                log.exception("admitting a request failed")
            error = e
            for eid in cmd.stream.engine_ids:  # a request's prompts are admitted together or not at all
                self.engine.abort(eid)
            if isinstance(e, ImagePoolFull) and self.engine.has_unfinished():
                self._image_waiting.append(cmd)  # the running requests' images free rows as they finish
                return
        self._loop.call_soon_threadsafe(cmd.stream._admit, error)

    def _take_snapshot(self) -> EngineSnapshot:
        e = self.engine
        return EngineSnapshot(
            num_running=e.num_running, num_waiting=e.num_waiting, kv_usage=e.kv.usage,
            prefix_queries=e.kv.queries, prefix_hits=e.kv.hits, num_preemptions=e.scheduler.num_preemptions,
            prompt_tokens=e.stats.prompt_tokens, generation_tokens=e.stats.generation_tokens,
            compiles_since_warmup=e.compiles_since_warmup, step_seconds=e.stats.step_seconds,
            device_wait_seconds=e.stats.device_wait_seconds, grammar_seconds=e.grammars.clock.seconds,
            spec=e.spec.stats.copy() if e.spec else None, kv_group_pages=tuple(e.kv.pages_in_use()),
            images_encoded=e.stats.images_encoded)
