"""`bench device-checks` without a GPU: every check's command line parses with the real parser of its
command (a typo in a flag fails here, not in a lent GPU's minutes), the order, the budget's
skipping, and a check out of time killed with its whole process group."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from infire_jax.bench import device_checks
from infire_jax.bench.device_checks import CHECKS, Check, command, run_checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parse_bench(argv: list[str]):
    from infire_jax.bench.__main__ import build_parser

    return build_parser().parse_args(argv)


@pytest.mark.parametrize("check", CHECKS, ids=[c.name for c in CHECKS])
def test_every_check_command_parses(check, tmp_path):
    argv = command(check, str(tmp_path / "figures.json"), str(tmp_path))[2:]  # after `python -m`
    assert not any("{out}" in a for a in argv)
    module, args = argv[0], argv[1:]
    if module == "pytest":
        assert all(os.path.isfile(os.path.join(ROOT, a)) for a in args if a.endswith(".py"))
        return
    assert check.figures
    if module == "pallas_kernels.benchmark":
        from pallas_kernels.benchmark import build_parser

        assert build_parser().parse_args(args).json == str(tmp_path / "figures.json")
        return
    assert module == "infire_jax.bench"
    parsed = _parse_bench(args)
    assert parsed.json == str(tmp_path / "figures.json")
    if parsed.command == "fleet":  # the fleet file loads, and each worker's serve flags parse
        from infire_jax.cli import build_parser
        from router.fleet_config import load_fleet_config

        fleet = load_fleet_config(os.path.join(ROOT, parsed.fleet))
        for worker in fleet.workers:
            build_parser().parse_args(fleet.worker_command(worker)[3:])
        assert parsed.fleet_log_dir.startswith(str(tmp_path))
    if parsed.command in ("latency", "throughput", "profile", "swap"):
        from infire_jax.engine.args import engine_config

        for model in (parsed.model if isinstance(parsed.model, list) else [parsed.model]):
            engine_config(parsed, model)


def test_checks_come_most_valuable_first():
    """Issue 29's order: the headline decode (the first H200 run spent its minutes on the GPU tests and
    reached no figure), the GPU tests, the GPU's own compile of the programs the CPU machine predicts
    (issue 46), dense bf16 (the Pallas matmul in place and cuBLAS, unrolled layers and the scan), the
    quantized / MoE kernels, memory, the fp8 KV cache, the kernels alone and old baselines; resident
    compression (minutes of coding) last."""
    names = [c.name for c in CHECKS]
    assert len(set(names)) == len(names)
    assert names[:6] == ["decode-b1", "kernel-tests", "gpu-programs", "decode-b1-cublas", "decode-b1-scan",
                         "profile-b1"]
    assert names.index("int4-kernel") < names.index("swap-8b-1b") < names.index("throughput-c256-kv-float8_e4m3")
    assert names.index("throughput-c256-kv-float8_e4m3") < names.index("quant-kernel-rows")
    assert names[-2:] == ["palette-b1-b64", "palette-restored"]
    palette = [c for c in CHECKS if c.name.startswith("palette")]
    assert all(("--weights-compression", "palette:mlp,attn") == c.argv[-2:] for c in palette)


def _quick(name: str, seconds: int, *argv: str) -> Check:
    return Check(name, seconds, argv, figures=False)


def test_checks_run_in_order_and_what_does_not_fit_is_skipped(tmp_path):
    checks = [_quick("ok", 5, "this"), _quick("too-long", 1000, "this"),
              _quick("fails", 5, "json.tool", "/no/such/file"), _quick("ok-again", 5, "this")]
    records = run_checks(checks, str(tmp_path), budget=60)
    assert [(r["name"], r["status"]) for r in records] == [
        ("ok", "passed"), ("too-long", "skipped"), ("fails", "failed"), ("ok-again", "passed")]
    assert records[1]["reason"].endswith("expects 1000") and records[2]["returncode"] == 2
    assert json.loads((tmp_path / "checks.json").read_text()) == records
    log = (tmp_path / "checks.log").read_text()
    assert log.index("==== ok:") < log.index("==== fails:") < log.index("==== ok-again:")
    assert "==== too-long" not in log


def test_a_check_out_of_time_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = (f"import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    start = time.monotonic()
    (record,) = run_checks([_quick("hangs", 1, "timeit", "-n", "1", "-r", "1", script)], str(tmp_path), budget=60)
    assert record["status"] == "timed out" and time.monotonic() - start < 20
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_list_names_every_check(capsys):
    from infire_jax.bench.__main__ import main

    assert main(["device-checks", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(c.name in out for c in CHECKS) and sys.executable not in out
    assert device_checks.fleet("gpu1-replicas")[3] == "router/configs/gpu1-replicas.yaml"
