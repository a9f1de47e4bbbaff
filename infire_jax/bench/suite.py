"""`bench suite`: the headline GPU figures in one command, on one engine, each with its roofline fraction.

Defaults measure dummy:llama-3.1-8b (bfloat16 on a GPU): batch-1 decode ms/token and TTFT of a
2048-token prompt (one latency run), then offline throughput at 1000/1000 input/output tokens at
concurrency 64 and 256. The JSON's "figures" list names every figure with its value, unit and
roofline fraction; the full latency and throughput results follow.
"""

from __future__ import annotations

import argparse

from infire_jax.bench.common import add_bench_engine_args, int_at_least, positive_int

DESCRIPTION = __doc__.split("\n\n", 1)[1]
# This command re-declares the engine's --model flag with its own default.
PARSER_OPTIONS = dict(conflict_handler="resolve")

DECODE_ROOFLINE = "decode bytes/s (weights + KV) / measured copy bandwidth"
PREFILL_ROOFLINE = "prefill FLOP/s / measured matmul rate"
THROUGHPUT_ROOFLINE = "bytes/s read by sampling steps / measured copy bandwidth"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--latency-input-len", type=positive_int, default=2048,
                   help="prompt tokens of the latency run (its TTFT is the long-prompt figure)")
    p.add_argument("--latency-output-len", type=int_at_least(2), default=128,
                   help="tokens generated in the latency run (at least 2)")
    p.add_argument("--latency-batch-size", type=positive_int, nargs="+", default=[1],
                   help="batch sizes of the latency run")
    p.add_argument("--num-iters-warmup", type=int_at_least(0), default=1,
                   help="untimed latency iterations per batch size")
    p.add_argument("--num-iters", type=positive_int, default=3, help="timed latency iterations per batch size")
    p.add_argument("--input-len", type=positive_int, default=1000, help="prompt tokens of the throughput runs")
    p.add_argument("--output-len", type=positive_int, default=1000, help="tokens generated per throughput request")
    p.add_argument("--max-concurrency", type=positive_int, nargs="+", default=[64, 256],
                   help="concurrencies of the throughput runs")
    p.add_argument("--num-prompts", type=positive_int, default=None,
                   help="requests per throughput run (default: twice its concurrency)")
    p.add_argument("--num-warmup-prompts", type=int_at_least(0), default=None,
                   help="untimed random prompts run all at once before the throughput runs "
                        "(default: the largest concurrency; 0 skips)")
    add_bench_engine_args(p, "the largest of --max-concurrency and --latency-batch-size")
    p.add_argument("--model", default="dummy:llama-3.1-8b",
                   help='a .gguf file, an HF model directory, or dummy:<name>; "" is the embedded default model')


def figures(latency: list[dict], throughput: list[dict]) -> list[dict]:
    """Every headline figure with its roofline fraction, under a stable key."""
    out = []
    for r in latency:
        b, n = r["batch_size"], r["input_len"]
        out.append(dict(key=f"decode_ms_per_token_bs{b}", value=r["decode_ms_per_token"], unit="ms/token",
                        description=f"decode, batch {b}, context {n}..{n + r['output_len']}",
                        roofline_fraction=r["decode_bw_util"], roofline=DECODE_ROOFLINE))
        out.append(dict(key=f"ttft_ms_{n}_bs{b}", value=r["mean_ttft_ms"], unit="ms",
                        description=f"time to first token, {n}-token prompt, batch {b}",
                        roofline_fraction=r["prefill_flops_util"], roofline=PREFILL_ROOFLINE))
    for r in throughput:
        c = r["max_concurrency"]
        out.append(dict(key=f"output_tokens_per_s_c{c}", value=r["output_throughput"], unit="tok/s",
                        description=f"offline output throughput, {r['input_len']}/{r['output_len']} tokens, "
                                    f"concurrency {c}, {r['num_prompts']} requests",
                        roofline_fraction=r["bw_util"], roofline=THROUGHPUT_ROOFLINE,
                        flops_fraction=r["flops_util"]))
    return out


def _measure(engine, peaks, args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """The latency runs, then a warmup and the throughput runs."""
    from tqdm import tqdm

    from infire_jax.bench import latency, throughput
    from infire_jax.bench.datasets import random_prompts

    lat = []
    with tqdm(total=len(args.latency_batch_size) * (args.num_iters_warmup + args.num_iters), desc="latency",
              unit="iter", leave=False) as bar:
        for b in args.latency_batch_size:
            lat.append(latency.measure(engine, peaks, batch=b, input_len=args.latency_input_len,
                                       output_len=args.latency_output_len, iters=args.num_iters,
                                       warmup=args.num_iters_warmup, seed=args.seed, bar=bar))
    counts = [args.num_prompts or 2 * c for c in args.max_concurrency]
    warm = args.num_warmup_prompts if args.num_warmup_prompts is not None else max(args.max_concurrency)
    throughput.warmup(engine, warm, args.input_len, min(8, args.output_len), seed=(args.seed, 1))
    thr = []
    vocab = engine.model_config.vocab_size
    with tqdm(total=sum(counts), desc="throughput", unit="req", leave=False) as bar:
        for i, (c, n) in enumerate(zip(args.max_concurrency, counts)):
            drawn = random_prompts(n, args.input_len, args.output_len, vocab, (args.seed, 0, i))
            r = throughput.measure(engine, peaks, [p.prompt for p in drawn], [p.output_len for p in drawn],
                                   concurrency=c, tenant=f"bench-suite-{i}", label=f"c={c}", bar=bar)
            thr.append(r | dict(input_len=args.input_len, output_len=args.output_len))
    return lat, thr


def run(args: argparse.Namespace):
    from infire_jax.bench import latency, report, throughput
    from infire_jax.bench.common import device_info, engine_info, settings, start_engine

    engine, peaks = start_engine(args, max(*args.max_concurrency, *args.latency_batch_size))
    try:
        lat, thr = _measure(engine, peaks, args)
    finally:
        engine.close()
    figs = figures(lat, thr)
    payload = dict(benchmark="suite", settings=settings(args), device=device_info(), peaks=peaks.to_dict(),
                   engine=engine_info(engine), figures=figs, latency=lat, throughput=thr)
    columns = [("key", "figure", "{}"), ("value", "value", "{:.2f}"), ("unit", "unit", "{}"),
               ("roofline_fraction", "roofline", "{:.1%}"), ("roofline", "roofline basis", "{}")]
    text = "\n\n".join([report.table(figs, columns), report.table(lat, latency.COLUMNS),
                        report.table(thr, throughput.COLUMNS)])
    points = ([throughput.plot_point(r) | {"series": "throughput"} for r in thr]
              + [latency.plot_point(r) | {"series": "latency"} for r in lat])
    return report.Result(payload, text, points, f"suite: {engine.model_name} on {peaks.device}")
