"""`infire-jax precompile`: the engine's step programs compiled before its first start and written to
the executable cache, so that the start loads them instead of compiling (runner/executable_cache.py).

With `--target h100|h200` it runs on a machine without a GPU (the CUDA plugin's compiler, as `bench
gpu-compile` uses it: bench/gpu_target.py) and fills the cache for the GPU machine; copy the cache
directory (`INFIRE_JAX_CACHE`, its `executables/`) there. Without a target it fills it for this
machine (a CPU image built ahead of serving). Only the weights' and the pool's shapes are needed:
nothing is read or allocated.

An entry is found only by an engine that keys it the same (executable_cache.Platform): the same
infire_jax source, jax, jaxlib and CUDA plugin versions, card (`device_kind`), XLA_FLAGS and
INFIRE_JAX_* settings, engine settings and KV pool. Anything else is a miss, compiled at the start
as without this command; never a wrong program (a loaded one is checked against its arguments).
The pool must be the one the GPU engine will have: without --num-kv-pages or --kv-cache-memory this
command sizes it as the engine would fill the card and prints the --num-kv-pages to serve with.
Compiled without the card, XLA cannot autotune: the GEMMs take its default algorithms.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import time

from infire_jax.engine.args import add_engine_args, engine_config
from infire_jax.errors import ConfigError


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, choices=["h100", "h200"],
                   help="the GPU to compile for, on a machine without one (default: this machine's own devices)")
    p.add_argument("--devices", type=int, default=None, help="GPUs of one host (--target; default: --mesh's "
                                                             "devices, else 1); the mesh is --mesh or the shipped "
                                                             "file for this many")
    add_engine_args(p)


def precompile(ec, target_name: str | None, count: int = 1, log=print) -> dict:
    """Compiles every step program of `ec` for `target_name` (or this machine) into the executable
    cache; returns what was stored and the pool it was compiled for."""
    from infire_jax.bench import gpu_compile, gpu_target

    target = None
    if target_name is not None:
        gpu_target.use_cpu_backend()
        target = gpu_target.target(target_name)
    sized = None
    if target is not None and not (ec.num_kv_pages or ec.kv_cache_memory):  # fill the card, as the engine would
        probe = gpu_target.TargetEngine(dataclasses.replace(ec, kv_cache_memory=64 << 30), target, count)
        weight_bytes = probe.weights_per_device()[2]
        pool = gpu_compile.pool_bytes(target.memory_bytes, ec.gpu_memory_utilization, weight_bytes)
        if pool <= 0:
            raise ConfigError(f"{weight_bytes / 1e9:.1f} GB of weights a device leave no room for a KV pool on "
                              f"{count} x {target.device_kind}")
        sized = gpu_target.TargetEngine(dataclasses.replace(ec, kv_cache_memory=pool), target, count)
        ec = dataclasses.replace(ec, kv_cache_memory=None, num_kv_pages=sized.settings.runner_config.num_pages)
    engine = gpu_target.TargetEngine(ec, target, count)
    cache = engine.steps.executables
    if cache is None:
        raise ConfigError("the executable cache is off (INFIRE_JAX_NO_EXECUTABLE_CACHE or INFIRE_JAX_NO_COMPILE_CACHE)")
    stored, skipped, total_bytes, start = [], [], 0, time.perf_counter()
    # XLA compiles with the GIL released: a few threads overlap them, as the engine's warmup does.
    with engine.building(), \
            concurrent.futures.ThreadPoolExecutor(min(4, os.cpu_count() or 1), "infire-precompile") as pool:
        for program in pool.map(lambda item: engine.compile(*item), engine.specs().items()):
            size = cache.put(program.cache_name, program.args, program.compiled)
            (stored if size else skipped).append(program.name)
            total_bytes += size
            log(f"  {program.name}: {program.seconds:.1f} s, {size / 1e6:.1f} MB" if size else
                f"  {program.name}: {program.seconds:.1f} s, not serializable (compiled at the start)")
    if total_bytes > cache.max_bytes:
        raise ConfigError(f"the programs take {total_bytes / 2**30:.2f} GiB, more than the cache keeps "
                          f"({cache.max_bytes / 2**30:.2f} GiB): raise INFIRE_JAX_EXECUTABLE_CACHE_GB here and "
                          "on the serving machine")
    rc = engine.settings.runner_config
    return dict(target=target.device_kind if target else "this machine", devices=count,
                directory=cache.directory, programs=len(stored), not_stored=skipped, bytes=total_bytes,
                seconds=time.perf_counter() - start, num_kv_pages=rc.num_pages, pool_sized_here=sized is not None)


def _boot_precompile() -> None:
    """`bench boot --precompile`'s step, in a fresh process: its flags and target from the
    environment, the result as one JSON line."""
    import json

    args = argparse.Namespace(**json.loads(os.environ["INFIRE_BOOT_FLAGS"]))
    from infire_jax.bench.gpu_target import device_count

    ec = engine_config(args)
    done = precompile(ec, os.environ["INFIRE_PRECOMPILE_TARGET"] or None, device_count(None, ec.mesh),
                      log=lambda _: None)
    print("BOOT " + json.dumps(done), flush=True)


def run(args: argparse.Namespace) -> int:
    from infire_jax.bench.gpu_target import device_count

    ec = engine_config(args)
    args.devices = device_count(args.devices, ec.mesh)
    print(f"precompiling {ec.model or 'the default model'} for "
          f"{f'{args.devices} x {args.target}' if args.target else 'this machine'}:")
    done = precompile(ec, args.target, args.devices)
    print(f"{done['programs']} programs ({done['bytes'] / 1e6:.0f} MB) in {done['directory']}, "
          f"{done['seconds']:.0f} s")
    if done["pool_sized_here"]:
        print(f"the KV pool was sized to fill the card: serve with --num-kv-pages {done['num_kv_pages']} "
              "(and the same other settings) for the start to find these programs")
    return 0


if __name__ == "__main__":
    _boot_precompile()
