"""The two workloads of `bench fleet` and what they measure, on the client's monotonic clock.

A streamed request is timed chunk by chunk (StreamReader). Interference: decode streams, one
request after another, against long prompts arriving as a Poisson process; its rows split the
decodes by whether a long prompt's prefill overlapped their decode phase. Multiturn: chat sessions
whose turns resend the growing history; its rows add the prefix-cache hit ratios. The subcommand
(fleet.py) starts the fleet, runs one of these through its router, and reports.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Sequence

import aiohttp
import numpy as np

from infire_jax.bench.common import BenchError
from infire_jax.bench.metrics import RequestTiming, latency_stats
from infire_jax.bench.serve import _url

SESSION_HEADER = "x-session-affinity"
MIN_TOKEN_ID = 100  # random prompts skip the low ids, where special tokens live


# ---- pure parts: timing of a stream, arrivals, overlap, statistics, hit ratios ---------------------------

@dataclasses.dataclass
class StreamTiming(RequestTiming):
    """One streamed request's timing: RequestTiming's, plus when it was sent (client monotonic
    clock) and the prompt tokens the server took from its prefix cache."""

    start: float = 0.0
    cached_tokens: int = 0
    text: str = ""

    @property
    def prefill_interval(self) -> tuple[float, float]:
        return self.start, self.start + self.ttft

    @property
    def decode_interval(self) -> tuple[float, float]:
        return self.start + self.ttft, self.start + self.e2el


class StreamReader:
    """Accounts the SSE chunks of one completions or chat completions stream.

    A chunk brings a token when it has text, or when it has neither a finish reason nor a role (the
    chat stream's first chunk only announces the assistant role).
    """

    def __init__(self, start: float, chat: bool):
        self.start, self.chat = start, chat
        self.times: list[float] = []
        self.parts: list[str] = []
        self.usage: dict | None = None

    def feed(self, chunk: dict, now: float) -> str | None:
        """Takes one decoded chunk; returns an error description for an error event."""
        if "error" in chunk:
            return f"error event: {json.dumps(chunk['error'])[:300]}"
        choices = chunk.get("choices")
        if choices:
            c = choices[0]
            if self.chat:
                delta = c.get("delta") or {}
                text, announces = delta.get("content") or "", "role" in delta
            else:
                text, announces = c.get("text") or "", False
            if text or not (c.get("finish_reason") or announces):
                self.times.append(now)
            self.parts.append(text)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        return None

    def result(self, end: float, prompt_len: int = 0) -> StreamTiming | str:
        if not self.times:
            return "the stream held no tokens"
        usage = self.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        return StreamTiming(
            ttft=self.times[0] - self.start, e2el=end - self.start,
            itl=[b - a for a, b in zip(self.times, self.times[1:])],
            prompt_tokens=usage.get("prompt_tokens", prompt_len),
            output_tokens=usage.get("completion_tokens", len(self.times)),
            start=self.start, cached_tokens=details.get("cached_tokens") or 0, text="".join(self.parts))


def poisson_arrivals(rate: float, duration: float, rng: np.random.Generator) -> list[float]:
    """Arrival times in [0, duration) of a Poisson process of `rate` per second (none for rate 0)."""
    if rate <= 0:
        return []
    times, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / rate)
        if t >= duration:
            return times
        times.append(t)


def overlaps(interval: tuple[float, float], others: Sequence[tuple[float, float]]) -> bool:
    """Whether `interval` shares some time with one of `others` (open intervals: touching is not sharing)."""
    a0, a1 = interval
    return any(a0 < b1 and b0 < a1 for b0, b1 in others)


def split_by_overlap(decodes: Sequence[StreamTiming], longs: Sequence[StreamTiming]
                     ) -> tuple[list[StreamTiming], list[StreamTiming]]:
    """(decode requests whose decode phase overlapped some long prompt's prefill, the others)."""
    prefills = [t.prefill_interval for t in longs]
    hit = [t for t in decodes if overlaps(t.decode_interval, prefills)]
    clean = [t for t in decodes if not overlaps(t.decode_interval, prefills)]
    return hit, clean


def class_summary(label: str, timings: Sequence[RequestTiming], failed: int, duration: float,
                  percentiles: Sequence[float]) -> dict:
    """One row of the report: counts, output throughput, and TTFT/TPOT/ITL/E2E statistics in ms."""
    out_tokens = sum(t.output_tokens for t in timings)
    row = dict(label=label, completed=len(timings), failed=failed, prompt_tokens=sum(t.prompt_tokens for t in timings),
               output_tokens=out_tokens, output_throughput=out_tokens / duration if duration > 0 and timings else None)
    row |= latency_stats("ttft", [t.ttft for t in timings], percentiles)
    row |= latency_stats("tpot", [t.tpot for t in timings if t.tpot is not None], percentiles)
    row |= latency_stats("itl", [gap for t in timings for gap in t.itl], percentiles)
    row |= latency_stats("e2el", [t.e2el for t in timings], percentiles)
    return row


@dataclasses.dataclass
class Turn:
    session: int
    turn: int  # 0 for the first turn of a session
    timing: StreamTiming


def hit_ratio(turns: Sequence[Turn]) -> float | None:
    """Sum of cached prompt tokens over the sum of prompt tokens; None without prompt tokens."""
    prompt = sum(t.timing.prompt_tokens for t in turns)
    return sum(t.timing.cached_tokens for t in turns) / prompt if prompt else None


def reusable_tokens(turns: Sequence[Turn]) -> dict[tuple[int, int], int]:
    """Per (session, turn): the tokens a perfect cache could serve, the previous turn's prompt and
    reply (the new user message never can be; at least one prompt token is always computed)."""
    prev = {(t.session, t.turn): t.timing for t in turns}
    return {(t.session, t.turn): min(p.prompt_tokens + p.output_tokens, t.timing.prompt_tokens - 1)
            for t in turns if (p := prev.get((t.session, t.turn - 1))) is not None}


def multiturn_rows(turns: Sequence[Turn], failed_first: int, failed_later: int, duration: float,
                   percentiles: Sequence[float]) -> list[dict]:
    """Rows for the first turns, the later turns and all turns: counts, hit ratio (of all prompt
    tokens, and of the reusable ones of later turns whose previous turn completed), latencies."""
    reusable = reusable_tokens(turns)
    rows = []
    for label, chosen, failed in (("first turns", [t for t in turns if t.turn == 0], failed_first),
                                  ("later turns", [t for t in turns if t.turn > 0], failed_later),
                                  ("all turns", list(turns), failed_first + failed_later)):
        row = class_summary(label, [t.timing for t in chosen], failed, duration, percentiles)
        row["cached_tokens"] = sum(t.timing.cached_tokens for t in chosen)
        row["cache_hit_ratio"] = hit_ratio(chosen)
        with_prev = [t for t in chosen if (t.session, t.turn) in reusable]
        row["reusable_tokens"] = sum(reusable[t.session, t.turn] for t in with_prev)
        row["reusable_hit_ratio"] = (sum(t.timing.cached_tokens for t in with_prev) / row["reusable_tokens"]
                                     if row["reusable_tokens"] else None)
        rows.append(row)
    return rows


_WORDS = ("time year people way day man thing woman life child world school state family student group country "
          "problem hand part place case week company system program question work government number night point "
          "home water room mother area money story fact month lot right study book eye job word business issue "
          "side kind head house service friend father power hour game line end member law car city community name "
          "president team minute idea kid body information back parent face others level office door health person "
          "art war history party result change morning reason research girl guy moment air teacher force education "
          "river garden window letter music market paper island winter summer bridge forest engine signal harbor "
          "valley planet silver copper orange yellow purple quiet bright gentle rapid simple ancient modern").split()


def user_message(rng: np.random.Generator, tokens: int) -> str:
    """Random common English words as sentences, about `tokens` tokens long: in SmolLM2's BPE a word
    with its leading space is one token, and the full stops add a tenth."""
    words = [str(w) for w in rng.choice(_WORDS, size=max(1, round(tokens * 0.9)))]
    sentences, i = [], 0
    while i < len(words):
        n = int(rng.integers(6, 13))
        part = words[i:i + n]
        sentences.append(" ".join(part).capitalize() + ".")
        i += n
    return " ".join(sentences)


# ---- requests -------------------------------------------------------------------------------------------

async def stream_request(session: aiohttp.ClientSession, url: str, body: dict, headers: dict, *,
                         chat: bool) -> StreamTiming | str:
    """One streamed request; its timing, or a description of why it failed."""
    start = time.monotonic()
    reader = StreamReader(start, chat)
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                return f"HTTP {resp.status}: {(await resp.text())[:300]}"
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                error = reader.feed(json.loads(data), time.monotonic())
                if error:
                    return error
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    prompt = body.get("prompt")
    return reader.result(time.monotonic(), len(prompt) if isinstance(prompt, list) else 0)


def _completion(model: str, prompt: list[int], max_tokens: int) -> dict:
    return dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stream=True,
                stream_options={"include_usage": True})


def _random_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return rng.integers(MIN_TOKEN_ID, vocab_size, size=n).tolist()


async def warmup(session, base_url: str, model: str, headers: dict, args) -> None:
    rng = np.random.default_rng((args.seed, 9))
    url = _url(base_url, "/v1/completions")
    for _ in range(args.num_warmups):
        out = await stream_request(session, url, _completion(model, _random_ids(rng, 16, args.vocab_size), 4),
                                   headers, chat=False)
        if isinstance(out, str):
            raise BenchError(f"the warmup request to {url} failed: {out}")


async def interference(session, base_url: str, model: str, headers: dict, args) -> tuple[list[dict], dict]:
    url = _url(base_url, "/v1/completions")
    decodes, longs = [], []
    errors: dict[str, list[str]] = {"decode": [], "long": []}
    start = time.monotonic()
    deadline = start + args.duration

    async def stream(k: int) -> None:
        rng = np.random.default_rng((args.seed, 1, k))
        while time.monotonic() < deadline:
            prompt = _random_ids(rng, args.prompt_len, args.vocab_size)
            out = await stream_request(session, url, _completion(model, prompt, args.decode_len), headers, chat=False)
            if isinstance(out, str):
                errors["decode"].append(out)
                await asyncio.sleep(0.5)  # a failing router must not be hammered
            else:
                decodes.append(out)

    async def long_one(prompt: list[int]) -> None:
        out = await stream_request(session, url, _completion(model, prompt, args.long_max_tokens), headers, chat=False)
        (errors["long"] if isinstance(out, str) else longs).append(out)

    async def long_arrivals() -> None:
        rng = np.random.default_rng((args.seed, 2))
        tasks = []
        for at in poisson_arrivals(args.long_rate, args.duration, rng):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            tasks.append(asyncio.create_task(long_one(_random_ids(rng, args.long_len, args.vocab_size))))
        await asyncio.gather(*tasks)

    await asyncio.gather(*(stream(k) for k in range(args.streams)), long_arrivals())
    duration = time.monotonic() - start
    hit, clean = split_by_overlap(decodes, longs)
    p = args.metric_percentiles
    rows = [class_summary("decode", decodes, len(errors["decode"]), duration, p),
            class_summary("decode, overlapping a long prefill", hit, 0, duration, p),
            class_summary("decode, no long prefill", clean, 0, duration, p),
            class_summary("long prompt", longs, len(errors["long"]), duration, p)]
    return rows, dict(duration_s=duration, errors={k: v[:5] for k, v in errors.items()})


async def multiturn(session, base_url: str, model: str, headers: dict, args) -> tuple[list[dict], dict]:
    url = _url(base_url, "/v1/chat/completions")
    limit = asyncio.Semaphore(args.concurrency)
    turns: list[Turn] = []
    errors: list[str] = []
    failed = [0, 0]  # first turns, later turns
    unsent = 0

    async def run_session(i: int) -> None:
        nonlocal unsent
        rng = np.random.default_rng((args.seed, 3, i))
        history: list[dict] = []
        h = dict(headers) if args.no_session_header else {**headers, SESSION_HEADER: f"session-{i}"}
        for k in range(args.turns):
            history.append({"role": "user", "content": user_message(rng, args.user_len)})
            body = dict(model=model, messages=list(history), max_tokens=args.reply_len, temperature=0.0, stream=True,
                        stream_options={"include_usage": True})
            async with limit:
                out = await stream_request(session, url, body, h, chat=True)
            if isinstance(out, str):
                failed[k > 0] += 1
                errors.append(f"session {i} turn {k}: {out}")
                unsent += args.turns - k - 1  # the history is broken: the session ends
                return
            turns.append(Turn(i, k, out))
            history.append({"role": "assistant", "content": out.text})

    start = time.monotonic()
    await asyncio.gather(*(run_session(i) for i in range(args.sessions)))
    duration = time.monotonic() - start
    rows = multiturn_rows(turns, failed[0], failed[1], duration, args.metric_percentiles)
    return rows, dict(duration_s=duration, unsent_turns=unsent, errors=errors[:5],
                      session_header=not args.no_session_header)
