"""Checkpoints of the placed weights: written once in the layout the engine runs, restored straight
onto the devices.

A checkpoint is saved from the placed arrays themselves (stacked layers, fused projections, the
plan's kv-head repeats and stage padding, the serving dtype), so a restore does no conversion. On a
mesh it is an orbax checkpoint whose chunks subdivide each device's shard: every process reads only
the shards it holds, onto their NamedShardings, and no host assembles the whole model. On one
device it is one safetensors file (faster there; see `_format`). One checkpoint per (source, dtype,
placement) under the cache directory:

    checkpoints/<key>/manifest.json   written last, with its own CRC32: versions, storage format,
                                      source fingerprint, dtype, placement, every file's size and
                                      mtime or CRC32, the model config and name
    checkpoints/<key>/tokenizer.json, tokenizer_config.json
    checkpoints/<key>/weights/        the orbax checkpoint (OCDBT, uncompressed), or model.safetensors

It is served only if the manifest matches what a build would write now (versions, format, source
size and mtime, dtype, placement), no file is missing or extra, every weight file has its recorded
size and mtime (truncated, rewritten or replaced: one `stat` each), the small files their CRC32, and
the restore raises nothing. Anything else rebuilds it, in place, from the source loader. Weight
contents are not hashed at start: on the host that reads every shard on every process, and on the
devices it cost more than the restore on CPU (5 s for 2.5 GB); so a write that keeps a file's size
and mtime (bit rot, a deliberate `touch -d`) is not caught. A checkpoint that cannot be written
only costs the next start its speed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
import zlib
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from infire_jax.compression.resident import ResidentLayout, resident_layouts
from infire_jax.errors import ConfigError, UnsupportedModelError
from infire_jax.loaders.paths import cache_dir, default_model_path
from infire_jax.loaders.weights import NATIVE_FORMAT_VERSION, LoadedModel, Placed
from infire_jax.models.config import ModelConfig
from infire_jax.models.palette_kernels import palette_kernel_here
from infire_jax.models.registry import abstract_placement, build_state
from infire_jax.loaders.tokenizer import Tokenizer
from sharding.plan import ShardPlan

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT_VERSION = 1
_MANIFEST = "manifest.json"
_WEIGHTS = "weights"  # the orbax checkpoint, or one safetensors file
_SAFETENSORS = "model.safetensors"
_ABANDONED_SECONDS = 3600.0
# Chunks subdivide each device's shard, so a restore still reads only its own; smaller chunks are
# read in parallel (2.5 -> 1.7 s for a 2.5 GB single-device restore on 2 CPU cores).
_CHUNK_BYTES = 64 << 20


def checkpoints_root() -> str:
    return os.path.join(cache_dir(), "checkpoints")


def restore_or_build(spec: str | None, cfg: ModelConfig, dtype, plan: ShardPlan | None,
                     load_source: Callable[[], LoadedModel], compress: tuple[str, ...] = ()) -> Placed:
    """The model placed on the devices: restored from its checkpoint when a valid one exists, else
    `load_source()`d, placed, and checkpointed for the next start. `cfg`: the model's config, as
    its source declares it. `compress`: the kinds of weights kept palette-compressed
    (compression/resident.py), checkpointed coded, as placed. (loaders/load.py `load_placed`
    decides when checkpoints are bypassed.)"""
    t = _target(spec, cfg, dtype, plan, compress)
    t0 = time.monotonic()
    manifest = _read_manifest(t.path)
    problem = _agreed(_stale_or_damaged(t.path, manifest, t.expected))
    if problem is None:
        problem, restored = _restore(t, manifest)
        if problem is None:
            log.info("restored %s in %.2f s", t.path, time.monotonic() - t0)
            return restored
    log.info("building checkpoint %s: %s", t.path, problem)
    loaded = load_source()
    graphdef, state = build_state(loaded.config, loaded.weights, dtype, plan=plan, seed=loaded.random_seed,
                                  compress=compress)
    resident = {short: dataclasses.asdict(layout) for short, layout in resident_layouts(graphdef, state).items()}
    _save(t.path, dict(t.expected, resident=resident), loaded, state)
    return Placed(loaded, graphdef, state, problem)


def checkpoint_path(spec: str | None, cfg: ModelConfig, dtype, plan: ShardPlan | None,
                    compress: tuple[str, ...] = ()) -> str:
    """Where the checkpoint of this source, dtype and placement lives (whether or not it exists)."""
    return _target(spec, cfg, dtype, plan, compress).path


# ---- what a checkpoint is built from, and where it lives ---------------------------------------------

class _Target(NamedTuple):
    path: str
    expected: dict[str, Any]  # the manifest fields a servable checkpoint has
    graphdef: nnx.GraphDef
    flat: nnx.FlatState  # abstract weights (uncompressed: a compressed model's come from its manifest)
    shardings: dict[tuple, Any]
    config: ModelConfig
    dtype: Any
    plan: ShardPlan | None


def _target(spec: str | None, cfg: ModelConfig, dtype, plan: ShardPlan | None, compress: tuple[str, ...]) -> _Target:
    source = spec if _is_dummy(spec) else os.path.abspath(spec or default_model_path())
    graphdef, flat, shardings = abstract_placement(cfg, dtype, plan)
    placement = _placement(flat, shardings, plan)
    if compress:  # the coded parts' shapes depend on the weights: the manifest records them (`resident`)
        placement.update(compress=list(compress), kernel=palette_kernel_here() if plan is None else None)
    expected = {"format_version": CHECKPOINT_FORMAT_VERSION, "native_format_version": NATIVE_FORMAT_VERSION,
                "format": _format(plan), "source": _fingerprint(source), "dtype": jnp.dtype(dtype).name,
                "placement": placement}
    path = os.path.join(checkpoints_root(), _key(source, expected["dtype"], placement))
    return _Target(path, expected, graphdef, flat, shardings, cfg, dtype, plan)


def _is_dummy(spec: str | None) -> bool:
    return (spec or "").startswith("dummy:")


def _fingerprint(source: str) -> dict[str, Any]:
    """Size and mtime of the source file, or of each file at the top of a source directory (a
    `dummy:` model: its name, which fixes its config and weights)."""
    if _is_dummy(source):
        return {"path": source}
    if os.path.isdir(source):
        files = [e for e in os.scandir(source) if e.is_file()]
        return {"path": source, "files": {e.name: [e.stat().st_size, e.stat().st_mtime_ns] for e in files}}
    st = os.stat(source)
    return {"path": source, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _placement(flat: nnx.FlatState, shardings: dict, plan: ShardPlan | None) -> dict[str, Any]:
    """Everything that decides the stored arrays and their chunks: shapes, partition specs, the mesh,
    the kv-head repeat and the layers of each pipeline stage."""
    weights = {_dotted(path): [list(var.shape), str(shardings[path].spec) if shardings[path] else None]
               for path, var in flat}
    if plan is None:
        return {"mesh": None, "weights": weights}
    return {"mesh": plan.sizes, "kv_repeat": plan.kv_repeat, "stage_layers": list(plan.stage_layers),
            "weights": weights}


def _dotted(path: tuple) -> str:
    return ".".join(map(str, path))


def _key(source: str, dtype: str, placement: dict) -> str:
    """The directory name: one checkpoint per source, dtype and placement; a newer source or format
    rebuilds it in place rather than beside it."""
    blob = json.dumps([source, dtype, placement], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


# ---- validation ------------------------------------------------------------------------------------

def _read_manifest(path: str) -> dict | None:
    """The manifest's body, or None if it is missing or fails its own CRC32."""
    try:
        with open(os.path.join(path, _MANIFEST)) as f:
            manifest = json.load(f)
        body = manifest["body"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return body if manifest.get("crc32") == _json_crc32(body) else None


def _json_crc32(data: dict) -> int:
    return zlib.crc32(json.dumps(data, sort_keys=True).encode())


def _stale_or_damaged(path: str, manifest: dict | None, expected: dict) -> str | None:
    """Why the checkpoint at `path` must not be restored (from its manifest, a `stat` of each file
    and the CRC32 of the small ones), or None if it may be."""
    if manifest is None:
        return "no checkpoint" if not os.path.exists(path) else "the manifest is missing or damaged"
    for field, want in expected.items():
        if manifest.get(field) != want:
            return f"stale: {field} differs"
    files, recorded = _files(path), manifest["files"]
    if set(files) != set(recorded):
        return f"files differ from the manifest: {sorted(set(files) ^ set(recorded))[:3]}"
    for rel, want in recorded.items():
        got = _file_record(path, rel, files[rel])
        if got["size"] != want["size"]:
            return f"{rel} has {got['size']} bytes, expected {want['size']}"
        if got != want:
            return f"{rel} was rewritten after the build" if "mtime_ns" in want else f"{rel} fails its CRC32"
    return None


def _files(path: str) -> dict[str, os.stat_result]:
    """Every file under the checkpoint by relative path, the manifest excluded."""
    out = {}
    for dirpath, _, names in os.walk(path):
        for name in names:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, path)
            if rel != _MANIFEST:
                out[rel] = os.stat(full)
    return out


