"""`bench profile`: device time per kernel of one generate, from a jax.profiler perfetto trace.

One untimed generate warms the engine; a second one, traced, runs --batch-size prompts of
--input-len random tokens to exactly --steps new tokens each (greedy, EOS ignored). For every
device stream it prints the span (first kernel start to last kernel end), the busy time (a kernel
running) and busy / span, then the top kernels by total device time. Per-step figures are totals
divided by --steps; the prefill is in the trace too, so keep --steps well above its steps. Kernels
per layer: kernel launches per step divided by the model's layers. On CPU the trace has no device:
the same figures come from the host threads that run XLA's ops, labelled as the host view.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

from infire_jax.bench.common import add_bench_engine_args, positive_int

DESCRIPTION = __doc__.split("\n\n", 1)[1]
DEVICE_PROCESS = re.compile(r"/device:|GPU|TPU")
# Ops on the CPU runtime's threads carry HLO instruction names (fusion.3, dynamic-slice_fusion);
# the runtime's own events around them (ThunkExecutor::Execute, its waits, "end: op") do not.
HLO_NAME = re.compile(r"[\w.-]+")
EPS_US = 1e-3  # the trace's resolution, 1 ns: anything shorter is an instant marker


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=positive_int, default=1, help="requests generated together")
    p.add_argument("--input-len", type=positive_int, default=512, help="prompt tokens per request")
    p.add_argument("--steps", type=positive_int, default=48,
                   help="new tokens forced per request (EOS ignored): the decode steps traced")
    p.add_argument("--top", type=positive_int, default=30, help="kernels listed, by total device time")
    p.add_argument("--trace-dir", default=None,
                   help="where jax.profiler writes the trace (default: a new directory under /tmp)")
    add_bench_engine_args(p, "--batch-size")


def _leaves(events: list[dict]) -> list[dict]:
    """The events of one thread that contain no other, by start: the kernels or ops, not the scopes around them."""
    events = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
    return [e for e, nxt in zip(events, events[1:] + [None]) if nxt is None or not _contains(e, nxt)]


def _contains(outer: dict, inner: dict) -> bool:
    """Whether `inner`, starting no earlier than `outer`, lies within it (a partial overlap does not)."""
    end = outer["ts"] + outer["dur"]
    return inner["ts"] < end - EPS_US and inner["ts"] + inner["dur"] <= end + EPS_US


def _covered(ops: list[dict]) -> float:
    """Time at least one op runs: kernels on one stream may overlap (programmatic dependent launch)."""
    covered, end = 0.0, float("-inf")
    for e in ops:
        covered += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))
        end = max(end, e["ts"] + e["dur"])
    return covered


def select_threads(events: list[dict]) -> tuple[str, dict[tuple[str, str], list[dict]]]:
    """("device", each device stream's events) when the trace has a device, else ("host", XLA's CPU threads' ops).

    Of a device's threads only its "Stream #N" ones are kept where it has any: other lines (XLA Ops,
    XLA Modules, Steps) re-list the streams' time. The host view falls back to every host thread
    when none is XLA's.
    """
    meta = [e for e in events if e.get("ph") == "M"]
    process = {e["pid"]: e["args"]["name"] for e in meta if e.get("name") == "process_name"}
    thread = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e.get("name") == "thread_name"}
    device, xla, host = defaultdict(list), defaultdict(list), defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or e.get("dur", 0) < EPS_US:
            continue
        pname = process.get(e["pid"], str(e["pid"]))
        tname = thread.get((e["pid"], e["tid"]), str(e["tid"]))
        key = (pname, tname)
        if DEVICE_PROCESS.search(pname):
            device[key].append(e)
        else:
            host[key].append(e)
            if "XLA" in tname and HLO_NAME.fullmatch(e["name"]):
                xla[key].append(e)
    if device:
        streams = {k: v for k, v in device.items() if k[1].startswith("Stream")}
        return "device", streams or dict(device)
    return "host", dict(xla) or dict(host)


def summarize_trace(events: list[dict], *, steps: int, num_layers: int, top: int) -> dict:
    """Per-stream busy time and the top kernels of a perfetto trace's event list (times in ms, means in µs)."""
    view, threads = select_threads(events)
    kernels: dict[str, list] = defaultdict(lambda: [0.0, 0])
    streams = []
    for (pname, tname), thread_events in sorted(threads.items()):
        ops = _leaves(thread_events)
        lo, hi = min(e["ts"] for e in ops), max(e["ts"] + e["dur"] for e in ops)
        busy = _covered(ops)
        streams.append(dict(stream=f"{pname} {tname}", span_ms=(hi - lo) / 1e3, busy_ms=busy / 1e3,
                            busy_fraction=busy / (hi - lo), launches=len(ops)))
        for e in ops:
            kernels[e["name"]][0] += e["dur"]
            kernels[e["name"]][1] += 1
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    launches = sum(s["launches"] for s in streams)
    return dict(view=view, streams=streams, num_layers=num_layers, steps=steps,
                kernels=[dict(name=k, total_ms=us / 1e3, calls=n, mean_us=us / n, per_step_ms=us / 1e3 / steps)
                         for k, (us, n) in ranked],
                busy_ms_per_step=sum(s["busy_ms"] for s in streams) / steps, launches_per_step=launches / steps,
                kernels_per_layer=launches / steps / num_layers)


