"""`bench fleet`: decode interference from long prompts, and multi-turn prefix-cache reuse, through a fleet's router.

It runs against a router that is already up (--base-url), or starts a fleet from its YAML file
(--fleet FILE: see router/fleet.py; the router takes any free port) and stops it at the end. The
router's routing policy is one of its flags, so comparing policies (or replicas against a
disaggregated fleet) is one run per configuration; the report names the configuration (--label,
or the fleet file's workers and router flags). With --fleet the report also shows what each
worker's /metrics counted over the run (finished sequences, prompt tokens, prefix-cache hits,
generated tokens, KV bytes received): where the router sent the work.

--workload interference: --streams decode streams each send one request after another (a random
--prompt-len-token prompt, --decode-len output tokens, ignore_eos, greedy, streamed), while long
prompts (--long-len tokens, --long-max-tokens output tokens) arrive as a Poisson process at
--long-rate per second (0: none, a baseline), for --duration seconds. Among replicas, a long
prompt's prefill shares the steps of the decodes of the replica it lands on; a disaggregated
fleet prefills it on a prefill worker. Reported separately for the decode requests (all; those
whose decode phase overlapped some long prompt's prefill, sent -> first token; the others) and the
long prompts: TTFT, TPOT ((E2E - TTFT) / (output tokens - 1), per request) and ITL percentiles.

--workload multiturn: --sessions chat sessions of --turns turns each. Every turn appends a user
message (--user-len tokens or so of random words) to the session's history, sends the whole
history to /v1/chat/completions (greedy, --reply-len tokens at most, with the header
`x-session-affinity: session-I` unless --no-session-header), and appends the reply. Every session
is open from the start; at most --concurrency turns are in flight. Reported for the first turns,
the later turns and all of them: the prefix-cache hit ratio, the sum of
usage.prompt_tokens_details.cached_tokens over the sum of usage.prompt_tokens; the same over the
reusable tokens only (a later turn's previous prompt and reply: its new user message can never be
cached), which says how close routing and caching came to the workload's own ceiling; and TTFT.

Times are taken on the client's monotonic clock.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
import time
from typing import Sequence

import aiohttp
import numpy as np

from infire_jax.bench.common import BenchError, int_at_least, positive_int
from infire_jax.bench.metrics import RequestTiming, latency_stats, pct_label, percentiles_arg

DESCRIPTION = __doc__.split("\n\n", 1)[1]
PARSER_OPTIONS = dict(formatter_class=argparse.RawDescriptionHelpFormatter)  # keep the paragraphs
SESSION_HEADER = "x-session-affinity"
MIN_TOKEN_ID = 100  # random prompts skip the low ids, where special tokens live


def _non_negative_rate(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=["interference", "multiturn"], default="interference",
                   help="interference: decode streams against long prompts; multiturn: chat sessions and "
                        "their prefix-cache hits (default: interference)")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--base-url", default=None,
                        help="a running router (or single server), e.g. http://127.0.0.1:8000 "
                             "(the default when --fleet is not given)")
    target.add_argument("--fleet", metavar="FILE", default=None,
                        help="start the fleet of this YAML file (router on a free port), run, then stop it")
    p.add_argument("--fleet-log-dir", default=None,
                   help="with --fleet: directory of the fleet's process logs (default: a new temporary directory)")
    p.add_argument("--label", default=None,
                   help="name of the configuration in the report (default: the fleet file's workers and "
                        "router flags, or the base URL)")
    p.add_argument("--model", default=None,
                   help="model name sent with each request (default: the first model of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token for the router (default: $OPENAI_API_KEY)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts, messages and arrival times")
    p.add_argument("--metric-percentiles", type=percentiles_arg, default=[50.0, 90.0, 99.0],
                   help="comma-separated percentiles reported for each latency (default: 50,90,99)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before one request fails")
    p.add_argument("--num-warmups", type=int_at_least(0), default=1,
                   help="untimed short requests sent first, one at a time")
    g = p.add_argument_group("interference workload")
    g.add_argument("--streams", type=positive_int, default=4, help="decode streams, each one request after another")
    g.add_argument("--prompt-len", type=positive_int, default=64, help="prompt tokens of a decode stream's request")
    g.add_argument("--decode-len", type=positive_int, default=128, help="output tokens of a decode stream's request")
    g.add_argument("--long-len", type=positive_int, default=2048, help="prompt tokens of a long prompt")
    g.add_argument("--long-max-tokens", type=positive_int, default=16, help="output tokens of a long prompt")
    g.add_argument("--long-rate", type=_non_negative_rate, default=0.1,
                   help="long prompts per second, Poisson arrivals (0: none, the baseline)")
    g.add_argument("--duration", type=_positive_seconds, default=120.0,
                   help="seconds during which requests start (those in flight then still finish)")
    g.add_argument("--vocab-size", type=positive_int, default=40000,
                   help=f"random prompt token ids are drawn from [{MIN_TOKEN_ID}, N): keep N within the "
                        "served model's vocabulary")
    g = p.add_argument_group("multiturn workload")
    g.add_argument("--sessions", type=positive_int, default=16, help="chat sessions")
    g.add_argument("--turns", type=positive_int, default=6, help="turns of each session")
    g.add_argument("--user-len", type=positive_int, default=100, help="tokens (about) of each user message")
    g.add_argument("--reply-len", type=positive_int, default=32, help="max_tokens of each assistant reply")
    g.add_argument("--concurrency", type=positive_int, default=4, help="most turns in flight, over all sessions")
    g.add_argument("--no-session-header", action="store_true",
                   help=f"send no {SESSION_HEADER} header (to compare routing without session affinity)")


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


# Counters of each worker's /metrics, summed over their labels, that the report shows per worker.
WORKER_COUNTERS = {"requests": "infire:request_success_total", "prompt_tokens": "infire:prompt_tokens_total",
                   "generated_tokens": "infire:generation_tokens_total",
                   "prefix_cache_hits": "infire:prefix_cache_hits_total",
                   "kv_received_bytes": "infire:kv_transfer_received_bytes_total"}


def parse_counters(text: str) -> dict[str, float]:
    """The WORKER_COUNTERS samples of a Prometheus text page, each summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = set(WORKER_COUNTERS.values())
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found