def _file_record(path: str, rel: str, st: os.stat_result) -> dict[str, int]:
    """What the manifest keeps of a file: the orbax files' size and mtime (a `stat`: their contents
    are the weights), the others' size and CRC32 (a few MB of tokenizer at most)."""
    if rel.split(os.sep)[0] == _WEIGHTS:
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    crc = 0
    with open(os.path.join(path, rel), "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return {"size": st.st_size, "crc32": crc}


def _agreed(problem: str | None) -> str | None:
    """Every process takes the same path: a rebuild ends in a collective save."""
    if jax.process_count() == 1:
        return problem
    from jax.experimental import multihost_utils

    if multihost_utils.process_allgather(np.int32(problem is not None)).any() and problem is None:
        return "another process cannot use the checkpoint"
    return problem


# ---- the two storage formats ---------------------------------------------------------------------

def _format(plan: ShardPlan | None) -> str:
    """orbax on a mesh: each device reads only its shard. On one device, which reads the whole model
    anyway, one safetensors file was faster (on CPU: 0.55 vs 0.63 s for SmolLM2 in float32, 2.3 vs
    3.1 s for 2.5 GB of bfloat16); INFIRE_JAX_CHECKPOINT_FORMAT=orbax uses orbax there too."""
    chosen = os.environ.get("INFIRE_JAX_CHECKPOINT_FORMAT", "")
    if chosen not in ("", "orbax", "safetensors"):
        raise ConfigError(f"INFIRE_JAX_CHECKPOINT_FORMAT={chosen!r}: expected orbax or safetensors")
    return "orbax" if plan is not None or chosen == "orbax" else "safetensors"


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, use_compression=False))


