"""`bench gpu-compile`: the engine's GPU programs compiled on a CPU machine, and what each does a step.

Every program the engine would serve with on one GPU of the target (each bucket's forward, samplers
and decode bursts; with speculation the verifying ones; the small ones) is compiled for it from the
weights' and the pool's shapes (bench/gpu_target.py), with the engine's GPU settings and XLA flags.
A row per program: launches a step and a layer of the layer loop (from XLA's launch list), copies
of weight size and their bytes a step, float32 tensors shaped like a weight, the custom calls, and
memory against the card (arguments + outputs - donated + temporaries), and whether every program fits
the share of the card XLA's allocator hands out (the JSON's `fits`). This is compiled structure,
not timing: jax 0.10.2's compiler, without autotuning. Needs the CUDA plugin (the `dev` extra).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

from infire_jax.bench.common import BenchError
from infire_jax.engine.args import add_engine_args, engine_config

DESCRIPTION = __doc__.split("\n\n", 1)[1]

COLUMNS = [
    ("program", "program", "{}"), ("launches_per_step", "launches a step", "{:.0f}"),
    ("launches_per_layer", "a layer", "{}"), ("weight_copies_per_step", "weight copies a step", "{:.0f}"),
    ("weight_copy_gb_per_step", "GB copied a step", "{:.2f}"),
    ("slice_copies_per_step", "weight slices copied a step", "{:.0f}"), ("float32_weights", "f32 weights", "{}"),
    ("calls", "custom calls a step", "{}"), ("peak_gb", "peak GB", "{:.1f}"), ("of_card", "of card", "{:.2f}"),
    ("compile_s", "compile s", "{:.1f}"),
]
_SHORT = {"__cublas$lt$matmul": "cublasLt", "__cublas$gemm": "cublas", "__gpu$xla.gpu.triton": "triton"}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="h100", choices=["h100", "h200"], help="the GPU to compile for")
    p.add_argument("--devices", type=int, default=None,
                   help="GPUs of one host (default: --mesh's devices, else 1); the mesh is --mesh or the shipped "
                        "file for this many")
    p.add_argument("--here", action="store_true",
                   help="on a GPU machine: compile for its own GPUs (--target ignored), to compare with the "
                        "prediction a CPU machine compiles for the same commit")
    p.add_argument("--programs", nargs="*", default=[],
                   help="only programs whose names start so (e.g. burst forward sampler)")
    p.add_argument("--dump-dir", default=None, help="keep XLA's dumps here (default: a temporary directory)")
    add_engine_args(p)


def pool_bytes(memory_bytes: int, utilization: float, weight_bytes: int, reserve: int = 2 << 30) -> int:
    """The KV pool the engine would size on the card: its share of the card (within what the allocator
    hands out), less the weights and a reserve for the largest step's temporaries (checked against
    each program's own afterwards)."""
    return min(int(memory_bytes * utilization), usable_bytes(memory_bytes)) - weight_bytes - reserve


def usable_bytes(memory_bytes: int) -> int:
    """What of the card XLA's allocator may hand out as the engine runs it: its fraction
    (XLA_PYTHON_CLIENT_MEM_FRACTION, which the engine raises to 0.95 unless set; runner/xla_flags.py)."""
    from infire_jax.runner import xla_flags

    return int(memory_bytes * float(os.environ.get(xla_flags.ALLOCATOR_FRACTION_VAR,
                                                   xla_flags.DEFAULT_ALLOCATOR_FRACTION)))


