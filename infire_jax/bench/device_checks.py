"""`bench device-checks`: the GPU checks of docs/PERFORMANCE.md as one time-boxed run, most valuable first.

A GPU is lent for a few minutes at a time, so the checks run one after another, each in its own
process with its own time limit, until `--budget` seconds are spent; a check that would not fit in
what is left is not started. Each check's output goes to one log and its figures to one JSON, both
rewritten after every check, so whatever finished is there even if the run is cut off. Later runs
pick up where one stopped with `--only`. The XLA compilation cache is shared by the checks, so a
check that compiles programs an earlier one compiled starts warm.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

DESCRIPTION = __doc__.split("\n\n", 1)[1]
LLAMA = ["--model", "dummy:llama-3.1-8b", "--dtype", "bfloat16"]
MOE = ["--model", "dummy:qwen3-30b-a3b", "--dtype", "bfloat16", "--input-len", "512", "--output-len", "128",
       "--batch-size", "1", "64"]
LONG = ["--input-len", "2048", "--output-len", "128"]


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    seconds: int  # expected wall time on an H100, compiling from a cold cache; the limit is twice this
    argv: tuple[str, ...]  # after `python -m`
    env: tuple[tuple[str, str], ...] = ()
    figures: bool = True  # a bench command that writes --json


CHECKS = (
    Check("kernel-tests", 150, ("pytest", "tests/test_kernels.py", "tests/test_quant_matmul.py",
                                "tests/test_palette_kernels.py", "tests/test_step_program.py", "-q"), figures=False),
    Check("decode-b1", 120, ("infire_jax.bench", "latency", *LLAMA, *LONG, "--batch-size", "1")),
    Check("int8-kernel", 150, ("infire_jax.bench", "latency", *LLAMA, *LONG, "--batch-size", "1", "64",
                               "--weights-quantization", "int8")),
    Check("int8-layer-body", 150, ("infire_jax.bench", "latency", *LLAMA, *LONG, "--batch-size", "1", "64",
                                   "--weights-quantization", "int8"), env=(("INFIRE_JAX_QUANT_MATMUL", "xla"),)),
    Check("moe-grouped-kernel", 240, ("infire_jax.bench", "latency", *MOE)),
    Check("moe-tiled", 240, ("infire_jax.bench", "latency", *MOE), env=(("INFIRE_JAX_MOE_GROUPED", "tiled"),)),
    Check("decode-b1-one-step", 120, ("infire_jax.bench", "latency", *LLAMA, *LONG, "--batch-size", "1",
                                      "--num-decode-steps", "1")),
    Check("profile-b1", 150, ("infire_jax.bench", "profile", *LLAMA, "--batch-size", "1", "--input-len", "2048",
                              "--steps", "32")),
    Check("throughput-c64", 240, ("infire_jax.bench", "throughput", *LLAMA, "--input-len", "1000", "--output-len",
                                  "1000", "--num-prompts", "128", "--max-concurrency", "64",
                                  "--num-warmup-prompts", "16")),
    # Issue 30: the fp8 KV cache at 1000/1000 and concurrency 256, against bfloat16 (>= 1.1x tok/s, 0 preemptions).
    *(Check(f"throughput-c256-kv-{kv}", 420, ("infire_jax.bench", "throughput", *LLAMA, "--input-len", "1000",
                                              "--output-len", "1000", "--num-prompts", "512", "--max-concurrency",
                                              "256", "--max-num-seqs", "256", "--num-warmup-prompts", "16",
                                              "--kv-cache-dtype", kv))
      for kv in ("bfloat16", "float8_e4m3")),
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="device-checks", help="folder for checks.log and checks.json (created)")
    p.add_argument("--budget", type=float, default=540, help="seconds for all checks together")
    p.add_argument("--only", nargs="+", choices=[c.name for c in CHECKS], help="these checks, in this order")
    p.add_argument("--list", action="store_true", help="print the checks and exit")


def _command(check: Check, json_path: str) -> list[str]:
    argv = [sys.executable, "-m", *check.argv]
    return argv + ["--json", json_path] if check.figures else argv


def run_checks(checks: list[Check], out: str, budget: float, clock=time.monotonic) -> list[dict]:
    """Runs `checks` in order within `budget` seconds; returns one record per check (run or skipped)."""
    os.makedirs(out, exist_ok=True)
    log_path, json_path, scratch = (os.path.join(out, n) for n in ("checks.log", "checks.json", "check-figures.json"))
    start, records = clock(), []
    with open(log_path, "w") as log:
        for check in checks:
            left = budget - (clock() - start)
            record = dict(name=check.name, command=" ".join(check.argv), env=dict(check.env))
            if check.seconds > left:
                records.append(dict(record, status="skipped", reason=f"{left:.0f} s left, expects {check.seconds}"))
                continue
            log.write(f"==== {check.name}: {record['command']} {record['env'] or ''}\n")
            log.flush()
            began = clock()
            try:
                proc = subprocess.run(_command(check, scratch), env=dict(os.environ, **dict(check.env)), stdout=log,
                                      stderr=subprocess.STDOUT, timeout=min(2 * check.seconds, left))
                record.update(status="passed" if proc.returncode == 0 else "failed", returncode=proc.returncode)
            except subprocess.TimeoutExpired:
                record.update(status="timed out")
            record["seconds"] = round(clock() - began, 1)
            if check.figures and os.path.exists(scratch):
                with open(scratch) as f:
                    record["figures"] = json.load(f)
                os.remove(scratch)
            records.append(record)
            with open(json_path, "w") as f:
                json.dump(records, f, indent=1)
    with open(json_path, "w") as f:
        json.dump(records, f, indent=1)
    return records


COLUMNS = [("name", "check", "{}"), ("status", "status", "{}"), ("seconds", "seconds", "{:.1f}"),
           ("reason", "note", "{}")]


def run(args: argparse.Namespace):
    from infire_jax.bench import report

    chosen = [next(c for c in CHECKS if c.name == n) for n in args.only] if args.only else list(CHECKS)
    if args.list:
        rows = [dict(name=c.name, seconds=c.seconds, command=f"python -m {' '.join(c.argv)}", env=dict(c.env))
                for c in chosen]
        columns = [("name", "check", "{}"), ("seconds", "expected s", "{}"), ("command", "command", "{}"),
                   ("env", "environment", "{}")]
        return report.Result(dict(benchmark="device-checks", checks=rows), report.table(rows, columns), [],
                             "device checks, most valuable first")
    records = run_checks(chosen, args.out, args.budget)
    return report.Result(dict(benchmark="device-checks", budget=args.budget, checks=records),
                         report.table(records, COLUMNS), [], f"device checks in {args.budget:.0f} s "
                         f"(logs in {args.out}/checks.log, figures in {args.out}/checks.json)")