def _tree(items: dict[tuple, Any]) -> dict[str, Any]:
    """Nested dicts from parameter paths: the PyTree orbax stores."""
    tree: dict[str, Any] = {}
    for path, value in items.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(str(key), {})
        node[str(path[-1])] = value
    return tree


def _leaf(tree: dict, path: tuple) -> Any:
    for key in path:
        tree = tree[str(key)]
    return tree


def _read_orbax(t: _Target) -> list:
    """Each array straight onto its NamedSharding; with no plan, into host memory (placed below).
    Each in the dtype the model declares for it (the serving dtype, or float32 where a model keeps it)."""
    import orbax.checkpoint as ocp

    target = _tree({p: jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=t.shardings[p]) for p, var in t.flat})
    restored = _checkpointer().restore(os.path.join(t.path, _WEIGHTS), args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
    return [_leaf(restored, p) for p, _ in t.flat]


def _read_safetensors(t: _Target) -> list:
    from safetensors.numpy import load_file

    host = load_file(os.path.join(t.path, _WEIGHTS, _SAFETENSORS))
    arrays = [host.pop(_dotted(p)) for p, _ in t.flat]
    if host or any(a.dtype != var.dtype or a.shape != tuple(var.shape) for a, (_, var) in zip(arrays, t.flat)):
        raise UnsupportedModelError(f"{_SAFETENSORS} holds other weights than the manifest describes")
    return arrays


def _write_orbax(path: str, arrays: dict[tuple, jax.Array]) -> None:
    """Every process writes the shards it holds, in chunks of at most _CHUNK_BYTES."""
    import orbax.checkpoint as ocp

    tree = _tree(arrays)
    chunked = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=_CHUNK_BYTES), tree)
    _checkpointer().save(path, args=ocp.args.PyTreeSave(tree, save_args=chunked))


def _write_safetensors(path: str, arrays: dict[tuple, jax.Array]) -> None:
    from safetensors.numpy import save_file

    os.makedirs(path)
    save_file({_dotted(p): np.asarray(a) for p, a in arrays.items()}, os.path.join(path, _SAFETENSORS))