def counter_deltas(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float | None]:
    """Each WORKER_COUNTERS figure's growth between two scrapes (a counter not on a page yet, like
    one with labels before its first increment, counts 0); all None when a scrape failed."""
    if before is None or after is None:
        return dict.fromkeys(WORKER_COUNTERS)
    return {key: after.get(name, 0.0) - before.get(name, 0.0) for key, name in WORKER_COUNTERS.items()}


# ---- requests -------------------------------------------------------------------------------------------

def _url(base: str, path: str) -> str:
    from infire_jax.bench.serve import _url as url

    return url(base, path)


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


async def _warmup(session, base_url: str, model: str, headers: dict, args) -> None:
    rng = np.random.default_rng((args.seed, 9))
    url = _url(base_url, "/v1/completions")
    for _ in range(args.num_warmups):
        out = await stream_request(session, url, _completion(model, _random_ids(rng, 16, args.vocab_size), 4),
                                   headers, chat=False)
        if isinstance(out, str):
            raise BenchError(f"the warmup request to {url} failed: {out}")


async def _interference(session, base_url: str, model: str, headers: dict, args) -> tuple[list[dict], dict]:
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


async def _multiturn(session, base_url: str, model: str, headers: dict, args) -> tuple[list[dict], dict]:
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


async def _scrape(session, url: str, headers: dict) -> dict[str, float] | None:
    try:
        async with session.get(_url(url, "/metrics"), headers=headers) as resp:
            return parse_counters(await resp.text()) if resp.status == 200 else None
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
        return None  # a dead worker, or a server without these metrics


async def _scrape_all(session, workers: Sequence[dict], headers: dict) -> list[dict[str, float] | None]:
    return list(await asyncio.gather(*(_scrape(session, w["url"], headers) for w in workers)))


async def _bench(args, base_url: str, workers: Sequence[dict]) -> tuple[str, list[dict], dict]:
    """`workers` (name, role, url) are scraped before and after the workload, for per-worker counts."""
    from infire_jax.bench.serve import _first_model

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        model = args.model or await _first_model(session, base_url, headers)
        await _warmup(session, base_url, model, headers, args)
        before = await _scrape_all(session, workers, headers)
        work = _interference if args.workload == "interference" else _multiturn
        rows, extra = await work(session, base_url, model, headers, args)
        after = await _scrape_all(session, workers, headers)
    extra["per_worker"] = [dict(name=w["name"], role=w["role"], url=w["url"], **counter_deltas(b, a))
                           for w, b, a in zip(workers, before, after)]
    return model, rows, extra


# ---- report ---------------------------------------------------------------------------------------------

