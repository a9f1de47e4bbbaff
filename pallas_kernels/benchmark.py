"""GPU micro-benchmark of the Pallas attention kernels against the XLA reference attention, and
(`--quant`) of the quantized and MoE matmul kernels (pallas_kernels/quant_bench.py has those rows).

    python -m pallas_kernels.benchmark [--json FILE] [--iters N]
    python -m pallas_kernels.benchmark --quant [--sweep] [--cases REGEX] [--tokamax] [--json FILE]

Shapes of Llama-3.1-8B attention (32 q heads, 8 kv heads, head_dim 128, bfloat16, page size 16),
one layer's pool with pages handed out in random order: decode at batch 1/64/256 over contexts of
1k/2k/4k tokens, and the prefill of a 2k-token prompt. Every case times the KV write, its attention
kernel alone, the whole Pallas path (write + both attention launches) and the reference, and reports
the bytes each must move (every cached key and value read once, q read, output written) over its
time as a fraction of the HBM bandwidth a device copy measures, plus the Pallas-vs-reference error.
Every case runs; a failure is reported in the JSON and makes the exit status non-zero. Off GPU the
command refuses to run (the CPU tests cover the kernels in interpret mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
import traceback
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import quant_bench
from pallas_kernels.attention import paged_attention
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.kv_write import write_kv_pages
from pallas_kernels.metadata import NULL_PAGE, AttentionMetadata
from pallas_kernels.prefill_attention import prefill_attention


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize


LLAMA_3_1_8B = ModelShapes(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, dtype="bfloat16")


@dataclasses.dataclass(frozen=True)
class BenchCase:
    name: str
    rows: tuple[tuple[int, int], ...]  # (tokens cached before the step, tokens in the step) per sequence

    @property
    def kind(self) -> str:
        return "decode" if all(n == 1 for _, n in self.rows) else "prefill"

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.rows)


class Traffic(NamedTuple):
    bytes: int  # minimum HBM traffic
    flops: int


def bench_cases() -> list[BenchCase]:
    decodes = [BenchCase(f"decode_b{batch}_ctx{context}", ((context - 1, 1),) * batch)
               for batch in (1, 64, 256) for context in (1024, 2048, 4096)]
    return decodes + [BenchCase("prefill_2048", ((0, 2048),))]


def step_metadata(case: BenchCase, page_size: int, rng: np.random.Generator) -> tuple[AttentionMetadata, int]:
    """Metadata of the case with no padding, pages in random order; returns it and the pool's page count."""
    pages_per_row = [-(-(ctx + n) // page_size) for ctx, n in case.rows]
    num_pages = sum(pages_per_row) + 1
    order = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    table = np.full((len(case.rows), max(pages_per_row)), NULL_PAGE, np.int32)
    positions, slots, seq_ids, kv_lens, cu = [], [], [], [], [0]
    used = 0
    for i, (ctx, n) in enumerate(case.rows):
        pages = order[used:used + pages_per_row[i]]
        used += pages_per_row[i]
        table[i, :len(pages)] = pages
        pos = np.arange(ctx, ctx + n)
        positions.append(pos)
        slots.append(pages[pos // page_size] * page_size + pos % page_size)
        seq_ids.append(np.full(n, i))
        kv_lens.append(ctx + n)
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(
        positions=np.concatenate(positions).astype(np.int32), slot_mapping=np.concatenate(slots).astype(np.int32),
        seq_ids=np.concatenate(seq_ids).astype(np.int32), page_table=table, kv_lens=np.asarray(kv_lens, np.int32),
        cu_q_lens=np.asarray(cu, np.int32), num_seqs=np.int32(len(case.rows)))
    return meta, num_pages


def write_traffic(case: BenchCase, shapes: ModelShapes) -> Traffic:
    """k and v read from the step, stored into the pool, and the slot of each token."""
    rows = 2 * case.num_tokens * shapes.num_kv_heads * shapes.head_dim * shapes.itemsize
    return Traffic(2 * rows + 4 * case.num_tokens, 0)


def attention_traffic(case: BenchCase, shapes: ModelShapes) -> Traffic:
    """Every key and value of every sequence read once, q read, the output written; causal flops."""
    kv_len = sum(ctx + n for ctx, n in case.rows)
    pairs = sum(n * ctx + n * (n + 1) // 2 for ctx, n in case.rows)  # (query, visible key) pairs
    kv_bytes = 2 * kv_len * shapes.num_kv_heads * shapes.head_dim * shapes.itemsize
    q_out_bytes = 2 * case.num_tokens * shapes.num_q_heads * shapes.head_dim * shapes.itemsize
    return Traffic(kv_bytes + q_out_bytes, 4 * pairs * shapes.num_q_heads * shapes.head_dim)


def require_gpu(backend: str) -> None:
    if backend != "gpu":
        raise SystemExit(f"pallas_kernels.benchmark times the GPU kernels and needs a GPU, but jax's default "
                         f"backend is {backend!r}. On CPU, tests/test_kernels.py checks the kernels in Pallas "
                         "interpret mode.")


def seconds_per_call(fn: Callable, pools, *, iters: int, repeats: int):
    """Best of `repeats` timed loops of `iters` calls, after a compiling call; `fn(pools) -> (out, pools)`."""
    out, pools = fn(pools)
    jax.block_until_ready((out, pools))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            out, pools = fn(pools)
        jax.block_until_ready((out, pools))
        best = min(best, (time.perf_counter() - start) / iters)
    return best, out, pools


def measure_hbm_bandwidth(num_bytes: int = 1 << 31, *, iters: int = 10) -> float:
    """Bytes per second of an in-place elementwise update: read and write of `num_bytes`."""
    add_one = jax.jit(lambda x: x + 1, donate_argnums=0)
    seconds, _, _ = seconds_per_call(lambda x: (None, add_one(x)), jnp.zeros(num_bytes // 4, jnp.float32),
                                     iters=iters, repeats=3)
    return 2 * num_bytes / seconds


def run_case(case: BenchCase, shapes: ModelShapes, *, iters: int, repeats: int, hbm_bytes_per_s: float,
             interpret: bool = False, seed: int = 0) -> list[dict]:
    """Times the KV write, the case's attention kernel, the whole Pallas path and the reference."""
    rng = np.random.default_rng(seed)
    meta_np, num_pages = step_metadata(case, shapes.page_size, rng)
    meta = jax.tree.map(jnp.asarray, meta_np)
    t, hq, hkv, d = case.num_tokens, shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim
    keys = jax.random.split(jax.random.key(seed), 5)
    q, k, v = (jax.random.normal(key, (t, h, d), shapes.dtype) for key, h in zip(keys, (hq, hkv, hkv)))
    pool_shape = (1, num_pages, shapes.page_size, hkv, d)
    pools = tuple(jax.random.normal(key, pool_shape, shapes.dtype) for key in keys[3:])
    layer, scale = jnp.int32(0), d ** -0.5
    pallas_impl = "pallas_interpret" if interpret else "pallas"
    attention_kernel = decode_attention if case.kind == "decode" else prefill_attention

    write = jax.jit(functools.partial(write_kv_pages, interpret=interpret), donate_argnums=(0, 1))
    attend = jax.jit(lambda k_pages, v_pages: attention_kernel(q, k_pages, v_pages, layer, meta, scale=scale,
                                                               interpret=interpret)[0])

    def full_path(impl: str) -> Callable:
        step = jax.jit(lambda k_pages, v_pages: paged_attention(q, k, v, k_pages, v_pages, layer, meta,
                                                                scale=scale, impl=impl), donate_argnums=(0, 1))

        def run(p):
            out, k_pages, v_pages = step(*p)
            return out, (k_pages, v_pages)
        return run

    whole_step = Traffic(*(a + b for a, b in zip(write_traffic(case, shapes), attention_traffic(case, shapes))))
    # Every call stores the same k/v at the same slots, so one pool threads through all of them.
    runs = {
        "write_kv": (lambda p: (None, write(*p, layer, k, v, meta.slot_mapping)), write_traffic(case, shapes)),
        f"{case.kind}_attention": (lambda p: (attend(*p), p), attention_traffic(case, shapes)),
        "pallas": (full_path(pallas_impl), whole_step),
        "reference": (full_path("reference"), whole_step),
    }
    results, outputs = [], {}
    for kernel, (fn, traffic) in runs.items():
        entry = {"case": case.name, "kind": case.kind, "kernel": kernel, "tokens": t, "rows": len(case.rows),
                 "bytes": traffic.bytes, "flops": traffic.flops}
        try:
            seconds, outputs[kernel], pools = seconds_per_call(fn, pools, iters=iters, repeats=repeats)
        except Exception as e:  # reported, never skipped
            entry["error"] = "".join(traceback.format_exception_only(e)).strip()
            results.append(entry)
            continue
        entry.update(seconds=seconds, bytes_per_s=traffic.bytes / seconds,
                     hbm_fraction=traffic.bytes / seconds / hbm_bytes_per_s, flops_per_s=traffic.flops / seconds)
        results.append(entry)
    if "pallas" in outputs and "reference" in outputs:
        got, want = (np.asarray(outputs[name].astype(jnp.float32)) for name in ("pallas", "reference"))
        error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        for entry in results:
            entry["pallas_vs_reference_rel_err"] = error
    return results


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pallas_kernels.benchmark", description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="FILE", help="write the results here instead of stdout")
    parser.add_argument("--iters", type=int, default=20, help="calls per timed loop (best of 5 loops)")
    parser.add_argument("--quant", action="store_true", help="the quantized / MoE matmul rows instead of attention")
    parser.add_argument("--sweep", action="store_true",
                        help="with --quant: time every candidate tiling, print the best")
    parser.add_argument("--cases", metavar="REGEX", help="with --quant: only the cases whose name matches")
    parser.add_argument("--tokamax", action="store_true", help="with --quant: add tokamax's ragged_dot rows")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    require_gpu(jax.default_backend())

    hbm = measure_hbm_bandwidth()
    if args.quant:
        report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "hbm_bytes_per_s": hbm,
                  **quant_report(args.cases, args.sweep, args.tokamax, args.iters, hbm)}
        return write_report(report, args.json)
    shapes = LLAMA_3_1_8B
    results = []
    for case in bench_cases():
        results += run_case(case, shapes, iters=args.iters, repeats=5, hbm_bytes_per_s=hbm)
        for entry in results[-4:]:
            summary = entry.get("error") or (f"{entry['seconds'] * 1e6:9.1f} us  {entry['bytes_per_s'] / 1e9:7.1f} GB/s"
                                             f"  {entry['hbm_fraction']:6.1%} of HBM")
            print(f"{entry['case']:>20} {entry['kernel']:>18} {summary}", file=sys.stderr)
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "model": dataclasses.asdict(shapes), "hbm_bytes_per_s": hbm, "results": results}
    return write_report(report, args.json)


def quant_report(pattern: str | None, sweep: bool, with_tokamax: bool, iters: int, hbm: float,
                 interpret: bool = False) -> dict:
    """{"results": rows} of the selected quantized / MoE cases, plus {"sweep": best per case} with `sweep`."""
    tokamax = quant_bench.import_tokamax() if with_tokamax else None
    cases = quant_bench.select(quant_bench.quant_cases(), pattern)
    results, sweeps = [], []
    for case in cases:
        for entry in quant_bench.run_quant_case(case, iters=iters, repeats=3, hbm_bytes_per_s=hbm,
                                                interpret=interpret, tokamax=tokamax):
            quant_bench.print_row(entry)
            results.append(entry)
        if sweep:
            sweeps.append(quant_bench.sweep_case(case, iters=iters, repeats=2, interpret=interpret))
            print(f"{case.name:>34} best {sweeps[-1]['best']} {sweeps[-1]['seconds']}", file=sys.stderr)
    return {"results": results, **({"sweep": sweeps} if sweep else {})}


def write_report(report: dict, path: str | None) -> int:
    """The JSON report to `path` (else stdout); exit status 1 if any row failed."""
    results = report["results"]
    text = json.dumps(report, indent=2)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    failed = [f"{e['case']}/{e['kernel']}" for e in results if "error" in e]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
