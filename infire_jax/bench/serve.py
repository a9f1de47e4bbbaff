"""`bench serve`: load any OpenAI-compatible completions endpoint (ours, vLLM, llama.cpp's server...).

Requests stream (SSE) from --base-url; they arrive as a Poisson process at --request-rate (gamma
with --burstiness; inf sends all at once) with at most --max-concurrency in flight. Several rates
or concurrencies make a sweep. Reported per sweep point: request and token throughput, TTFT, TPOT,
ITL and E2E latency statistics, and goodput under the --goodput SLOs. Output lengths are what the
server reports in its usage (or the number of streamed chunks when it reports none). With
--images-per-request, each request is a chat message with that many images (serve_images.py).
Against our own server, "host share" is the part of the engine's step time spent outside the jitted
step (scheduling, batch building, detokenizing), read from its /metrics, and "grammar share" the
part of that host time spent in the grammar engine (with --structured-output).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import time

import aiohttp

from infire_jax.bench.common import BenchError, int_at_least, positive_int, rate
from infire_jax.bench.metrics import RequestTiming, pct_label, percentiles_arg, slo_arg
from infire_jax.bench.serve_images import data_urls, image_size, messages

DESCRIPTION = __doc__.split("\n\n", 1)[1]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", default=None,
                   help="the path requests go to (default: /v1/completions, or /v1/chat/completions with images)")
    p.add_argument("--model", default=None,
                   help="model name sent with each request (default: the first model of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token for the server (default: $OPENAI_API_KEY)")
    p.add_argument("--dataset", metavar="FILE", default=None,
                   help='JSONL prompts, one {"prompt": text or token ids, "output_len": N} per line, '
                        "read through grain (default: random token ids)")
    p.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens per random prompt")
    p.add_argument("--output-len", type=positive_int, default=128,
                   help="max_tokens per request (for a dataset: where a record gives no output_len)")
    p.add_argument("--num-prompts", type=positive_int, default=200,
                   help="requests per sweep point (for a dataset: its first N records)")
    p.add_argument("--vocab-size", type=positive_int, default=32000,
                   help="random prompt token ids are drawn from [0, N): keep N within the served model's vocabulary")
    p.add_argument("--request-rate", type=rate, nargs="+", default=[math.inf],
                   help="requests per second, Poisson arrivals; inf sends all at once; several values make a sweep")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="shape of the gamma inter-arrival times: 1 is Poisson, lower is burstier")
    p.add_argument("--max-concurrency", type=positive_int, nargs="+", default=None,
                   help="most requests in flight; several values make a sweep (default: no limit)")
    p.add_argument("--goodput", type=slo_arg, nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000: a request counts when it meets all")
    p.add_argument("--metric-percentiles", type=percentiles_arg, default=[50.0, 90.0, 99.0],
                   help="comma-separated percentiles reported for each latency (default: 50,90,99)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="also send ignore_eos and min_tokens (vLLM's extra fields), so every output has "
                        "exactly its max_tokens; leave it off for servers that reject unknown fields")
    p.add_argument("--num-warmups", type=int_at_least(0), default=1,
                   help="untimed requests sent first, one at a time")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before one request fails")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and the arrival times")
    p.add_argument("--structured-output", choices=["json_schema"], default=None,
                   help="constrain every request with vLLM's structured_outputs: json_schema sends a schema of "
                        "records long enough that no output completes it, so outputs keep their lengths")
    p.add_argument("--images-per-request", type=int_at_least(0), default=0,
                   help="random-pixel JPEG images (data URLs) after each request's text: chat requests, for a "
                        "server whose model takes images; --input-len then counts words")
    p.add_argument("--image-size", type=image_size, default=(1024, 1024), metavar="WxH",
                   help="the images' width x height in pixels (or N: N x N)")


def _url(base: str, path: str) -> str:
    base = base.rstrip("/")
    if base.endswith("/v1") and path.startswith("/v1/"):
        base = base[:-3]
    return base + path


async def _send(session, url: str, body: dict, headers: dict) -> RequestTiming | str:
    """One streamed completion; its timing, or a description of why it failed."""
    sent = time.perf_counter()
    times, usage = [], None
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
                chunk = json.loads(data)
                if "error" in chunk:
                    return f"error event: {json.dumps(chunk['error'])[:300]}"
                choices = chunk.get("choices")
                if choices and _brings_token(choices[0]):
                    times.append(time.perf_counter())
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    if not times:
        return "the stream held no tokens"
    prompt = body.get("prompt")
    return RequestTiming(
        ttft=times[0] - sent, e2el=end - sent, itl=[b - a for a, b in zip(times, times[1:])],
        prompt_tokens=usage["prompt_tokens"] if usage else (len(prompt) if isinstance(prompt, list) else 0),
        output_tokens=usage["completion_tokens"] if usage else len(times))


def _brings_token(choice: dict) -> bool:
    """Whether a streamed choice carries a token: a completion's chunk unless it only carries the finish
    reason; a chat chunk with content (the first, with only the role, comes before any token)."""
    delta = choice.get("delta")
    if delta is None:
        return bool(choice.get("text") or not choice.get("finish_reason"))
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


async def _first_model(session, base_url: str, headers: dict) -> str:
    url = _url(base_url, "/v1/models")
    try:
        async with session.get(url, headers=headers) as resp:
            listing = await resp.json()
        return listing["data"][0]["id"]
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError) as e:
        raise BenchError(f"cannot list the models at {url} ({type(e).__name__}: {e}); pass --model") from None


_STEP_COUNTERS = ("infire:engine_step_seconds_total", "infire:engine_device_wait_seconds_total")
_GRAMMAR_COUNTER = "infire:grammar_seconds_total"
# --structured-output json_schema: nested objects, enums, bounded numbers and strings; 1000 records
# at least, so every output runs to its max_tokens like an unconstrained one.
BENCH_SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}}},
    "required": ["id", "name", "kind", "score", "tags"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False}


async def _engine_counters(session, base_url: str, headers: dict) -> dict[str, float] | None:
    """Our server's engine time counters from /metrics; None for servers that do not export them."""
    try:
        async with session.get(_url(base_url, "/metrics"), headers=headers) as resp:
            text = await resp.text() if resp.status == 200 else ""
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
        return None
    found = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _STEP_COUNTERS or name == _GRAMMAR_COUNTER:
            found[name] = float(line.rsplit(" ", 1)[1])
    return found if all(c in found for c in _STEP_COUNTERS) else None