_READERS = {"orbax": _read_orbax, "safetensors": _read_safetensors}
_WRITERS = {"orbax": _write_orbax, "safetensors": _write_safetensors}


# ---- restore and save -------------------------------------------------------------------------------

def _restore(t: _Target, manifest: dict) -> tuple[str | None, Placed | None]:
    """Reads each shard onto its device. With no plan (one device) the arrays are read into host
    memory and put on the default device as `build_state` does, uncommitted, so the engine's
    compiled steps see the same arrays whichever way the weights came."""
    try:
        if manifest.get("resident"):  # palette-coded weights: their parts' shapes as built
            layouts = {short: ResidentLayout(tuple(v["grid"]), v["capacity"], v["kernel"])
                       for short, v in manifest["resident"].items()}
            t = t._replace(**dict(zip(("graphdef", "flat", "shardings"),
                                      abstract_placement(t.config, t.dtype, t.plan, layouts))))
        arrays = _READERS[manifest["format"]](t)
        tokenizer = Tokenizer.from_dir(t.path)
        problem = None
    except Exception as e:  # whatever a damaged file raises, the answer is a rebuild
        problem = f"restore failed: {type(e).__name__}: {e}"
    problem = _agreed(problem)
    if problem is not None:
        return problem, None
    arrays = [a if isinstance(a, jax.Array) else jax.device_put(a) for a in arrays]
    loaded = LoadedModel(config=ModelConfig.from_dict(manifest["config"]), tokenizer=tokenizer, name=manifest["name"],
                         weights={})
    state = nnx.from_flat_state([(p, var.replace(a)) for (p, var), a in zip(t.flat, arrays)])
    return None, Placed(loaded, t.graphdef, state, None)


def _save(path: str, expected: dict, loaded: LoadedModel, state: nnx.State) -> None:
    """Writes the placed state (each process its own shards) into a temporary directory, then the
    tokenizer and the manifest, and renames it into place. Failures are logged, not raised."""
    arrays = {p: var.get_value() for p, var in nnx.to_flat_state(state)}
    primary = jax.process_index() == 0
    tmp = f"{path}.tmp{_shared_pid()}"
    try:
        if primary:
            _prune(checkpoints_root(), keep=path)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        _sync("infire_ckpt_tmp")
        _WRITERS[expected["format"]](os.path.join(tmp, _WEIGHTS), arrays)
        if primary:
            loaded.tokenizer.save(tmp)
            manifest = dict(expected, name=loaded.name, config=loaded.config.to_dict(),
                            files={rel: _file_record(tmp, rel, st) for rel, st in _files(tmp).items()})
            _write_json(os.path.join(tmp, _MANIFEST), {"crc32": _json_crc32(manifest), "body": manifest})
            _replace_dir(tmp, path)
    except Exception as e:  # a cache that cannot be written only costs the next start its speed
        log.warning("could not write the checkpoint %s: %s: %s", path, type(e).__name__, e)
        if primary:
            shutil.rmtree(tmp, ignore_errors=True)
    _sync("infire_ckpt_done")


def _write_json(path: str, data: dict) -> None:
    with open(f"{path}.part", "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f"{path}.part", path)


def _replace_dir(tmp: str, path: str) -> None:
    """Moves a finished checkpoint into place, the previous one (stale or damaged) out of the way."""
    old = f"{tmp}.old"
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def _prune(root: str, keep: str) -> None:
    """Drops checkpoints whose source is gone, and builds abandoned over an hour ago, so temporary
    models (tests) and crashed builds do not pile up in the cache."""
    if not os.path.isdir(root):
        return
    now = time.time()
    for entry in os.scandir(root):
        if entry.path == keep or not entry.is_dir():
            continue
        manifest = _read_manifest(entry.path)
        abandoned = (manifest is None or ".tmp" in entry.name) and now - entry.stat().st_mtime > _ABANDONED_SECONDS
        source = manifest["source"]["path"] if manifest is not None else ""
        if abandoned or (manifest is not None and not _is_dummy(source) and not os.path.exists(source)):
            shutil.rmtree(entry.path, ignore_errors=True)


def _shared_pid() -> int:
    """Process 0's pid, the same temporary directory name on every process."""
    if jax.process_count() == 1:
        return os.getpid()
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(os.getpid())))


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
