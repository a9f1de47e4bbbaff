"""`bench latency`: TTFT and decode ms/token of a batch of fixed-length prompts, on the engine itself.

For each --batch-size, the batch's prompts (fresh random token ids every iteration) are added at
once and decoded to exactly --output-len tokens. TTFT is the time to each request's first token;
decode ms/token is the mean gap between steps that decode every request of the batch and nothing
else. Roofline: decode bytes (weights + KV at the actual contexts) per step ÷ step time, over the
measured copy bandwidth; prefill FLOPs ÷ the time to the batch's last first token, over the
measured matmul rate. Host share: the part of the engine's step time not spent waiting for the
device (scheduling, building and launching steps, detokenizing), over the timed iterations. With
--lora N the same runs follow on N random LoRA adapters, one per row round-robin (bench/lora.py),
each figure with its ratio to the base model's.

--prefix-len N gives every prompt of the run the same first N tokens (drawn once, under one tenant),
so after the first iterations the prefix cache serves them: TTFT then measures a shared system prompt's
hit (a model with linear-attention layers resumes from the state kept at the branch, which the second
iteration saves).

--import-context measures decode at contexts whose prefill this machine cannot afford (Llama 4
Scout's layers at 32k tokens on a CPU, a batch of 32 of them): each prompt's KV, but for its last
page, is written into the prefix cache with random values (`Engine.import_prompt_kv`, as a decode
worker imports a prefill worker's pages) and each request takes that as its prefix hit. A decode
step then reads exactly the bytes it would after a real prefill; TTFT and the prefill figures cover
only the prompt's last page.
"""

from __future__ import annotations

import argparse

from infire_jax.bench import lora
from infire_jax.bench.common import add_bench_engine_args, int_at_least, positive_int

DESCRIPTION = __doc__.split("\n\n", 1)[1]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=positive_int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int_at_least(2), default=128,
                   help="tokens generated per request, EOS ignored (at least 2, so a decode step can be timed)")
    p.add_argument("--batch-size", type=positive_int, nargs="+", default=[1, 8],
                   help="requests decoded together; each size given is measured in turn (e.g. 1 8)")
    p.add_argument("--num-iters-warmup", type=int_at_least(0), default=1,
                   help="untimed iterations per batch size before the timed ones")
    p.add_argument("--num-iters", type=positive_int, default=3, help="timed iterations per batch size")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's sampling temperature (0: greedy; vLLM's bench latency samples at 1.0)")
    p.add_argument("--import-context", action="store_true",
                   help="import each prompt's KV but its last page (random values) instead of prefilling it: "
                        "decode at long contexts without the prefill's cost (TTFT then covers the last page)")
    p.add_argument("--prefix-len", type=int_at_least(0), default=0,
                   help="tokens every prompt shares at its start, for the prefix cache to serve (0: none)")
    p.add_argument("--images-per-request", type=int_at_least(0), default=0,
                   help="random-pixel images after each prompt's text (a model with a vision tower, e.g. "
                        "dummy:llama-4-scout); TTFT then includes encoding them")
    p.add_argument("--image-size", type=positive_int, default=1024, help="the images' side, pixels (square)")
    lora.add_args(p)
    add_bench_engine_args(p, "the largest --batch-size")


def request_images(engine, count: int, side: int, seed) -> tuple[list, list[int]]:
    """`count` random-pixel images of `side` x `side` and the token ids of their placeholders (which
    follow a prompt's text), for a model that takes images."""
    import numpy as np
    from PIL import Image

    from infire_jax.bench.common import BenchError
    from infire_jax.vision import towers

    if engine.images is None:
        raise BenchError(f"{engine.model_name} takes no images (--images-per-request needs a vision tower, "
                         "e.g. dummy:llama-4-scout)")
    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)) for _ in range(count)]
    tokens = [t for im in images for t in towers.image_tokens(engine.images.cfg, engine.images.tiles(im).grid)]
    return images, engine.tokenizer.encode("".join(tokens), add_special_tokens=False)


def _random_pages(rng, shape: tuple[int, ...], dtype):
    """Pages [layers, pages, ...] of standard normal values: 16 pages drawn, repeated over the rest (a
    32k-token context's draw would take seconds a request, and the values do not change what a step reads)."""
    import numpy as np

    drawn = rng.standard_normal((shape[0], min(shape[1], 16), *shape[2:]), np.float32).astype(dtype)
    return np.take(drawn, np.arange(shape[1]) % max(drawn.shape[1], 1), axis=1)