def _host_share(before: dict | None, after: dict | None) -> dict:
    """Share of the engine's step time spent on the host (scheduling, batching, detokenizing) rather
    than blocked on the jitted step, over one sweep point."""
    if not before or not after:
        return {}
    step = after[_STEP_COUNTERS[0]] - before[_STEP_COUNTERS[0]]
    wait = after[_STEP_COUNTERS[1]] - before[_STEP_COUNTERS[1]]
    if step <= 0:
        return {}
    out = dict(engine_step_seconds=step, engine_host_share=(step - wait) / step)
    if _GRAMMAR_COUNTER in after and step > wait:
        grammar = after[_GRAMMAR_COUNTER] - before.get(_GRAMMAR_COUNTER, 0.0)
        out |= dict(grammar_seconds=grammar, grammar_share_of_host=grammar / (step - wait))
    return out


async def _run_point(session, url, bodies, headers, *, request_rate, concurrency, burstiness, rng, bar):
    """Sends every body on the arrival schedule; returns (timings or errors, seconds from first send to last end)."""
    limit = asyncio.Semaphore(concurrency) if concurrency else None

    async def one(body):
        if limit is None:
            out = await _send(session, url, body, headers)
        else:
            async with limit:
                out = await _send(session, url, body, headers)
        bar.update(1)
        return out

    tasks = []
    start = time.perf_counter()
    for i, body in enumerate(bodies):
        tasks.append(asyncio.create_task(one(body)))
        if math.isfinite(request_rate) and i + 1 < len(bodies):
            await asyncio.sleep(rng.gamma(burstiness, 1.0 / (request_rate * burstiness)))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def _columns(percentiles, goodput: bool):
    cols = [("request_rate", "rate", "{}"), ("max_concurrency", "conc", "{}"), ("completed", "ok", "{}"),
            ("failed", "failed", "{}"), ("request_throughput", "req/s", "{:.2f}")]
    if goodput:
        cols.append(("request_goodput", "goodput req/s", "{:.2f}"))
    cols.append(("output_throughput", "out tok/s", "{:.1f}"))
    for metric in ("ttft", "tpot", "itl", "e2el"):
        cols += [(f"{pct_label(p)}_{metric}_ms", f"{pct_label(p)} {metric.upper()}", "{:.1f}") for p in percentiles]
    return cols + [("engine_host_share", "host share", "{:.1%}"), ("grammar_share_of_host", "grammar share", "{:.1%}")]


