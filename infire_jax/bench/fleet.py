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
import math
import os
import sys
from typing import Sequence

import aiohttp

from infire_jax.bench.common import BenchError, int_at_least, positive_int
from infire_jax.bench.fleet_workloads import MIN_TOKEN_ID, SESSION_HEADER, interference, multiturn, warmup
from infire_jax.bench.metrics import pct_label, percentiles_arg
from infire_jax.bench.serve import _first_model, _url

DESCRIPTION = __doc__.split("\n\n", 1)[1]
PARSER_OPTIONS = dict(formatter_class=argparse.RawDescriptionHelpFormatter)  # keep the paragraphs


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


# ---- driving: the workload through the router, each worker's counters before and after it ---------------

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
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        model = args.model or await _first_model(session, base_url, headers)
        await warmup(session, base_url, model, headers, args)
        before = await _scrape_all(session, workers, headers)
        work = interference if args.workload == "interference" else multiturn
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
