"""`bench boot`: time to ready and to the first token of a fresh engine process, cold and warm.

Every boot is a new process that builds the engine from the flags and generates one token, with
its caches in a fresh directory. The first boot finds them empty: it converts the model, writes
its checkpoint (`built`) and compiles every step. Then each of --runs rounds boots once with the
checkpoint's files evicted from the page cache (`cold`: weights read from the drive, steps from
the executable cache) and once right after (`warm`: from memory). Times count from the process's
start, imports included; `load` is the weights alone (checks, restore, placement) and `compile`
the warmup of every step bucket and the pool's allocation (programs `compiled` by XLA, `loaded`
from infire_jax's executable cache without tracing, or `cached`: traced and then found in XLA's
persistent cache). The floor is the checkpoint's bytes over the drive's read speed: the faster of
O_DIRECT reads and np.fromfile of the same files, both past the page cache. A `dummy:` model has
no checkpoint (its weights are drawn on the devices): it gets a first boot and --runs warm ones,
and no floor; kept compressed (--weights-compression), it is checkpointed coded, like any model.
With --precompile, `infire-jax precompile` fills the fresh cache first, in a process that sees no
GPU (JAX_PLATFORMS=cpu: the card's programs compiled without it; `here`: this machine's own), so
the first boot shows a start whose steps were compiled elsewhere (pass --num-kv-pages: the pool
must be the one compiled for).
Single process only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from infire_jax.bench.common import BenchError, positive_int
from infire_jax.engine.args import add_engine_args, engine_config

DESCRIPTION = __doc__.split("\n\n", 1)[1]
_RESULT = "BOOT "


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runs", type=positive_int, default=3, help="cold and warm boots measured (each)")
    p.add_argument("--precompile", default=None, choices=["h100", "h200", "auto", "here"],
                   help="fill the cache with `infire-jax precompile` before the first boot: --target h100/h200 "
                        "(auto: this machine's GPU, from nvidia-smi) in a process without the GPU; here: "
                        "for this machine's own devices")
    add_engine_args(p)


def _files(path: str) -> list[str]:
    return sorted(os.path.join(d, n) for d, _, names in os.walk(path) for n in names)


def evict(path: str) -> None:
    """Drops a directory's files from the page cache, so the next read comes from the drive."""
    for name in _files(path):
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_speed(path: str) -> tuple[int, float]:
    """Bytes under `path` and the seconds to read them from the drive: O_DIRECT reads of 16 MiB, past
    the page cache (buffered reads of evicted files where O_DIRECT is refused)."""
    import mmap

    evict(path)
    buf, total = mmap.mmap(-1, 16 << 20), 0  # page-aligned, as O_DIRECT needs
    t0 = time.perf_counter()
    for name in _files(path):
        try:
            fd = os.open(name, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError:
            fd = os.open(name, os.O_RDONLY)
        try:
            while n := os.readv(fd, [buf]):
                total += n
        finally:
            os.close(fd)
    return total, time.perf_counter() - t0


def fromfile_seconds(path: str, cold: bool) -> float:
    """Seconds for np.fromfile to read every file under `path` into memory (evicted first if `cold`):
    the plain-numpy baseline a loader is compared with."""
    import numpy as np

    if cold:
        evict(path)
    t0 = time.perf_counter()
    for name in _files(path):
        np.fromfile(name, np.uint8)
    return time.perf_counter() - t0


def boot(args: argparse.Namespace) -> None:
    """One boot, in this fresh process: ready, then one token; prints the timings as a JSON line."""
    started = float(os.environ["INFIRE_BOOT_STARTED"])
    from infire_jax.compression.resident import parse_resident
    from infire_jax.engine.engine import Engine
    from infire_jax.loaders.load import checkpoint_path
    from infire_jax.sample.sampling_params import SamplingParams

    imported = time.time()
    engine = Engine(engine_config(args))
    ready = time.time()
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    first = time.time()
    engine.close()
    drawn = _drawn(args)
    kinds = parse_resident(args.weights_compression)[1] if args.weights_compression else ()
    path = None if drawn else checkpoint_path(args.model, engine.dtype, engine.plan, kinds)
    manifest = os.path.join(path, "manifest.json") if path else ""
    print(_RESULT + json.dumps(dict(
        import_s=imported - started, load_s=engine.load_seconds, compile_s=engine.warmup_seconds,
        compiled=engine.boot.compiled, executables_loaded=engine.boot.executables_loaded,
        cache_loaded=engine.boot.cache_loaded, restored=engine.boot.restored,
        ready_s=ready - started, first_token_s=first - started, checkpoint=path, weight_bytes=engine.boot.weight_bytes,
        built=bool(path) and os.path.exists(manifest) and os.stat(manifest).st_mtime >= started)), flush=True)


def _drawn(args: argparse.Namespace) -> bool:
    """A `dummy:` model whose weights every start draws (no checkpoint: it is not kept compressed)."""
    return (args.model or "").startswith("dummy:") and not args.weights_compression


def _gpu_target(choice: str) -> str:
    """--precompile's target: the named one, this machine's card (auto: nvidia-smi's name), or ""
    (here: this machine's own devices)."""
    if choice != "auto":
        return "" if choice == "here" else choice
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise BenchError(f"--precompile auto reads this machine's GPU from nvidia-smi: {e}") from e
    return "h200" if "H200" in name else "h100"


def _precompile(flags: dict, cache: str, target: str) -> dict:
    """`infire-jax precompile --target` of the boots' settings into `cache`, without the GPU."""
    if not (flags.get("num_kv_pages") or flags.get("kv_cache_memory")):
        raise BenchError("--precompile needs --num-kv-pages or --kv-cache-memory: the boots' pool must be the "
                         "one the programs were compiled for")
    target = _gpu_target(target)
    env = dict(os.environ, INFIRE_BOOT_FLAGS=json.dumps(flags), INFIRE_JAX_CACHE=cache,
               INFIRE_PRECOMPILE_TARGET=target, **({"JAX_PLATFORMS": "cpu"} if target else {}))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "infire_jax.bench.precompile"], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT)]
    if proc.returncode != 0 or not lines:
        raise BenchError(f"precompile failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return dict(json.loads(lines[0][len(_RESULT):]), process_s=time.perf_counter() - t0)


def _spawn(flags: dict, cache: str) -> dict:
    env = dict(os.environ, INFIRE_BOOT_FLAGS=json.dumps(flags), INFIRE_JAX_CACHE=cache,
               INFIRE_BOOT_STARTED=repr(time.time()))
    proc = subprocess.run([sys.executable, "-m", "infire_jax.bench.boot"], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT)]
    if proc.returncode != 0 or not lines:
        raise BenchError(f"a boot failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(lines[0][len(_RESULT):])


COLUMNS = [
    ("mode", "boot", "{}"), ("runs", "runs", "{}"), ("built", "built", "{}"), ("import_s", "import s", "{:.2f}"),
    ("load_s", "load s", "{:.2f}"), ("load_gb_per_s", "load GB/s", "{:.2f}"), ("floor_s", "floor s", "{:.2f}"),
    ("compile_s", "compile s", "{:.2f}"), ("compiled", "compiled", "{:.0f}"),
    ("executables_loaded", "loaded", "{:.0f}"), ("cache_loaded", "cached", "{:.0f}"),
    ("ready_s", "ready s", "{:.2f}"), ("first_token_s", "first token s", "{:.2f}"),
    ("ready_over_floor_s", "ready - floor s", "{:.2f}"),
]


def _summary(mode: str, boots: list[dict], nbytes: int, drive_s: float | None) -> dict:
    import numpy as np

    row = {k: float(np.median([b[k] for b in boots])) for k in ("import_s", "load_s", "compile_s", "compiled", "executables_loaded",
                                                                 "cache_loaded", "ready_s", "first_token_s")}
    return dict(mode=mode, runs=len(boots), built=sum(b["built"] for b in boots),
                load_gb_per_s=nbytes / row["load_s"] / 1e9, floor_s=drive_s,
                ready_over_floor_s=None if drive_s is None else row["ready_s"] - drive_s, **row)


def run(args: argparse.Namespace):
    from infire_jax.bench import report
    from infire_jax.bench.common import settings

    if args.num_processes:
        raise BenchError("bench boot runs a single process")
    flags = settings(args)
    precompiled, first_mode = None, "precompiled" if args.precompile else "first"
    if _drawn(args):  # weights drawn on the devices: no checkpoint, no floor
        with tempfile.TemporaryDirectory(prefix="infire-boot-") as cache:
            precompiled = args.precompile and _precompile(flags, cache, args.precompile)
            boots = [_spawn(flags, cache) for _ in range(args.runs + 1)]
        nbytes = boots[0]["weight_bytes"]
        rows = [_summary(first_mode, boots[:1], nbytes, None), _summary("warm", boots[1:], nbytes, None)]
        payload = dict(benchmark="boot", settings=flags, weight_bytes=nbytes, results=rows, precompiled=precompiled,
                       boots=dict(first=boots[0], warm=boots[1:]))
        title = f"boot: {args.model}, weights {nbytes / 1e9:.2f} GB drawn on the devices (no checkpoint to read)"
        return report.Result(payload, report.table(rows, COLUMNS), [], title)
    with tempfile.TemporaryDirectory(prefix="infire-boot-") as cache:  # the first boot finds every cache empty
        precompiled = args.precompile and _precompile(flags, cache, args.precompile)
        first = _spawn(flags, cache)
        if not os.path.isdir(first["checkpoint"]):
            raise BenchError(f"no checkpoint was written at {first['checkpoint']} (INFIRE_JAX_NO_CHECKPOINT?)")
        nbytes, direct_s = read_speed(first["checkpoint"])
        fromfile = dict(cold=fromfile_seconds(first["checkpoint"], cold=True),
                        warm=fromfile_seconds(first["checkpoint"], cold=False))
        drive_s = min(direct_s, fromfile["cold"])  # buffered reads with readahead can beat O_DIRECT
        cold, warm = [], []
        for _ in range(args.runs):
            evict(first["checkpoint"])
            cold.append(_spawn(flags, cache))
            warm.append(_spawn(flags, cache))
    rows = [_summary(first_mode, [first], nbytes, drive_s), _summary("cold", cold, nbytes, drive_s),
            _summary("warm", warm, nbytes, drive_s)]
    payload = dict(benchmark="boot", settings=flags, precompiled=precompiled, checkpoint=first["checkpoint"],
                   checkpoint_bytes=nbytes,
                   drive_seconds=drive_s, drive_gb_per_s=nbytes / drive_s / 1e9, direct_read_seconds=direct_s,
                   fromfile_seconds=fromfile, results=rows, boots=dict(first=first, cold=cold, warm=warm))
    title = (f"boot: {args.model or 'default model'}, checkpoint {nbytes / 1e9:.2f} GB, "
             f"drive {nbytes / drive_s / 1e9:.2f} GB/s; np.fromfile {fromfile['cold']:.2f} s cold, "
             f"{fromfile['warm']:.2f} s warm")
    return report.Result(payload, report.table(rows, COLUMNS), [], title)


if __name__ == "__main__":
    boot(argparse.Namespace(**json.loads(os.environ["INFIRE_BOOT_FLAGS"])))