async def _bench(args, prompts) -> tuple[str, list[dict]]:
    import numpy as np
    from tqdm import tqdm

    from infire_jax.bench.datasets import random_prompts
    from infire_jax.bench.metrics import summarize

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    images = data_urls(args.images_per_request, args.image_size, args.seed)
    url = _url(args.base_url, args.endpoint or ("/v1/chat/completions" if images else "/v1/completions"))
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        model = args.model or await _first_model(session, args.base_url, headers)

        def body(prompt, output_len):
            b = dict(model=model, max_tokens=output_len, temperature=0.0, stream=True,
                     stream_options={"include_usage": True})
            b |= dict(messages=messages(prompt, images)) if images else dict(prompt=prompt)
            if args.ignore_eos:
                b |= dict(ignore_eos=True, min_tokens=output_len)
            if args.structured_output == "json_schema":
                b["structured_outputs"] = {"json": BENCH_SCHEMA}
            return b

        for i in range(args.num_warmups):
            warm = random_prompts(1, args.input_len, min(args.output_len, 8), args.vocab_size, (args.seed, 1, i))[0]
            out = await _send(session, url, body(warm.prompt, warm.output_len), headers)
            if isinstance(out, str):
                raise BenchError(f"the warmup request to {url} failed: {out}")
        points = []
        sweep = list(itertools.product(args.request_rate, args.max_concurrency or [None]))
        per_point = len(prompts) if prompts else args.num_prompts
        with tqdm(total=len(sweep) * per_point, desc="serve", unit="req", leave=False) as bar:
            for i, (request_rate, concurrency) in enumerate(sweep):
                drawn = prompts or random_prompts(args.num_prompts, args.input_len, args.output_len,
                                                  args.vocab_size, (args.seed, 0, i))
                rng = np.random.default_rng((args.seed, 2, i))
                before = await _engine_counters(session, args.base_url, headers)
                outs, duration = await _run_point(
                    session, url, [body(p.prompt, p.output_len) for p in drawn], headers,
                    request_rate=request_rate, concurrency=concurrency, burstiness=args.burstiness, rng=rng, bar=bar)
                engine_time = _host_share(before, await _engine_counters(session, args.base_url, headers))
                timings = [o for o in outs if isinstance(o, RequestTiming)]
                errors = [o for o in outs if isinstance(o, str)]
                rate_label = "inf" if math.isinf(request_rate) else request_rate
                point = dict(label=f"rate={rate_label}" + (f" c={concurrency}" if concurrency else ""),
                             request_rate=rate_label, max_concurrency=concurrency, burstiness=args.burstiness,
                             num_prompts=len(drawn), completed=len(timings), failed=len(errors), errors=errors[:5],
                             **engine_time)
                if timings:
                    point |= summarize(timings, duration, args.metric_percentiles, dict(args.goodput or []))
                    point["mean_output_len"] = point["total_output_tokens"] / len(timings)
                points.append(point)
    return model, points


def plot_point(r: dict) -> dict:
    return dict(label=r["label"], throughput=r.get("output_throughput"), ttft_ms=r.get("median_ttft_ms"),
                tpot_ms=r.get("median_tpot_ms"))


def run(args: argparse.Namespace):
    from infire_jax.bench import report
    from infire_jax.bench.common import settings
    from infire_jax.bench.datasets import read_jsonl

    if args.burstiness <= 0:
        raise BenchError("--burstiness must be positive")
    prompts = read_jsonl(args.dataset, args.num_prompts, args.output_len) if args.dataset else None
    model, points = asyncio.run(_bench(args, prompts))
    if not any(p.get("completed") for p in points):
        raise BenchError(f"every request failed; first error: {points[0]['errors'][0]}")
    payload = dict(benchmark="serve", settings=settings(args), base_url=args.base_url, model=model,
                   slos_ms=dict(args.goodput or []), results=points)
    table = report.table(points, _columns(args.metric_percentiles, bool(args.goodput)))
    return report.Result(payload, table, [plot_point(p) for p in points], f"serve: {model} at {args.base_url}")
