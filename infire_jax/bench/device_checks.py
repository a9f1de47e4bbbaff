"""`bench device-checks`: the GPU checks of docs/PERFORMANCE.md as one time-boxed run, most valuable first.

A GPU is lent for a few minutes at a time, so the checks run one after another, each in its own
process with its own time limit, until `--budget` seconds are spent; a check that would not fit in
what is left is not started. Each check's output goes to one log and its figures to one JSON, both
rewritten after every check, so whatever finished is there even if the run is cut off. Later runs
pick up where one stopped with `--only`. The XLA compilation cache is shared by the checks, so a
check that compiles programs an earlier one compiled starts warm. Each check runs in a process
group of its own, killed whole when the check ends or runs out of time (a fleet's workers too).
`{out}` in a check's command is the --out folder (the fleet checks keep their workers' logs there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

DESCRIPTION = __doc__.split("\n\n", 1)[1]
LLAMA = ["--model", "dummy:llama-3.1-8b", "--dtype", "bfloat16"]
MOE = ["--model", "dummy:qwen3-30b-a3b", "--dtype", "bfloat16", "--input-len", "512", "--output-len", "128",
       "--batch-size", "1", "64"]
LONG = ["--input-len", "2048", "--output-len", "128"]
# The pool sized as the engine sizes it on the card (117.5 GB on an H200), as the latency checks run.
GPU_PROGRAMS = ("--model", "dummy:llama-3.1-8b", "--dtype", "bfloat16", "--token-buckets", "64", "8192",
                "--max-num-seqs", "64", "--programs", "forward", "burst-greedy", "sampler-greedy")
# Hot standby: the 8B and the 1B model, one on the device, each request swapping (GPU.md: this ran
# out of memory and hung).
SWAP = ("infire_jax.bench", "swap", "--model", "dummy:llama-3.1-8b", "--model", "dummy:llama-3.2-1b",
        "--dtype", "bfloat16", "--max-resident", "1", "--swaps", "4")
PALETTE = ("--weights-compression", "palette:mlp,attn")
# Llama 4 Scout's shapes with 8 of its 48 layers (2 global, 6 chunked; about 40 GB of bf16 weights):
# decode at 4k and 32k context, where the chunked layers' KV bytes stay flat (issue 33 section 5).
SCOUT = ("--model", "dummy:llama-4-scout,layers=8", "--dtype", "bfloat16", "--output-len", "128")


def fleet(config: str) -> tuple[str, ...]:
    """A one-GPU fleet file with a short interference workload (GPU.md's, 40 s instead of 70-80)."""
    return ("infire_jax.bench", "fleet", "--fleet", f"router/configs/{config}.yaml", "--fleet-log-dir",
            f"{{out}}/{config}", "--workload", "interference", "--streams", "16", "--decode-len", "256",
            "--long-len", "2048", "--long-rate", "2", "--duration", "40")


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    seconds: int  # expected wall time on an H100, compiling from a cold cache; the limit is twice this
    argv: tuple[str, ...]  # after `python -m`
    env: tuple[tuple[str, str], ...] = ()
    figures: bool = True  # a bench command that writes --json


CHECKS = (
    # Issue 29, most valuable first. The 2026-11-29 H200 run (jax 0.11.2) imported, compiled and ran
    # the kernel tests, but spent its minutes on them (over 360 s, 4 workers) and never reached a figure:
    # the headline decode comes first now (the first two of its 14 warm-up programs compiled in 55 and 15 s).
    Check("decode-b1", 300, ("infire_jax.bench", "latency", *LLAMA, *LONG, "--batch-size", "1")),
    # The GPU tests, eight workers sharing the card (compiling is CPU work; the machine has 16 cores),
    # each result on its own line as it comes, so a run cut short still names its failures.
    Check("kernel-tests", 300, ("pytest", "tests/test_kernels.py", "tests/test_quant_matmul.py",
                                "tests/test_palette_kernels.py", "tests/test_step_program.py", "tests/test_layers.py",
                                "tests/test_kv_fp8_kernels.py", "tests/test_local_attention.py",
                                "tests/test_lora_kernels.py", "tests/test_fused_epilogues.py", "-v", "--tb=short",
                                "--timeout=300", "--durations=15", "-n", "8", "-p", "no:cacheprovider"),
          env=(("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),), figures=False),
    # Issue 46: what the GPU's own compiler (jax 0.11) makes of the decode and forward programs, to
    # hold against `bench gpu-compile --target h200` compiled on a CPU machine for the same commit.
    Check("gpu-programs", 120, ("infire_jax.bench", "gpu-compile", "--here", *GPU_PROGRAMS)),
    Check("decode-b1-cublas", 120, ("infire_jax.bench", "latency", *LLAMA, *LONG, "--batch-size", "1", "64"),
          env=(("INFIRE_JAX_DENSE_MATMUL", "xla"),)),
    # Decode-sized steps run their layers unrolled (12 launches a layer of the 8B burst, compiled on a
    # CPU machine), against the scan (17); the first H100 run found an unrolled scan slower with cuBLAS.
    Check("decode-b1-scan", 120, ("infire_jax.bench", "latency", *LLAMA, *LONG, "--batch-size", "1", "64"),
          env=(("INFIRE_JAX_LAYER_LOOP", "scan"),)),
    Check("profile-b1", 150, ("infire_jax.bench", "profile", *LLAMA, "--batch-size", "1", "--input-len", "2048",
                              "--steps", "32")),
    # A prompt chunk's plain weights go to cuBLAS, and jax 0.10.2's compiler copies each layer's slice out of
    # the stacks first (14 GB a step of the 8B; about 8 ms beside a 2048-token chunk's ~43 ms of matmuls,
    # against issue 29's 45 ms TTFT). XLA's dynamic-slice fusion lets cuBLAS read the slice in place; on 0.10.2
    # compiling with it fails ("BufferAllocation::Slice not assigned"): this asks 0.11 (TTFT, tokens as usual).
    Check("prefill-2k-slice-fusion", 120, ("infire_jax.bench", "latency", *LLAMA, *LONG, "--batch-size", "1"),
          env=(("XLA_FLAGS", "--xla_gpu_enable_dynamic_slice_fusion=true"),)),
    # Issue 46, item 8: the 8B's step programs compiled on this machine without its GPU (a process under
    # JAX_PLATFORMS=cpu, `infire-jax precompile`), then a boot that should load all of them (`loaded`),
    # compile none of them, and be ready with its compile time gone; and a warm boot beside it.
    # (The serving buckets of gpu-programs: 74 programs of the default ones took 11 min on 2 CPU cores.)
    Check("boot-precompiled", 240, ("infire_jax.bench", "boot", *LLAMA, "--max-num-seqs", "64", "--token-buckets",
                                    "64", "8192", "--precompile", "auto", "--num-kv-pages", "4096", "--runs", "1")),
    # This wave's new paths: Llama 4's chunked attention on the hybrid KV cache, and batched LoRA
    # (8 random rank-16 adapters, one a row, against the base model in the same run).
    Check("llama4-scout-4k", 240, ("infire_jax.bench", "latency", *SCOUT, "--input-len", "4096", "--max-model-len",
                                   "4224", "--batch-size", "1", "32")),
    Check("llama4-scout-32k", 300, ("infire_jax.bench", "latency", *SCOUT, "--input-len", "32768", "--max-model-len",
                                    "32896", "--batch-size", "1", "32", "--import-context")),
    # Issue 48: Scout with its vision tower (the published 34 layers, random weights) and one 1024 x 1024
    # image a request (a 4 x 4 grid and its thumbnail: 17 tiles, 2,467 tokens), TTFT including encoding.
    Check("llama4-scout-image", 240, ("infire_jax.bench", "latency", *SCOUT, "--input-len", "512",
                                      "--max-model-len", "3200", "--images-per-request", "1", "--image-size",
                                      "1024", "--batch-size", "1", "4")),
    Check("lora-b1-b8", 240, ("infire_jax.bench", "latency", *LLAMA, "--input-len", "512", "--output-len", "128",
                              "--batch-size", "1", "8", "--lora", "8", "--lora-rank", "16")),
    # Section 2: the quantized and MoE kernels as the engine runs them.
    Check("int8-kernel", 150, ("infire_jax.bench", "latency", *LLAMA, *LONG, "--batch-size", "1", "64",
                               "--weights-quantization", "int8")),
    Check("int4-kernel", 150, ("infire_jax.bench", "latency", *LLAMA, *LONG, "--batch-size", "1", "64",
                               "--weights-quantization", "int4")),
    # fp8 e4m3 weights with a scale per output channel (vLLM's --quantization fp8; the kept form of FP8 and
    # W8A8 checkpoints): the same kernel as int8, H100's fp8-to-bf16 conversion on chip; never run on a GPU.
    Check("fp8-kernel", 150, ("infire_jax.bench", "latency", *LLAMA, *LONG, "--batch-size", "1", "64",
                              "--weights-quantization", "fp8")),
    Check("moe-grouped-kernel", 240, ("infire_jax.bench", "latency", *MOE)),
    # Qwen3-30B-A3B with fp8 experts (the kept form of its FP8 release, drawn at load: 31 GB where bf16 takes 61):
    # the grouped kernel reading e4m3 experts in place; never run on a GPU.
    Check("moe-fp8-experts", 240, ("infire_jax.bench", "latency", *MOE, "--weights-quantization", "fp8")),
    # Issue 49: gpt-oss-120b whole on one GPU, its experts kept in MXFP4 (61 GB; drawn at random), with
    # attention sinks in the Pallas kernels and 128-token windows on the hybrid KV cache.
    Check("gpt-oss-120b-mxfp4", 300, ("infire_jax.bench", "latency", "--model", "dummy:gpt-oss-120b", "--dtype",
                                      "bfloat16", "--weights-quantization", "checkpoint", "--input-len", "2048",
                                      "--output-len", "128", "--batch-size", "1", "64")),
    # Gemma 3 27b (the published shapes, random weights): five 1024-token windows to one global layer on
    # the hybrid KV cache, each kind its own RoPE; never run on a GPU yet.
    Check("gemma3-27b", 240, ("infire_jax.bench", "latency", "--model", "dummy:gemma-3-27b", "--dtype", "bfloat16",
                              "--input-len", "4096", "--output-len", "128", "--max-model-len", "4352",
                              "--batch-size", "1", "32")),
    # Gemma 4 31B and 26B-A4B (the published shapes as third-party sources quote them, random weights): five
    # windowed layers to one full layer with 512-wide heads viewing the pool as 8 x 512, blocks of six layers;
    # 26B-A4B's experts beside a dense MLP through the grouped kernel; never run on a GPU yet.
    *(Check(f"gemma4-{size}", 240, ("infire_jax.bench", "latency", "--model", f"dummy:gemma-4-{size}", "--dtype",
                                    "bfloat16", "--input-len", "4096", "--output-len", "128", "--max-model-len",
                                    "4352", "--batch-size", "1", "32"))
      for size in ("31b", "26b-a4b")),
    # Gemma 4 31B with its layer weights in fp8 at load (32 GB where bf16 takes 62): both kinds' projections
    # read in place by the quantized matmul in decode; never run on a GPU.
    Check("gemma4-31b-fp8", 240, ("infire_jax.bench", "latency", "--model", "dummy:gemma-4-31b", "--dtype",
                                  "bfloat16", "--weights-quantization", "fp8", "--input-len", "4096",
                                  "--output-len", "128", "--max-model-len", "4352", "--batch-size", "1", "32")),
    # GLM-4.5-Air whole on one H200 in fp8 at load (108 GB): routed and shared experts through the grouped
    # and dense quantized kernels; never run on a GPU.
    Check("glm45-air-fp8", 300, ("infire_jax.bench", "latency", "--model", "dummy:glm-4.5-air", "--dtype", "bfloat16",
                                 "--weights-quantization", "fp8", "--input-len", "2048", "--output-len", "128",
                                 "--batch-size", "1", "32")),
    # MiniMax-M2 as published (fp8, 128 x 128 blocks kept: 3.6 GB a layer), 24 of its 62 layers on one H200
    # (88 GB): every projection and expert read in place with its block scales; never run on a GPU.
    Check("minimax-m2-fp8-24-layers", 300, ("infire_jax.bench", "latency", "--model", "dummy:minimax-m2,layers=24",
                                            "--dtype", "bfloat16", "--weights-quantization", "checkpoint",
                                            "--input-len", "2048", "--output-len", "128", "--batch-size", "1", "32")),
    # GLM-4.5-Air's shapes, 12 of its 46 layers in bfloat16 (53 GB; the whole model's 214 GB needs a mesh):
    # half-rotated GQA heads and DeepSeek-V3's MoE through the grouped kernel; never run on a GPU yet.
    Check("glm45-air-12-layers", 240, ("infire_jax.bench", "latency", "--model", "dummy:glm-4.5-air,layers=12",
                                       "--dtype", "bfloat16", "--input-len", "2048", "--output-len", "128",
                                       "--batch-size", "1", "32")),
    # Qwen3.5 27b and 35b-a3b (the published shapes, random weights): Gated DeltaNet layers whose state lives in
    # the request slots, the chunked delta rule for the prompt, the MoE's experts through the grouped kernel;
    # never run on a GPU yet.
    Check("qwen3.5-27b", 240, ("infire_jax.bench", "latency", "--model", "dummy:qwen3.5-27b", "--dtype", "bfloat16",
                               "--input-len", "4096", "--output-len", "128", "--max-model-len", "4352",
                               "--batch-size", "1", "32")),
    Check("qwen3.5-35b-a3b", 240, ("infire_jax.bench", "latency", "--model", "dummy:qwen3.5-35b-a3b", "--dtype",
                                   "bfloat16", "--input-len", "4096", "--output-len", "128", "--max-model-len",
                                   "4352", "--batch-size", "1", "32")),
    # The 27b with n-gram proposals on random weights (proposed often, accepted rarely): what verifying k + 1
    # tokens a row and committing the linear state of the kept ones cost, beside qwen3.5-27b's plain decode.
    Check("qwen3.5-27b-ngram", 240, ("infire_jax.bench", "latency", "--model", "dummy:qwen3.5-27b", "--dtype",
                                     "bfloat16", "--input-len", "4096", "--output-len", "128", "--max-model-len",
                                     "4352", "--batch-size", "1", "32", "--speculative-config",
                                     '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}')),
    Check("kimi-layer-int4", 240, ("infire_jax.bench", "latency", "--model", "dummy:kimi-k2.5,layers=2", "--dtype",
                                   "bfloat16", "--weights-quantization", "int4", "--input-len", "512",
                                   "--output-len", "128", "--batch-size", "1", "64")),
    Check("throughput-c64", 240, ("infire_jax.bench", "throughput", *LLAMA, "--input-len", "1000", "--output-len",
                                  "1000", "--num-prompts", "128", "--max-concurrency", "64",
                                  "--num-warmup-prompts", "16")),
    # Embeddings (the pooling runner): 256 inputs of 512 tokens on the 8B's shapes, with the compare's
    # b1 / b64 decode and a 2048-token prefill beside them; never run on a GPU yet.
    Check("embeddings-8b", 240, ("infire_jax.bench", "compare", "--skip-peer", *LLAMA, "--batch-sizes", "1", "64",
                                 "--new-tokens", "64", "--prefill-len", "2048", "--max-model-len", "4096",
                                 "--embed-inputs", "256", "--embed-len", "512")),
    # Section 4: memory on a shared or multi-model GPU (GPU.md: the swap ran out of memory and hung;
    # the fleet files did not start).
    Check("swap-8b-1b", 180, SWAP),
    Check("fleet-gpu1-replicas", 240, fleet("gpu1-replicas")),
    Check("fleet-gpu1-disaggregated", 240, fleet("gpu1-disaggregated")),
    # Issue 30: the fp8 KV cache at 1000/1000 and concurrency 256, against bfloat16 (>= 1.1x tok/s, 0 preemptions).
    *(Check(f"throughput-c256-kv-{kv}", 420, ("infire_jax.bench", "throughput", *LLAMA, "--input-len", "1000",
                                              "--output-len", "1000", "--num-prompts", "512", "--max-concurrency",
                                              "256", "--max-num-seqs", "256", "--num-warmup-prompts", "16",
                                              "--kv-cache-dtype", kv))
      for kv in ("bfloat16", "float8_e4m3")),
    # The kernels alone, the block-size sweep, and the baselines measured before (GPU.md).
    Check("quant-kernel-rows", 240, ("pallas_kernels.benchmark", "--quant")),
    Check("quant-sweep-b1", 300, ("pallas_kernels.benchmark", "--quant", "--sweep", "--cases",
                                  "^(int8|int4)_(gate_up|down)_m1$|kimi_k2_5_ct_int4_gate_up_b1")),
    Check("int8-layer-body", 150, ("infire_jax.bench", "latency", *LLAMA, *LONG, "--batch-size", "1", "64",
                                   "--weights-quantization", "int8"), env=(("INFIRE_JAX_QUANT_MATMUL", "xla"),)),
    Check("moe-tiled", 240, ("infire_jax.bench", "latency", *MOE), env=(("INFIRE_JAX_MOE_GROUPED", "tiled"),)),
    Check("decode-b1-one-step", 120, ("infire_jax.bench", "latency", *LLAMA, *LONG, "--batch-size", "1",
                                      "--num-decode-steps", "1")),
    # Section 3, resident compression: its first start codes the model and checkpoints it coded
    # (minutes; a call of its own), later ones restore it.
    Check("palette-b1-b64", 480, ("infire_jax.bench", "latency", *LLAMA, *LONG, "--batch-size", "1", "64", *PALETTE)),
    Check("palette-restored", 120, ("infire_jax.bench", "latency", *LLAMA, "--input-len", "128", "--output-len",
                                    "32", "--batch-size", "1", *PALETTE)),
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="device-checks", help="folder for checks.log and checks.json (created)")
    p.add_argument("--budget", type=float, default=540, help="seconds for all checks together")
    p.add_argument("--only", nargs="+", choices=[c.name for c in CHECKS], help="these checks, in this order")
    p.add_argument("--list", action="store_true", help="print the checks and exit")


def command(check: Check, json_path: str, out: str) -> list[str]:
    """The check's command line: `{out}` replaced by the --out folder, --json added to a bench command."""
    argv = [sys.executable, "-m", *(a.replace("{out}", out) for a in check.argv)]
    return argv + ["--json", json_path] if check.figures else argv


def _run_group(argv: list[str], env: dict[str, str], log, timeout: float) -> int | None:
    """Runs `argv` in a process group of its own; its exit status, or None if it ran out of time.
    Whatever of the group is left then (a fleet's workers, a hung child) is killed."""
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


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
            code = _run_group(command(check, scratch, out), dict(os.environ, **dict(check.env)), log,
                              min(2 * check.seconds, left))
            if code is None:
                record.update(status="timed out")
            else:
                record.update(status="passed" if code == 0 else "failed", returncode=code)
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
