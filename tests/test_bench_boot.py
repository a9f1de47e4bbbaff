"""`bench boot` and `bench swap`, run for real on small shapes: their figures hang together.

`bench boot` boots fresh processes with their caches in a new directory: the first converts the
model, writes its checkpoint and compiles; the later ones restore it and load every step from
the executable cache. `bench swap` alternates requests between two models with one resident.
"""

from __future__ import annotations

import json
import subprocess
import sys

SMALL = ["--max-model-len", "64", "--num-kv-pages", "16", "--max-num-batched-tokens", "32", "--max-num-seqs", "4",
         "--token-buckets", "4", "32"]


def _bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "infire_jax.bench", *args, *SMALL, "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_bench_boot_first_cold_warm(tmp_path):
    result = _bench(tmp_path, "boot", "--runs", "1")
    rows = {r["mode"]: r for r in result["results"]}
    first, cold, warm = rows["first"], rows["cold"], rows["warm"]
    assert result["checkpoint_bytes"] > 400e6  # SmolLM2-135M in float32
    assert result["fromfile_seconds"]["cold"] > 0 and result["fromfile_seconds"]["warm"] > 0
    assert first["built"] == 1 and first["compiled"] > 0
    for row in (cold, warm):
        # every step deserialized from the executable cache, nothing traced or compiled
        assert row["built"] == 0 and row["compiled"] == 0 and row["executables_loaded"] > 0
        # the steps compile while the weights are read
        assert row["import_s"] + max(row["load_s"], row["compile_s"]) <= row["ready_s"] <= row["first_token_s"]
        assert row["ready_over_floor_s"] == row["ready_s"] - result["drive_seconds"]
    assert warm["ready_s"] < first["ready_s"]


def test_bench_boot_of_a_dummy_model_has_no_floor(tmp_path):
    """The GPU boot figure is taken on `dummy:llama-3.1-8b`, whose weights are drawn, not read."""
    result = _bench(tmp_path, "boot", "--runs", "1", "--model", "dummy:smollm2-135m,layers=2")
    rows = {r["mode"]: r for r in result["results"]}
    assert set(rows) == {"first", "warm"} and result["weight_bytes"] > 130e6  # 2 layers and the 113 MB embedding
    assert rows["first"]["compiled"] > 0 and rows["warm"]["compiled"] == 0 and rows["warm"]["floor_s"] is None


def test_bench_swap_counts_against_the_floor(tmp_path):
    dummy = "dummy:smollm2-135m,layers=2"
    result = _bench(tmp_path, "swap", "--model", dummy, "--model", dummy, "--swaps", "4", "--max-resident", "1")
    bandwidth = result["host_to_device_bytes_per_second"]
    assert bandwidth > 0 and len(result["results"]) == 2
    for row in result["results"]:
        assert row["swaps"] == 2 and len(row["rounds_s"]) == 2
        assert row["floor_s"] == row["gb"] * 1e9 / bandwidth
        assert 0 < row["swap_s"] <= row["first_token_s"]