def _text_column(rows: list[dict], key: str, header: str):
    """A left-aligned text column (header too) for report.table, which right-aligns; at most 90 wide."""
    width = min(90, max([len(header)] + [len(r[key]) for r in rows]))
    return key, header.ljust(width), f"{{:<{width}.{width}}}"


def render(wall_ms: float, path: str, summary: dict) -> str:
    from infire_jax.bench import report

    s, streams, kernels = summary, summary["streams"], summary["kernels"]
    label = ("device view: kernels on each device stream" if s["view"] == "device" else
             "host view: the trace has no device, so these are ops on XLA's CPU threads, not device kernels")
    return "\n".join([
        label, f"wall time of the traced generate: {wall_ms:.1f} ms", f"trace: {path}", "",
        report.table(streams, [_text_column(streams, "stream", "stream"), ("span_ms", "span ms", "{:.2f}"),
                               ("busy_ms", "busy ms", "{:.2f}"), ("busy_fraction", "busy/span", "{:.1%}"),
                               ("launches", "launches", "{}")]), "",
        report.table(kernels, [("total_ms", "total ms", "{:.3f}"), ("calls", "calls", "{}"),
                               ("mean_us", "mean µs", "{:.1f}"), ("per_step_ms", "ms/step", "{:.4f}"),
                               _text_column(kernels, "name", "kernel")]), "",
        f"per step (÷ {s['steps']}): {s['busy_ms_per_step']:.3f} ms busy, {s['launches_per_step']:.1f} launches, "
        f"{s['kernels_per_layer']:.1f} per layer ({s['num_layers']} layers)"])


def _generate(engine, args: argparse.Namespace, it: int):
    from infire_jax.bench import driver
    from infire_jax.bench.datasets import random_prompts

    prompts = random_prompts(args.batch_size, args.input_len, args.steps, engine.model_config.vocab_size,
                             seed=(args.seed, it))
    return driver.run(engine, [p.prompt for p in prompts], [args.steps] * args.batch_size,
                      concurrency=args.batch_size, tenant=f"bench-profile-{it}")


def run(args: argparse.Namespace):
    import glob
    import gzip
    import json
    import os
    import tempfile

    import jax

    from infire_jax.bench import report
    from infire_jax.bench.common import device_info, engine_info, settings, start_engine
    from infire_jax.bench.metrics import summarize

    args.trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="infire-profile-")
    engine, peaks = start_engine(args, args.batch_size)
    try:
        _generate(engine, args, 0)
        jax.profiler.start_trace(args.trace_dir, create_perfetto_trace=True)
        try:
            traced = _generate(engine, args, 1)
        finally:
            jax.profiler.stop_trace()
    finally:
        engine.close()
    # jax writes <dir>/plugins/profile/<time>/perfetto_trace.json.gz; earlier runs may share the dir.
    path = max(glob.glob(os.path.join(args.trace_dir, "plugins", "profile", "*", "perfetto_trace.json.gz")),
               key=os.path.getmtime)
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    summary = summarize_trace(events, steps=args.steps, num_layers=engine.model_config.num_layers, top=args.top)
    stats = summarize([r.timing() for r in traced.requests], traced.duration, [])
    timing = {k: stats[k] for k in ("output_throughput", "mean_ttft_ms", "mean_tpot_ms")}
    point = dict(label=f"bs={args.batch_size} (traced)", throughput=timing["output_throughput"],
                 ttft_ms=timing["mean_ttft_ms"], tpot_ms=timing["mean_tpot_ms"])
    payload = dict(benchmark="profile", settings=settings(args), device=device_info(), peaks=peaks.to_dict(),
                   engine=engine_info(engine), trace=path, wall_ms=traced.duration * 1e3, **timing, **summary)
    return report.Result(payload, render(payload["wall_ms"], path, summary), [point],
                         f"profile: {engine.model_name}, batch {args.batch_size}, {args.input_len}-token prompts, "
                         f"{args.steps} steps")
