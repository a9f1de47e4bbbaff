"""`bench profile`: the perfetto-trace parser on hand-built traces, and one end-to-end run on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from infire_jax.bench.profile import summarize_trace


def _meta(pid: int, process: str, threads: dict[int, str]) -> list[dict]:
    out = [dict(ph="M", pid=pid, name="process_name", args=dict(name=process))]
    return out + [dict(ph="M", pid=pid, tid=tid, name="thread_name", args=dict(name=name))
                  for tid, name in threads.items()]


def _x(pid: int, tid: int, name: str, ts: float, dur: float) -> dict:
    return dict(ph="X", pid=pid, tid=tid, name=name, ts=ts, dur=dur)


def test_device_streams_and_kernels():
    events = [
        *_meta(1, "/device:GPU:0", {10: "Stream #13(Compute)", 11: "Stream #14(MemcpyH2D)", 12: "XLA Ops",
                                            13: "Stream #15(Compute)"}),
        *_meta(2, "/host:CPU", {20: "python"}),
        # Compute stream: two gemm and two attention kernels over 0..110 us, busy 80 us.
        _x(1, 10, "gemm", 0, 30), _x(1, 10, "attn", 40, 10), _x(1, 10, "gemm", 60, 30), _x(1, 10, "attn", 100, 10),
        # Copy stream: two copies over 5..30 us, busy 10 us.
        _x(1, 11, "memcpy", 5, 5), _x(1, 11, "memcpy", 25, 5),
        # Two kernels that overlap (dependent launch) over 0..10 us: busy 10 us, not 12.
        _x(1, 13, "norm", 0, 6), _x(1, 13, "norm", 4, 6),
        # A derived line re-listing the compute stream's time, and host events: neither is a kernel.
        _x(1, 12, "fusion.1", 0, 110), _x(2, 20, "PjitFunction(step)", 0, 200),
        {},  # the trailing empty event jax writes
    ]
    s = summarize_trace(events, steps=2, num_layers=2, top=2)
    assert s["view"] == "device"
    compute, copy, overlapped = s["streams"]
    assert compute["stream"] == "/device:GPU:0 Stream #13(Compute)" and copy["stream"].endswith("(MemcpyH2D)")
    assert compute["span_ms"] == pytest.approx(0.110) and compute["busy_ms"] == pytest.approx(0.080)
    assert compute["busy_fraction"] == pytest.approx(80 / 110) and compute["launches"] == 4
    assert copy["span_ms"] == pytest.approx(0.025) and copy["busy_ms"] == pytest.approx(0.010)
    assert copy["busy_fraction"] == pytest.approx(0.4) and copy["launches"] == 2
    assert overlapped["busy_ms"] == pytest.approx(0.010) and overlapped["busy_fraction"] == pytest.approx(1.0)
    assert overlapped["launches"] == 2
    assert s["kernels"] == [  # top 2 of gemm 60 us, attn 20 us, norm 12 us, memcpy 10 us
        dict(name="gemm", total_ms=pytest.approx(0.060), calls=2, mean_us=pytest.approx(30),
             per_step_ms=pytest.approx(0.030)),
        dict(name="attn", total_ms=pytest.approx(0.020), calls=2, mean_us=pytest.approx(10),
             per_step_ms=pytest.approx(0.010)),
    ]
    assert s["busy_ms_per_step"] == pytest.approx(0.050)  # (80 + 10 + 10) us / 2 steps
    assert s["launches_per_step"] == 4 and s["kernels_per_layer"] == 2  # 8 launches / 2 steps / 2 layers


def test_host_view_counts_only_xla_ops():
    events = [
        *_meta(7, "/host:CPU", {1: "python", 2: "tf_XLAEigen/123", 3: "tf_XLAPjRtCpuClient/456"}),
        _x(7, 1, "DevicePut", 0, 50),  # the Python thread's runtime work is not an XLA op
        # The layer loop's while wraps two fusions; the executor's scope and an instant marker are not ops.
        _x(7, 2, "ThunkExecutor::Execute", 0, 100), _x(7, 2, "while.5", 10, 80),
        _x(7, 2, "fusion.1", 10, 30), _x(7, 2, "ThreadpoolListener::Record", 15, 1e-6), _x(7, 2, "fusion.2", 50, 40),
        # The client thread waits for the Eigen thread, then runs one small op.
        _x(7, 3, "ThunkExecutor::Execute (wait for completion)", 0, 100), _x(7, 3, "end: fusion.2", 95, 0.5),
        _x(7, 3, "wrapped_iota", 100, 4),
    ]
    s = summarize_trace(events, steps=1, num_layers=1, top=10)
    assert s["view"] == "host"
    assert [(t["stream"], t["busy_ms"], t["launches"]) for t in s["streams"]] == [
        ("/host:CPU tf_XLAEigen/123", pytest.approx(0.070), 2),
        ("/host:CPU tf_XLAPjRtCpuClient/456", pytest.approx(0.004), 1)]
    assert s["streams"][0]["busy_fraction"] == pytest.approx(70 / 80)
    assert [(k["name"], k["calls"]) for k in s["kernels"]] == [("fusion.2", 1), ("fusion.1", 1), ("wrapped_iota", 1)]


def test_profile_cpu_end_to_end(tmp_path):
    out_json = tmp_path / "profile.json"
    trace_dir = tmp_path / "trace"
    # Two token buckets, the prefill's (2 x 16) and the decodes' (2 rows), not the default six: the
    # engine compiles each (forward, sampler, decode burst) before it profiles anything.
    proc = subprocess.run(
        [sys.executable, "-m", "infire_jax.bench", "profile", "--model", "dummy:smollm2-135m", "--batch-size", "2",
         "--input-len", "16", "--steps", "4", "--top", "5", "--trace-dir", str(trace_dir), "--max-model-len", "64",
         "--num-kv-pages", "16", "--max-num-batched-tokens", "32", "--token-buckets", "2", "32",
         "--json", str(out_json)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    data = json.loads(out_json.read_text())
    assert data["benchmark"] == "profile" and data["view"] == "host" and data["num_layers"] == 30
    assert data["trace"].startswith(str(trace_dir)) and os.path.getsize(data["trace"]) > 0
    assert data["wall_ms"] > 0 and data["output_throughput"] > 0
    assert any("XLA" in s["stream"] for s in data["streams"])
    assert all(0 < s["busy_ms"] <= s["span_ms"] for s in data["streams"])
    assert 1 <= len(data["kernels"]) <= 5 and all(k["calls"] > 0 and k["total_ms"] > 0 for k in data["kernels"])
    assert data["kernels_per_layer"] == pytest.approx(data["launches_per_step"] / 30)
    assert "host view" in proc.stdout and data["kernels"][0]["name"] in proc.stdout and data["trace"] in proc.stdout