def run(args: argparse.Namespace):
    import dataclasses

    import jax

    from infire_jax.bench import gpu_target, program_stats, report
    from infire_jax.bench.common import settings

    if not args.here:
        gpu_target.use_cpu_backend()
    target = gpu_target.here() if args.here else gpu_target.target(args.target)
    ec = engine_config(args)
    args.devices = gpu_target.device_count(args.devices, ec.mesh)
    if not (ec.num_kv_pages or ec.kv_cache_memory):  # size the pool as the engine would on the cards
        # shapes only (nothing is allocated): a pool large enough for one sequence of any length
        probe = gpu_target.TargetEngine(dataclasses.replace(ec, kv_cache_memory=64 << 30), target, args.devices,
                                        args.here)
        weight_bytes = probe.weights_per_device()[2]
        ec.kv_cache_memory = pool_bytes(target.memory_bytes, ec.gpu_memory_utilization, weight_bytes)
        if ec.kv_cache_memory <= 0:
            raise BenchError(f"{weight_bytes / 1e9:.1f} GB of weights a device leave no room for a KV pool on "
                             f"{args.devices} x {target.device_kind}")
    engine = gpu_target.TargetEngine(ec, target, args.devices, args.here)
    shapes, layers, weight_bytes = engine.weights_per_device()
    dump_root = args.dump_dir or tempfile.mkdtemp(prefix="infire-gpu-compile.")
    os.makedirs(dump_root, exist_ok=True)
    rows = []
    try:
        for p in engine.programs(dump_root, tuple(args.programs)):
            st = program_stats.read_dump(p.dump_dir, shapes, layers)
            m = p.compiled.memory_analysis()  # one device's share of the program
            peak = gpu_target.peak_bytes(p.compiled)
            rows.append(dict(
                program=p.name, steps=p.steps, launches_per_step=st.launches / p.steps,
                launches_per_layer=st.launches_per_layer, loops_in_layer=st.loops_in_layer,
                weight_copies_per_step=st.weight_copies / p.steps,
                weight_copy_gb_per_step=st.weight_copy_bytes / p.steps / 1e9, weight_copy_ops=st.weight_copy_ops,
                slice_copies_per_step=st.slice_copies / p.steps, slice_copy_ops=st.slice_copy_ops,
                float32_weights=len(st.float32_weights), float32_weight_buffers=st.float32_weights,
                f32_weight_bytes=st.float32_weight_bytes // p.steps,
                calls=", ".join(f"{_SHORT.get(k, k)} {v / p.steps:.0f}" for k, v in sorted(st.custom_calls.items())),
                custom_calls=st.custom_calls, argument_bytes=m.argument_size_in_bytes,
                output_bytes=m.output_size_in_bytes, alias_bytes=m.alias_size_in_bytes,
                temp_bytes=m.temp_size_in_bytes, peak_gb=peak / 1e9, of_card=peak / target.memory_bytes,
                compile_s=p.seconds))
    finally:
        if args.dump_dir is None:
            shutil.rmtree(dump_root, ignore_errors=True)
    if not rows:
        raise BenchError(f"no program of this engine starts with {args.programs}")
    plan = engine.settings.plan
    usable = usable_bytes(target.memory_bytes)
    programs = [dict(name=r["program"], steps=r["steps"], launches_per_step=r["launches_per_step"],
                     launches_per_layer=r["launches_per_layer"],
                     weight_copy_bytes=round(r["weight_copy_gb_per_step"] * 1e9),
                     f32_weight_bytes=r["f32_weight_bytes"], peak_bytes=round(r["peak_gb"] * 1e9),
                     device_memory_bytes=target.memory_bytes, compile_seconds=r["compile_s"]) for r in rows]
    payload = dict(benchmark="gpu-compile", settings=settings(args), target=target.name,
                   programs=programs, usable_bytes=usable, fits=all(p["peak_bytes"] <= usable for p in programs),
                   device_kind=target.device_kind, devices=args.devices, on_the_gpu=args.here,
                   mesh=plan.mesh_config.name if plan else None,
                   card_bytes=target.memory_bytes, jax=jax.__version__, weight_bytes_per_device=weight_bytes,
                   kv_cache_bytes_per_device=engine.kv_pool_bytes_per_device(),
                   num_kv_pages=engine.settings.runner_config.num_pages, results=rows)
    title = (f"gpu-compile: {ec.model or 'default model'} on {args.devices} x {target.device_kind}"
             f"{f' ({plan.mesh_config.name})' if plan else ''}, jax {jax.__version__}, per device: weights "
             f"{weight_bytes / 1e9:.1f} GB, KV pool {engine.kv_pool_bytes_per_device() / 1e9:.1f} GB; "
             f"{'every program fits' if payload['fits'] else 'NOT every program fits'} the allocator's "
             f"{usable / 1e9:.1f} GB of the card (compiled structure, not timing)")
    return report.Result(payload, report.table(rows, COLUMNS), [], title)
