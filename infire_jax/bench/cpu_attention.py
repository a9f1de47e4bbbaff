"""CPU paged attention rates: the C++ FFI call (`pallas_kernels.cpu_attention`) on prefill and decode steps.

    python -m infire_jax.bench.cpu_attention [--model smollm2-135m llama-3.1-8b] [--prefill 512 2048]

One layer of a model's attention heads over a pool of 16-token pages, random keys and values:
- a prefill of N tokens from position 0 (one row; the step's keys are written, then attended causally);
- decode steps of --decode-rows rows (8), each at --context positions.
ms is the best of 3 loops of --iters calls (the jitted call, the step's key/value write into the
donated pools included); GFLOP/s counts 4 D flops per query head and visible key (the two products),
so a causal prefill is about half a dense one. The pool dtype is --dtype (bfloat16 is stored as its
uint16 bits, as the engine keeps it on CPU).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from infire_jax.bench.cpu_gemm import MODELS
from infire_jax.bench.cpu_matmul import best_seconds
from pallas_kernels import cpu_attention, cpu_kernels, reference
from pallas_kernels.metadata import AttentionMetadata

PAGE_SIZE = 16


def step_metadata(rows: list[tuple[int, int]]) -> tuple[AttentionMetadata, int]:
    """A step of `rows` (cached context, new tokens), each row on pages of its own after the null page,
    and the number of pages the pool needs."""
    widths = [-(-(ctx + n) // PAGE_SIZE) for ctx, n in rows]
    table = np.zeros((len(rows), max(widths)), np.int32)
    positions, slots, seq_ids = [], [], []
    first = 1
    for i, ((ctx, n), width) in enumerate(zip(rows, widths)):
        table[i, :width] = np.arange(first, first + width)
        pos = np.arange(ctx, ctx + n)
        positions.append(pos)
        slots.append(table[i, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE)
        seq_ids.append(np.full(n, i))
        first += width
    cu = np.concatenate([[0], np.cumsum([n for _, n in rows])])
    meta = AttentionMetadata(*(jnp.asarray(np.concatenate(x), jnp.int32) for x in (positions, slots, seq_ids)),
                             jnp.asarray(table), jnp.asarray([ctx + n for ctx, n in rows], jnp.int32),
                             jnp.asarray(cu, jnp.int32), jnp.int32(len(rows)))
    return meta, first


def seconds(model: str, rows: list[tuple[int, int]], dtype: str, iters: int) -> tuple[float, float]:
    """(seconds a call, FLOPs a call) of one layer's attention over `rows`."""
    _, _, hq, hkv, d = MODELS[model]
    meta, pages = step_metadata(rows)
    rng = np.random.default_rng(0)
    t = int(meta.positions.shape[0])
    q, k, v = (jnp.asarray(rng.standard_normal((t, h, d), np.float32)).astype(dtype) for h in (hq, hkv, hkv))
    storage = reference.pool_storage_dtype(jnp.dtype(dtype), "reference")
    k_pages, v_pages = (reference.to_storage(jnp.asarray(rng.standard_normal((1, pages, PAGE_SIZE, hkv, d),
                                                                              np.float32)).astype(dtype), storage)
                        for _ in range(2))
    # the pools donated and carried from call to call, as the engine's layer scan does (else each call
    # would copy them before its write)
    call = jax.jit(lambda kp, vp: cpu_attention.paged_attention(q, k, v, kp, vp, jnp.int32(0), meta, scale=d ** -0.5),
                   donate_argnums=(0, 1))
    pools = [k_pages, v_pages]

    def step():
        out, pools[0], pools[1] = call(*pools)
        return out

    visible = sum(sum(range(ctx + 1, ctx + n + 1)) for ctx, n in rows)
    return best_seconds(step, iters=iters), 4.0 * hq * d * visible


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m infire_jax.bench.cpu_attention", description=__doc__.split("\n")[0])
    p.add_argument("--model", nargs="+", default=["smollm2-135m"], choices=sorted(MODELS))
    p.add_argument("--prefill", type=int, nargs="+", default=[512, 2048], help="prompt lengths (tokens)")
    p.add_argument("--context", type=int, default=576, help="positions of each decode row")
    p.add_argument("--decode-rows", type=int, nargs="+", default=[8], help="rows of the decode steps")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)
    if jax.default_backend() != "cpu" or not cpu_kernels.available():
        p.error("needs the CPU backend and a C++ compiler (see pallas_kernels/cpu_kernels.py)")
    print(f"{'model':>13} {'step':>18} {'ms':>8} {'GFLOP/s':>8}   ({args.dtype} pool)")
    for model in args.model:
        cases = [(f"prefill {n}", [(0, n)]) for n in args.prefill]
        cases += [(f"decode {b} x {args.context}", [(args.context - 1, 1)] * b) for b in args.decode_rows]
        for name, rows in cases:
            s, flops = seconds(model, rows, args.dtype, args.iters)
            print(f"{model:>13} {name:>18} {1e3 * s:8.3f} {flops / s / 1e9:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
