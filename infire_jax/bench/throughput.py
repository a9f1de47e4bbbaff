"""`bench throughput`: offline throughput of the engine, over a sweep of concurrencies.

Prompts are random token ids of --input-len, or the records of a JSONL --dataset. For each
--max-concurrency, every prompt runs to its exact output length (EOS ignored), with at most that
many requests in the engine: a new one is added as soon as one finishes. Roofline: bytes read by
the sampling steps (weights + KV at the actual contexts) ÷ wall time, over the measured copy
bandwidth; all FLOPs (prefill and decode) ÷ wall time, over the measured matmul rate. With --lora N
the sweep runs again on N random LoRA adapters, one per request round-robin (bench/lora.py), each
figure with its ratio to the base model's.
"""

from __future__ import annotations

import argparse

from infire_jax.bench import lora
from infire_jax.bench.common import add_bench_engine_args, int_at_least, positive_int

DESCRIPTION = __doc__.split("\n\n", 1)[1]
PERCENTILES = (50, 90, 99)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens per random prompt")
    p.add_argument("--output-len", type=positive_int, default=128,
                   help="tokens generated per request (for a dataset: where a record gives no output_len)")
    p.add_argument("--num-prompts", type=positive_int, default=256,
                   help="requests per sweep point (for a dataset: its first N records)")
    p.add_argument("--dataset", metavar="FILE", default=None,
                   help='JSONL prompts, one {"prompt": text or token ids, "output_len": N} per line, '
                        "read through grain (default: random token ids)")
    p.add_argument("--max-concurrency", type=positive_int, nargs="+", default=None,
                   help="most requests in flight; several values make a sweep (default: all prompts at once)")
    p.add_argument("--num-warmup-prompts", type=int_at_least(0), default=None,
                   help="untimed random prompts (at most 8 output tokens each) run first, all at once "
                        "(default: the largest concurrency, at most --num-prompts; 0 skips the warmup)")
    lora.add_args(p)
    add_bench_engine_args(p, "the largest --max-concurrency (64 when all prompts go at once)")


def measure(engine, peaks, prompts, output_lens, *, concurrency: int, tenant: str, label: str, bar=None,
            loras: list[str] | None = None) -> dict:
    """Runs the prompts at `concurrency` (prompt i on LoRA adapter loras[i % N] if given); returns
    throughput, latency statistics and roofline fractions."""
    from infire_jax.bench import driver, roofline
    from infire_jax.bench.common import kv_itemsize, weight_bytes_per_param
    from infire_jax.bench.metrics import summarize

    cfg, itemsize = engine.model_config, kv_itemsize(engine)
    trace = driver.run(engine, prompts, output_lens, concurrency=concurrency, tenant=tenant,
                       on_done=bar.update if bar is not None else None,
                       loras=[loras[i % len(loras)] for i in range(len(prompts))] if loras else None)
    out = dict(label=label, max_concurrency=concurrency, num_prompts=len(prompts))
    out |= summarize([r.timing() for r in trace.requests], trace.duration, PERCENTILES)
    weight_itemsize = weight_bytes_per_param(engine)
    step_bytes = sum(roofline.decode_step_bytes(cfg, itemsize, c, weight_itemsize)
                     for s in trace.steps for c in s.step_contexts())
    flops = sum(roofline.forward_flops(cfg, r.prompt_len - r.num_cached_tokens, r.num_cached_tokens)
                + sum(roofline.forward_flops(cfg, 1, r.prompt_len + j - 1) for j in range(1, len(r.token_times)))
                for r in trace.requests)
    out |= dict(
        cached_prompt_tokens=sum(r.num_cached_tokens for r in trace.requests),
        preemptions=trace.preemptions, max_running=trace.max_running, sampling_steps=len(trace.steps),
        step_bytes=step_bytes, bandwidth=step_bytes / trace.duration,
        bw_util=step_bytes / trace.duration / peaks.total_bandwidth,
        flops=flops, flops_per_s=flops / trace.duration, flops_util=flops / trace.duration / peaks.total_matmul_flops,
    )
    return out