def import_contexts(engine, prompts: list[list[int]], tenant: str, seed, loras: list[str | None]) -> list[int]:
    """Writes each prompt's full pages before its last token into the prefix cache under `tenant` (and
    its row's LoRA adapter), with random keys and values in the pool's dtype; returns the tokens each
    request will find cached."""
    import numpy as np

    from infire_jax.kv_transfer.blocks import KVBlocks, numpy_dtype

    layout, rng = engine.kv_layout, np.random.default_rng(seed)
    dtype, ps = numpy_dtype(layout.dtype), layout.page_size
    cached = []
    for prompt, lora_name in zip(prompts, loras):
        n = (len(prompt) - 1) // ps
        k, v = (_random_pages(rng, shape, dtype) for shape in layout.payload_shapes(n))
        engine.import_prompt_kv(KVBlocks(layout, prompt[:n * ps], tenant, k, v), lora_name)
        cached.append(n * ps)
    return cached


def measure(engine, peaks, *, batch: int, input_len: int, output_len: int, iters: int, warmup: int,
            seed: int, bar=None, loras: list[str] | None = None, import_context: bool = False,
            images_per_request: int = 0, image_size: int = 1024, prefix_len: int = 0,
            temperature: float = 0.0) -> dict:
    """Times `warmup + iters` runs of one batch (row i on LoRA adapter loras[i % N] if given; with
    `import_context`, each prompt's KV but its last page imported, `import_contexts`; each prompt
    followed by `images_per_request` random images; every prompt starting with the same `prefix_len`
    tokens; sampled at `temperature`); returns the figures of the timed runs."""
    import numpy as np

    from infire_jax.bench import driver, roofline
    from infire_jax.bench.common import BenchError, kv_itemsize, weight_bytes_per_param
    from infire_jax.bench.datasets import random_prompts

    cfg, itemsize, weight_itemsize = engine.model_config, kv_itemsize(engine), weight_bytes_per_param(engine)
    images, image_ids = request_images(engine, images_per_request, image_size, seed) if images_per_request \
        else (None, [])
    reserved = set(image_ids)
    if prefix_len >= input_len:
        raise BenchError(f"--prefix-len {prefix_len} leaves no token of the {input_len}-token prompts to compute")
    shared = np.random.default_rng((seed, prefix_len)).integers(0, cfg.vocab_size, prefix_len).tolist()
    ttfts, e2es, decode_s, decode_bytes, prefill_s, prefill_flops, added = [], [], 0.0, 0.0, 0.0, 0, []
    cached_tokens = 0
    kv_read = local_kv_read = 0
    decode_steps = output_tokens = 0
    step_s0 = wait_s0 = 0.0
    for it in range(warmup + iters):
        if it == warmup:
            step_s0, wait_s0 = engine.stats.step_seconds, engine.stats.device_wait_seconds
        prompts = [[t if t not in reserved else 0 for t in shared + p.prompt[prefix_len:]] + image_ids
                   for p in random_prompts(batch, input_len, output_len, cfg.vocab_size, seed=(seed, batch, it))]
        tenant = "bench-latency-shared" if prefix_len else f"bench-latency-{batch}-{it}"
        rows = [loras[i % len(loras)] for i in range(batch)] if loras else None
        imported = import_contexts(engine, prompts, tenant, (seed, batch, it), rows or [None] * batch) \
            if import_context else None
        trace = driver.run(engine, prompts, [output_len] * batch, concurrency=batch, tenant=tenant, loras=rows,
                           images=[images] * batch if images else None, temperature=temperature)
        if imported is not None and [r.num_cached_tokens for r in trace.requests] != imported:
            raise BenchError(f"the imported contexts were not all found cached ({sum(imported)} tokens imported, "
                             f"{sum(r.num_cached_tokens for r in trace.requests)} hit): prefix caching is off, or the KV "
                             f"pool cannot hold {batch} x {input_len} tokens (--num-kv-pages / --kv-cache-memory)")
        if bar is not None:
            bar.update(1)
        if it < warmup:
            continue
        timings = [r.timing() for r in trace.requests]
        ttfts += [t.ttft for t in timings]
        cached_tokens += sum(r.num_cached_tokens for r in trace.requests)
        added += [r.added for r in trace.requests]
        e2es.append(trace.duration)
        output_tokens += sum(t.output_tokens for t in timings)
        prefill_s += max(r.token_times[0] for r in trace.requests) - trace.start
        prefill_flops += sum(roofline.forward_flops(cfg, r.prompt_len - r.num_cached_tokens, r.num_cached_tokens)
                             for r in trace.requests)
        for seconds, step in trace.decode_intervals(batch):
            decode_s += seconds
            for contexts in step.step_contexts():
                decode_bytes += roofline.decode_step_bytes(cfg, itemsize, contexts, weight_itemsize)
                kv, local = roofline.kv_bytes_read(cfg, itemsize, contexts)
                kv_read, local_kv_read = kv_read + kv, local_kv_read + local
                decode_steps += 1
    if decode_steps == 0:
        raise BenchError(f"no step decoded all {batch} requests together: the KV pool (--num-kv-pages) "
                         f"or --max-num-seqs cannot hold the whole batch")
    step_s = decode_s / decode_steps
    engine_s = engine.stats.step_seconds - step_s0
    host_share = (engine_s - (engine.stats.device_wait_seconds - wait_s0)) / engine_s
    e2e_ms = np.asarray(e2es) * 1000
    return dict(
        label=f"bs={batch}", batch_size=batch, input_len=input_len, output_len=output_len, prefix_len=prefix_len,
        mean_cached_tokens=cached_tokens / (batch * iters),
        images_per_request=images_per_request, image_size=image_size if images_per_request else None,
        mean_add_ms=float(np.mean(added) * 1000),
        num_iters=iters, num_requests=batch * iters, total_output_tokens=output_tokens,
        mean_ttft_ms=float(np.mean(ttfts) * 1000), p50_ttft_ms=float(np.median(ttfts) * 1000),
        prefill_ms=prefill_s / iters * 1000,
        decode_ms_per_token=step_s * 1000, decode_steps_timed=decode_steps,
        decode_tokens_per_s=batch / step_s, host_share=host_share,
        mean_e2e_ms=float(e2e_ms.mean()),
        **{f"p{p}_e2e_ms": float(np.percentile(e2e_ms, p)) for p in (50, 90, 99)},
        output_throughput=output_tokens / sum(e2es),
        decode_bytes_per_step=decode_bytes / decode_steps,
        decode_kv_mb_per_step=kv_read / decode_steps / 1e6,
        local_kv_share=local_kv_read / kv_read if kv_read else 0.0,
        decode_bandwidth=decode_bytes / decode_s,
        decode_bw_util=decode_bytes / decode_s / peaks.total_bandwidth,
        prefill_flops=prefill_flops / iters,
        prefill_flops_per_s=prefill_flops / prefill_s,
        prefill_flops_util=prefill_flops / prefill_s / peaks.total_matmul_flops,
    )


