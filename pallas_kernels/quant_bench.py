"""GPU rows of the weight-only quantized and MoE matmul kernels, and a sweep over their block sizes.

    python -m pallas_kernels.benchmark --quant [--sweep] [--cases REGEX] [--tokamax]

Dense: Llama-3.1-8B's four layer shapes (qkv, o, gate_up, down) in int8 per channel, int4 in the
AWQ / GPTQ form (group 128, float16 scales, uint8 zeros), GGUF Q4_1 and fp8 with 128-input blocks,
at 1, 16 and 64 rows, each against `jnp.dot` on a bfloat16 weight of the same shape. MoE: one layer's
grouped matmuls (gate_up, down) of Qwen3-30B-A3B (128 experts, top-8, bfloat16 and int8) and of
Kimi K2.5 (384 experts, top-8, compressed-tensors int4 in groups of 32) and of gpt-oss-120b (128
experts, top-4, MXFP4: two e2m1 codes a byte, a uint8 e8m0 scale per 32) at batch 1 and 64, against
`jax.lax.ragged_dot` on bfloat16 experts (and tokamax's `ragged_dot` where tokamax is installed).
Each row reports the bytes the weights must move (touched experts only) over its time, as a
fraction of the copy bandwidth. Every timed call reads a different layer (or routing) than the last,
so the weights come from HBM, not from the 50 MB L2; the calls run in one jitted loop, so host
dispatch is not timed. `--sweep` times every candidate tiling (quant_blocks.candidates) of each
case and prints the best, for quant_blocks.choose's table.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
import time
import traceback
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import quant_blocks
from pallas_kernels.quant_matmul import QuantStack, grouped_matmul, quant_matmul

LLAMA_8B_LAYER = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
DENSE_FORMATS = ("int8", "int4", "q4_1", "fp8")
ROWS = (1, 16, 64)
# name: (experts, top-k, hidden, moe_intermediate, format)
MOE_LAYERS = {"qwen3_30b_a3b": (128, 8, 2048, 768, ("bf16", "int8")), "kimi_k2_5": (384, 8, 7168, 2048, ("ct_int4",)),
              "gpt_oss_120b": (128, 4, 2880, 2880, ("mxfp4",))}
MOE_BATCHES = (1, 64)
WEIGHT_BYTES = 256 << 20  # layers per stack: enough that a timed loop never finds its weights in L2


@dataclasses.dataclass(frozen=True)
class QuantCase:
    """One timed matmul: `kind` dense or grouped, [k, n] per matrix, `rows` tokens (dense) or a batch
    of tokens routed top-`top_k` over `experts` (grouped)."""

    name: str
    kind: str
    fmt: str
    k: int
    n: int
    rows: int
    experts: int = 0
    top_k: int = 0


def quant_cases() -> list[QuantCase]:
    out = [QuantCase(f"{fmt}_{layer}_m{m}", "dense", fmt, k, n, m)
           for fmt in DENSE_FORMATS for layer, (k, n) in LLAMA_8B_LAYER.items() for m in ROWS]
    for model, (experts, top_k, hidden, inter, fmts) in MOE_LAYERS.items():
        for fmt in fmts:
            for layer, (k, n) in (("gate_up", (hidden, 2 * inter)), ("down", (inter, hidden))):
                out += [QuantCase(f"{model}_{fmt}_{layer}_b{b}", "grouped", fmt, k, n, b, experts, top_k)
                        for b in MOE_BATCHES]
    return out


def random_stack(fmt: str, s: int, k: int, n: int, key) -> QuantStack:
    """S random [k, n] matrices in format `fmt`, drawn on the device (values and parts only need the
    right bytes; the CPU tests check the arithmetic)."""
    kv, ks = jax.random.split(key)
    bits = lambda shape, dtype: lax.bitcast_convert_type(
        jax.random.bits(kv, shape, {1: jnp.uint8, 4: jnp.uint32}[jnp.dtype(dtype).itemsize]), dtype)
    scale = lambda g, dtype: (jax.random.uniform(ks, (s, k // g, n), jnp.float32) * 0.01).astype(dtype)
    if fmt == "int8":
        return QuantStack(bits((s, k, n), jnp.int8), scale(k, jnp.float32))
    if fmt == "int4":
        return QuantStack(bits((s, k // 8, n), jnp.int32), scale(128, jnp.float16),
                          jnp.full((s, k // 128, n), 8, jnp.uint8), packing="int4")
    if fmt == "ct_int4":
        return QuantStack(bits((s, k // 8, n), jnp.int32), scale(32, jnp.bfloat16), packing="int4", zero_point=8)
    if fmt == "q4_1":
        return QuantStack(bits((s, k // 2, n), jnp.uint8), scale(32, jnp.float16), minimum=scale(32, jnp.float16),
                          packing="q4_1")
    if fmt == "fp8":
        return QuantStack(jax.random.normal(kv, (s, k, n), jnp.bfloat16).astype(jnp.float8_e4m3fn),
                          scale(128, jnp.float32))
    if fmt == "mxfp4":  # scales 2^-9 .. 2^0, as a checkpoint's: no infinities
        return QuantStack(bits((s, k // 2, n), jnp.uint8),
                          jax.random.randint(ks, (s, k // 32, n), 118, 128).astype(jnp.uint8), packing="mxfp4")
    if fmt == "bf16":  # drawn in bfloat16: a float32 draw of Kimi's experts would need 45 GB
        return QuantStack(jax.random.normal(kv, (s, k, n), jnp.bfloat16))
    raise ValueError(fmt)


def stack_bytes(stack: QuantStack) -> int:
    """Bytes of one matrix of the stack, all its parts."""
    parts = [p for p in (stack.values, stack.scale, stack.zero, stack.minimum) if p is not None]
    return sum(p.size * p.dtype.itemsize for p in parts) // stack.values.shape[0]


def packing(case: QuantCase) -> str | None:
    return {"int4": "int4", "ct_int4": "int4", "q4_1": "q4_1", "mxfp4": "mxfp4"}.get(case.fmt)


def group(case: QuantCase) -> int:
    """Inputs per scale of the case's format (random_stack's), 0 for plain bf16."""
    return {"int8": case.k, "int4": 128, "ct_int4": 32, "q4_1": 32, "fp8": 128, "mxfp4": 32}.get(case.fmt, 0)


def tile_rows(case: QuantCase) -> int:
    """The rows quant_blocks.choose is keyed on: the step's (dense) or the mean group's (grouped)."""
    rows = case.rows if case.kind == "dense" else max(1, case.rows * case.top_k // case.experts)
    return min(rows, quant_blocks.MAX_TILE_ROWS)


def routings(case: QuantCase, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` group-size vectors [experts] of `rows` tokens each routed to top_k distinct experts."""
    out = np.zeros((count, case.experts), np.int32)
    for c in range(count):
        for _ in range(case.rows):
            out[c, rng.choice(case.experts, case.top_k, replace=False)] += 1
    return out