def warmup(engine, num: int, input_len: int, output_len: int, seed, loras: list[str] | None = None) -> None:
    """Runs `num` random prompts at once (on the LoRA adapters, if given), so first-use costs stay out of
    the timed runs."""
    from infire_jax.bench import driver
    from infire_jax.bench.datasets import random_prompts

    if num > 0:
        prompts = random_prompts(num, input_len, output_len, engine.model_config.vocab_size, seed)
        driver.run(engine, [p.prompt for p in prompts], [p.output_len for p in prompts], concurrency=num,
                   tenant="bench-warmup", loras=[loras[i % len(loras)] for i in range(num)] if loras else None)


COLUMNS = [
    ("max_concurrency", "concurrency", "{}"), ("completed", "requests", "{}"),
    ("request_throughput", "req/s", "{:.2f}"), ("output_throughput", "out tok/s", "{:.1f}"),
    ("total_token_throughput", "total tok/s", "{:.1f}"), ("mean_ttft_ms", "TTFT ms", "{:.1f}"),
    ("p99_ttft_ms", "p99 TTFT", "{:.1f}"), ("mean_tpot_ms", "TPOT ms", "{:.2f}"),
    ("p99_tpot_ms", "p99 TPOT", "{:.2f}"), ("preemptions", "preempt", "{}"),
    ("bw_util", "BW roofline", "{:.1%}"), ("flops_util", "FLOP roofline", "{:.1%}"),
]
LORA_COLUMNS = [("variant", "model", "{}"), *COLUMNS[:4], ("output_throughput_vs_base", "out tok/s vs base", "{:.3f}x"),
                *COLUMNS[4:8], ("mean_tpot_ms_vs_base", "TPOT vs base", "{:.3f}x"), *COLUMNS[8:]]


def plot_point(r: dict) -> dict:
    return dict(label=r["label"], throughput=r["output_throughput"], ttft_ms=r["mean_ttft_ms"],
                tpot_ms=r["mean_tpot_ms"], series=r.get("variant", "base"))


def run(args: argparse.Namespace):
    from infire_jax.bench import report
    from infire_jax.bench.common import device_info, engine_info, settings
    from infire_jax.bench.datasets import read_jsonl

    dataset = read_jsonl(args.dataset, args.num_prompts, args.output_len) if args.dataset else None
    num = len(dataset) if dataset else args.num_prompts
    sweep = args.max_concurrency or [num]
    results, infos = [], {}
    for variant, engine, peaks, loras in lora.engines(args, max(args.max_concurrency) if args.max_concurrency else 64):
        infos[variant] = engine_info(engine)
        results += [{**r, "variant": variant} for r in _sweep(engine, peaks, args, dataset, num, sweep, loras)]
        name = engine.model_name
    results = lora.with_ratios(results, ("output_throughput", "mean_tpot_ms"))
    payload = dict(benchmark="throughput", settings=settings(args), device=device_info(), peaks=peaks.to_dict(),
                   engine=next(iter(infos.values())) if len(infos) == 1 else infos, results=results)
    return report.Result(payload, report.table(results, LORA_COLUMNS if args.lora else COLUMNS),
                         [plot_point(r) for r in results], f"throughput: {name}")


def _sweep(engine, peaks, args: argparse.Namespace, dataset, num: int, sweep: list[int],
           loras: list[str] | None = None) -> list[dict]:
    """Warms up, then measures every sweep point (fresh random prompts for each, or the dataset's)."""
    from tqdm import tqdm

    from infire_jax.bench.datasets import random_prompts

    if dataset:
        prompts = [engine.tokenize_prompt(p.prompt) for p in dataset]
        output_lens = [p.output_len for p in dataset]
        warm_shape = len(prompts[0]), min(8, output_lens[0])
    else:
        warm_shape = args.input_len, min(8, args.output_len)
    warm = args.num_warmup_prompts if args.num_warmup_prompts is not None else min(max(sweep), num)
    warmup(engine, warm, *warm_shape, seed=(args.seed, 1), loras=loras)
    results = []
    with tqdm(total=num * len(sweep), desc="throughput", unit="req", leave=False) as bar:
        for i, c in enumerate(sweep):
            if not dataset:
                drawn = random_prompts(num, args.input_len, args.output_len, engine.model_config.vocab_size,
                                       (args.seed, 0, i))
                prompts, output_lens = [p.prompt for p in drawn], [p.output_len for p in drawn]
            results.append(measure(engine, peaks, prompts, output_lens, concurrency=c,
                                   tenant=f"bench-throughput-{i}", label=f"c={c}", bar=bar, loras=loras))
    return results