COLUMNS = [
    ("batch_size", "batch", "{}"), ("input_len", "in", "{}"), ("output_len", "out", "{}"),
    ("mean_cached_tokens", "cached", "{:.0f}"), ("mean_ttft_ms", "TTFT ms", "{:.1f}"),
    ("mean_add_ms", "of it adding", "{:.1f}"),
    ("decode_ms_per_token", "decode ms/tok", "{:.2f}"),
    ("decode_tokens_per_s", "decode tok/s", "{:.1f}"), ("mean_e2e_ms", "E2E ms", "{:.0f}"),
    ("host_share", "host share", "{:.1%}"), ("decode_kv_mb_per_step", "KV MB/step", "{:.1f}"),
    ("local_kv_share", "chunk/window KV", "{:.0%}"), ("decode_bw_util", "decode BW roofline", "{:.1%}"),
    ("prefill_flops_util", "prefill FLOP roofline", "{:.1%}"),
]
LORA_COLUMNS = [("variant", "model", "{}"), *COLUMNS[:6], ("decode_ms_per_token_vs_base", "decode vs base", "{:.3f}x"),
                ("mean_ttft_ms_vs_base", "TTFT vs base", "{:.3f}x"), *COLUMNS[6:]]


def plot_point(r: dict) -> dict:
    return dict(label=r["label"], throughput=r["decode_tokens_per_s"], ttft_ms=r["mean_ttft_ms"],
                tpot_ms=r["decode_ms_per_token"], series=r.get("variant", "base"))


def run(args: argparse.Namespace):
    from tqdm import tqdm

    from infire_jax.bench import report
    from infire_jax.bench.common import device_info, engine_info, settings

    results, infos = [], {}
    runs = len(args.batch_size) * (args.num_iters_warmup + args.num_iters) * (2 if args.lora else 1)
    with tqdm(total=runs, desc="latency", unit="iter", leave=False) as bar:
        for variant, engine, peaks, loras in lora.engines(args, max(args.batch_size)):
            infos[variant] = engine_info(engine)
            for batch in args.batch_size:
                r = measure(engine, peaks, batch=batch, input_len=args.input_len, output_len=args.output_len,
                            iters=args.num_iters, warmup=args.num_iters_warmup, seed=args.seed, bar=bar, loras=loras,
                            import_context=args.import_context, images_per_request=args.images_per_request,
                            image_size=args.image_size, prefix_len=args.prefix_len, temperature=args.temperature)
                results.append({**r, "variant": variant})
            name = engine.model_name
    results = lora.with_ratios(results, ("decode_ms_per_token", "mean_ttft_ms"))
    payload = dict(benchmark="latency", settings=settings(args), device=device_info(), peaks=peaks.to_dict(),
                   engine=next(iter(infos.values())) if len(infos) == 1 else infos, results=results)
    return report.Result(payload, report.table(results, LORA_COLUMNS if args.lora else COLUMNS),
                         [plot_point(r) for r in results], f"latency: {name}")
