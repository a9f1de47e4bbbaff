"""Drives the engine over a set of prompts, keeping at most `concurrency` of them in flight, and
records when every token came back and what every sampling step read.

With asynchronous scheduling `Engine.step()` dispatches step k and then returns the tokens of step
k-1, so the gap between two returns is the device time of one step: a return whose tokens all
continue requests already decoding closes a pure decode step. A decode burst (scheduler.py)
returns several tokens a row: that return covers as many device steps as its longest row.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any, Callable, Sequence

from infire_jax.bench.metrics import RequestTiming
from infire_jax.engine.engine import Engine
from infire_jax.sample.sampling_params import SamplingParams


@dataclasses.dataclass
class RequestTrace:
    prompt_len: int
    max_tokens: int
    sent: float  # when it was handed to the engine
    added: float = 0.0  # seconds `Engine.add_request` took (tokenizing; encoding its images)
    token_times: list[float] = dataclasses.field(default_factory=list)
    num_cached_tokens: int = 0

    def timing(self) -> RequestTiming:
        times = [self.sent, *self.token_times]
        return RequestTiming(ttft=self.token_times[0] - self.sent, e2el=self.token_times[-1] - self.sent,
                             itl=[b - a for a, b in zip(times[1:], times[2:])],
                             prompt_tokens=self.prompt_len, output_tokens=len(self.token_times))


@dataclasses.dataclass
class StepTrace:
    """One step's sampled rows: when their tokens came back, and the keys each row attended to."""

    time: float
    contexts: list[int]  # at each row's first token of the return
    num_first: int  # rows that sampled a request's first token (their step held prefill)
    row_tokens: list[int]  # tokens each row got
    burst: bool  # a row's tokens came from as many decode steps (else one verifying step)

    def step_contexts(self) -> list[list[int]]:
        """The contexts of each device step the return covers."""
        if not self.burst:
            return [self.contexts]
        return [[c + j for c, n in zip(self.contexts, self.row_tokens) if n > j] for j in range(max(self.row_tokens))]


@dataclasses.dataclass
class RunTrace:
    start: float
    end: float
    requests: list[RequestTrace]
    steps: list[StepTrace]
    preemptions: int
    max_running: int

    @property
    def duration(self) -> float:
        return self.end - self.start

    def decode_intervals(self, batch: int | None = None) -> list[tuple[float, StepTrace]]:
        """(seconds, step) of every pure decode step, optionally only those of exactly `batch` rows."""
        out = []
        for prev, step in zip(self.steps, self.steps[1:]):
            if step.num_first == 0 and (batch is None or len(step.contexts) == batch):
                out.append((step.time - prev.time, step))
        return out


def run(engine: Engine, prompts: Sequence[list[int]], max_tokens: Sequence[int], *, concurrency: int,
        tenant: str, on_done: Callable[[], None] | None = None, loras: Sequence[str | None] | None = None,
        images: Sequence[Sequence[Any]] | None = None, temperature: float = 0.0) -> RunTrace:
    """Runs every prompt to exactly its `max_tokens` (EOS ignored; greedy unless `temperature`),
    `concurrency` at a time; prompt i with the LoRA adapter named loras[i] and the images images[i] if
    given. A request's time to its first token counts from before it is added: its images' encoding is
    in it.

    `tenant` salts the prefix cache, so earlier runs over the same prompts cannot serve this one.
    """
    traces: list[RequestTrace | None] = [None] * len(prompts)
    waiting = deque(range(len(prompts)))
    active: dict[str, int] = {}
    steps: list[StepTrace] = []
    preempted_before = engine.scheduler.num_preemptions
    max_running = 0

    def admit() -> None:
        while waiting and len(active) < concurrency:
            i = waiting.popleft()
            params = SamplingParams(max_tokens=max_tokens[i], temperature=temperature, ignore_eos=True)
            sent = time.perf_counter()
            rid, ids = engine.add_request(prompts[i], params, tenant=tenant, lora_request=loras[i] if loras else None,
                                          images=images[i] if images else None)
            traces[i] = RequestTrace(len(ids), max_tokens[i], sent, added=time.perf_counter() - sent)
            active[rid] = i

    bursts = engine.runner.rc.decode_steps > 1  # else several tokens a row come from one verifying step
    start = time.perf_counter()
    admit()
    while engine.has_unfinished():
        deltas = engine.step()
        now = time.perf_counter()
        max_running = max(max_running, engine.num_running)
        contexts, first, counts = [], 0, []
        for d in deltas:
            tr = traces[active[d.request_id]]
            # Output token j is sampled at position prompt_len + j - 1, attending to prompt_len + j keys.
            contexts.append(tr.prompt_len + len(tr.token_times))
            first += not tr.token_times
            tr.num_cached_tokens = d.num_cached_tokens
            tr.token_times.extend([now] * len(d.token_ids))
            counts.append(len(d.token_ids))
            if d.finished:
                del active[d.request_id]
                if on_done:
                    on_done()
        if deltas:
            steps.append(StepTrace(now, contexts, first, counts, bursts))
        admit()
    end = time.perf_counter()
    return RunTrace(start, end, traces, steps, engine.scheduler.num_preemptions - preempted_before, max_running)