def _columns(workload: str, percentiles: Sequence[float]) -> list[tuple[str, str, str]]:
    cols = [("label", "requests", "{}"), ("completed", "ok", "{}"), ("failed", "failed", "{}")]
    if workload == "multiturn":
        cols += [("prompt_tokens", "prompt tok", "{}"), ("cached_tokens", "cached tok", "{}"),
                 ("cache_hit_ratio", "hit ratio", "{:.1%}"), ("reusable_tokens", "reusable tok", "{}"),
                 ("reusable_hit_ratio", "of reusable", "{:.1%}")]
        metrics = ("ttft", "e2el")
    else:
        cols.append(("output_throughput", "out tok/s", "{:.1f}"))
        metrics = ("ttft", "tpot", "itl")
    for metric in metrics:
        cols += [(f"{pct_label(p)}_{metric}_ms", f"{pct_label(p)} {metric.upper()}", "{:.1f}") for p in percentiles]
    return cols


WORKER_COLUMNS = [("name", "worker", "{}"), ("role", "role", "{}"), ("requests", "finished seqs", "{:.0f}"),
                  ("prompt_tokens", "prompt tok", "{:.0f}"), ("prefix_cache_hits", "prefix hits", "{:.0f}"),
                  ("generated_tokens", "generated tok", "{:.0f}"), ("kv_received_bytes", "KV in (bytes)", "{:.0f}")]


def fleet_label(config, session_header: bool | None = None) -> str:
    """The configuration as the report names it: the fleet's workers and router flags."""
    label = config.describe()
    if session_header is not None:
        label += f"; {'' if session_header else 'no '}{SESSION_HEADER} header"
    return label


def _start_fleet(path: str, log_dir: str | None):
    """The fleet of a YAML file, started, its router on a free port; BenchError if it cannot start."""
    from router.fleet import Fleet, FleetError
    from router.fleet_config import load_fleet_config

    try:
        config = load_fleet_config(path)
    except (OSError, ValueError) as e:
        raise BenchError(str(e)) from None
    fleet = Fleet(config, router_port=0, log_dir=log_dir)
    print(f"fleet: starting {config.describe()} (logs in {fleet.log_dir})", file=sys.stderr, flush=True)
    try:
        fleet.start()  # stops what it started if it fails
    except FleetError as e:
        raise BenchError(f"the fleet of {path} did not start: {e}") from None
    print("\n".join(fleet.describe()), file=sys.stderr, flush=True)
    return fleet


def run(args: argparse.Namespace):
    from infire_jax.bench import report
    from infire_jax.bench.common import settings

    fleet = _start_fleet(args.fleet, args.fleet_log_dir) if args.fleet else None
    try:
        fleet_info = None
        base_url = args.base_url or "http://127.0.0.1:8000"
        header = None if args.workload != "multiturn" else not args.no_session_header
        label = args.label
        if fleet is not None:
            config = fleet.config
            base_url = fleet.router_url
            fleet_info = dict(config=args.fleet, description=config.describe(), router_url=base_url,
                              router_args=list(config.router.args), log_dir=fleet.log_dir,
                              workers=[dict(name=w.name, role=w.role, url=fleet.urls[w.name],
                                            cpus=list(w.cpus) if w.cpus else None,
                                            gpus=list(w.gpus) if w.gpus else None) for w in config.workers])
            label = label or fleet_label(config, header)
        if label is None:
            label = f"router at {base_url}"
            if header is not None:
                label += f"; {'' if header else 'no '}{SESSION_HEADER} header"
        model, rows, extra = asyncio.run(_bench(args, base_url, fleet_info["workers"] if fleet_info else []))
    finally:
        if fleet is not None:
            fleet.stop()
    if not any(r["completed"] for r in rows):
        errors = extra["errors"]
        first = next((e for es in errors.values() for e in es), None) if isinstance(errors, dict) else \
            (errors[0] if errors else None)
        raise BenchError(f"every request failed; first error: {first}")
    payload = dict(benchmark="fleet", workload=args.workload, label=label, settings=settings(args), base_url=base_url,
                   model=model, fleet=fleet_info, results=rows, **extra)
    table = report.table(rows, _columns(args.workload, args.metric_percentiles))
    if extra["per_worker"]:
        table += "\n\nper worker, from its /metrics over the run:\n" + report.table(extra["per_worker"], WORKER_COLUMNS)
    # One series per class of request: the classes are not a sweep, no line joins them.
    points = [dict(label=r["label"], series=r["label"], throughput=r.get("output_throughput"),
                   ttft_ms=r.get("median_ttft_ms"), tpot_ms=r.get("median_tpot_ms")) for r in rows]
    title = f"fleet {args.workload}: {label} ({model})"
    if args.workload == "multiturn":
        later, every = rows[1]["cache_hit_ratio"], rows[2]["cache_hit_ratio"]
        fmt = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
        title += (f"\nprefix-cache hit ratio: {fmt(later)} after each session's first turn, {fmt(every)} over all "
                  f"turns; {fmt(rows[1]['reusable_hit_ratio'])} of the reusable tokens (earlier turns)")
    return report.Result(payload, table, points, title)