def time_loop(step: Callable, operands, trips: int, *, iters: int, repeats: int) -> float:
    """Seconds per call of `step(operands, i)` (i = 0, 1, ... mod trips) in one jitted loop of `iters`;
    each output is summed whole, so XLA cannot shrink a reference dot to the part that is read."""

    @jax.jit
    def loop(ops):
        return lax.fori_loop(0, iters, lambda i, acc: acc + jnp.sum(step(ops, i % trips)), jnp.float32(0))

    jax.block_until_ready(loop(operands))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(loop(operands))
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def kernel_step(case: QuantCase, blocks: quant_blocks.Blocks | None, interpret: bool) -> Callable:
    """The kernel call of a timed loop: `step(operands, i)` with call i's layer (dense) or routing."""
    if case.kind == "dense":
        return lambda ops, i: quant_matmul(ops[0], ops[1], i, blocks=blocks, interpret=interpret)
    return lambda ops, i: grouped_matmul(ops[0], ops[1][i], ops[2], 0, blocks=blocks, interpret=interpret)


def case_runs(case: QuantCase, *, interpret: bool, with_references: bool = True,
              tokamax=None) -> dict[str, tuple[Callable, object, int, int]]:
    """name -> (step, operands or a function making them, trips, bytes a call moves) for the case's
    kernel and references."""
    key = jax.random.key(0)
    dtype = jnp.float32 if interpret else jnp.bfloat16
    if case.kind == "dense":
        probe = random_stack(case.fmt, 1, case.k, case.n, key)
        s = 2 if interpret else max(2, min(64, -(-WEIGHT_BYTES // stack_bytes(probe))))
        stack = random_stack(case.fmt, s, case.k, case.n, key)
        x = jax.random.normal(key, (case.rows, case.k), dtype)
        io = x.size * x.dtype.itemsize + case.rows * case.n * 4
        runs = {"kernel": (kernel_step(case, None, interpret), (x, stack), s, stack_bytes(probe) + io)}
        if with_references:
            w = random_stack("bf16", s, case.k, case.n, key).values
            runs["bf16_dot"] = (lambda ops, i: jnp.dot(ops[0], ops[1][i], preferred_element_type=jnp.float32),
                                (x, w), s, case.k * case.n * 2 + io)
        return runs
    trips = 8
    sizes = jnp.asarray(routings(case, trips, np.random.default_rng(0)))
    touched = int(np.mean(np.count_nonzero(np.asarray(sizes), axis=1)))
    stack = random_stack(case.fmt, case.experts, case.k, case.n, key)
    x = jax.random.normal(key, (case.rows * case.top_k, case.k), dtype)
    io = x.size * x.dtype.itemsize + x.shape[0] * case.n * 4
    runs = {"kernel": (kernel_step(case, None, interpret), (x, sizes, stack), trips,
                       touched * stack_bytes(stack) + io)}
    if with_references:
        w = random_stack("bf16", case.experts, case.k, case.n, key).values
        bf16_bytes = touched * case.k * case.n * 2 + io
        runs["bf16_ragged_dot"] = (lambda ops, i: lax.ragged_dot(ops[0], ops[2], ops[1][i],
                                                                 preferred_element_type=jnp.float32),
                                   (x, sizes, w), trips, bf16_bytes)
        if tokamax is not None:
            runs.update(tokamax_runs(tokamax, x, sizes, w, trips, touched, io))
    return runs


TOKAMAX_SCALE_TILE = 256  # inputs a scale: the K tile its Hopper quantized kernel takes (1, 256, 1)


def tokamax_runs(tokamax, x, sizes, w, trips: int, touched: int, io: int) -> dict:
    """tokamax's `ragged_dot` (its Hopper Mosaic GPU kernels) on the bfloat16 experts and on them
    quantized by qwix to int8 and int4 (per output channel and 256 inputs); operands made when run."""
    import qwix

    def step(ops, i):
        return tokamax.ragged_dot(ops[0], ops[2], ops[1][i], implementation="mosaic")

    k, n = w.shape[1:]
    scales = k // TOKAMAX_SCALE_TILE * n * w.dtype.itemsize
    runs = {"tokamax_bf16": (step, (x, sizes, w), trips, touched * k * n * 2 + io)}
    for bits, qtype in ((8, jnp.int8), (4, jnp.int4)):
        quantize = functools.partial(qwix.quantize, w, qtype, channelwise_axes=(0, 2),
                                     tiled_axes={1: TOKAMAX_SCALE_TILE})
        runs[f"tokamax_int{bits}"] = (step, lambda q=quantize: (x, sizes, q()), trips,
                                      touched * (k * n * bits // 8 + scales) + io)
    return runs


def run_quant_case(case: QuantCase, *, iters: int, repeats: int, hbm_bytes_per_s: float, interpret: bool = False,
                   tokamax=None) -> list[dict]:
    """One row per run of the case (the kernel at its chosen tiling, then the references)."""
    results = []
    for kernel, (step, ops, trips, nbytes) in case_runs(case, interpret=interpret, tokamax=tokamax).items():
        entry = {"case": case.name, "kind": case.kind, "kernel": kernel, "bytes": nbytes}
        if kernel == "kernel":
            entry["blocks"] = quant_blocks.choose(tile_rows(case), case.k, case.n, packing(case),
                                                  group=group(case)).label()
        try:
            seconds = time_loop(step, ops() if callable(ops) else ops, trips, iters=iters, repeats=repeats)
        except Exception as e:  # reported, never skipped
            entry["error"] = "".join(traceback.format_exception_only(e)).strip()
            results.append(entry)
            continue
        entry.update(seconds=seconds, bytes_per_s=nbytes / seconds, hbm_fraction=nbytes / seconds / hbm_bytes_per_s)
        results.append(entry)
    return results


def sweep_case(case: QuantCase, *, iters: int, repeats: int, interpret: bool = False,
               limit: int | None = None) -> dict:
    """Every candidate tiling of the case timed; {"case", "best", "seconds", "tried": [(label, s | error)]}."""
    tried = []
    _, ops, trips, _ = case_runs(case, interpret=interpret, with_references=False)["kernel"]
    for blocks in quant_blocks.candidates(tile_rows(case), case.k, case.n, packing(case))[:limit]:
        try:
            tried.append((blocks.label(), time_loop(kernel_step(case, blocks, interpret), ops, trips, iters=iters,
                                                    repeats=repeats)))
        except Exception as e:
            tried.append((blocks.label(), "".join(traceback.format_exception_only(e)).strip()))
    timed = [(label, s) for label, s in tried if isinstance(s, float)]
    best = min(timed, key=lambda t: t[1]) if timed else (None, None)
    return {"case": case.name, "best": best[0], "seconds": best[1], "tried": tried}


def select(cases: list[QuantCase], pattern: str | None) -> list[QuantCase]:
    return [c for c in cases if pattern is None or re.search(pattern, c.name)]


def print_row(entry: dict) -> None:
    summary = entry.get("error") or (f"{entry['seconds'] * 1e6:9.1f} us  {entry['bytes_per_s'] / 1e9:7.1f} GB/s"
                                     f"  {entry['hbm_fraction']:6.1%} of HBM  {entry.get('blocks', '')}")
    print(f"{entry['case']:>34} {entry['kernel']:>16} {summary}", file=sys.stderr)


def import_tokamax():
    """tokamax if installed (an optional comparison; the engine never imports it), else None with a note."""
    try:
        import tokamax
    except ImportError as e:
        print(f"tokamax rows skipped: {e} (PERFORMANCE.md says how to carry the wheel)", file=sys.stderr)
        return None
    return tokamax
