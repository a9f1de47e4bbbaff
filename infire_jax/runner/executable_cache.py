"""The step programs kept on disk as serialized executables, so a warm start traces nothing (issue 9).

XLA's persistent cache (engine_setup.enable_compilation_cache) skips compilation, but finding a
program in it takes the program's HLO: a warm start still traced and lowered every step program, 0.1-0.25 s
each, three quarters of a warm CPU boot. This cache keys a program by what it is made of instead:
the package's source, jax and the devices, the runner's static settings and the arguments' shapes,
dtypes and shardings. A hit deserializes the executable without tracing anything. A miss is traced
and looked up once more by its lowered text: runners of other settings share the programs those
settings do not change (the samplers of engines whose pools differ), compiled once.

The key names only what decides the executable, so that another machine can fill the cache for this
one (`infire-jax precompile`, bench/precompile.py: a GPU's programs compiled on a CPU machine): the
platform (jax, jaxlib and the CUDA plugin's versions, the devices' kind; the host CPU only for CPU
code), the compiler's settings from the environment (XLA_FLAGS, INFIRE_JAX_*, jax's own; not the
platform choice, the allocator's share or a container's CUDA_* variables), and each argument's
devices by id, not by the device object's class (a topology's device where the GPU's own will run).

An executable that XLA's persistent cache loaded cannot be serialized again (on CPU the copy fails
at its first run: "Function ... not found"; so did one stored while XLA's cache was on),
so a program this cache misses is compiled with XLA's cache switched off for that moment. The
runner compiles its misses after the weights are read, so no other compile runs meanwhile. A file that is corrupt, or that this jax cannot load, is
deleted and its program compiled again; it is never run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import hashlib
import logging
import os
import pickle
import shutil
import tempfile
import threading
from typing import Any, Callable

import jax
import jaxlib
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache

import pallas_kernels
import sharding.plan
from infire_jax.loaders.paths import cache_dir
from pallas_kernels import cpu_kernels

log = logging.getLogger(__name__)

_MAGIC = b"infire-executable-2\n"
_SOURCE_SUFFIXES = (".py", ".cc", ".h")
_ENV_PREFIXES = ("INFIRE_JAX_", "XLA_FLAGS", "JAX_")
# Where caches live, and what does not change a program: the platform's choice (a CPU machine compiling
# for a GPU sets JAX_PLATFORMS=cpu) and the allocator's share of the card.
_ENV_IGNORED = ("INFIRE_JAX_CACHE", "INFIRE_JAX_EXECUTABLE_CACHE_GB", "JAX_COMPILATION_CACHE_DIR", "JAX_PLATFORMS",
                "JAX_PLATFORM_NAME")


@dataclasses.dataclass(frozen=True)
class Platform:
    """What an executable is built for, besides its program: the jax build (and CUDA plugin), the
    backend, the devices' kind, the process count, and for CPU code the host CPU (-march=native
    code in the CPU kernels, and XLA's own CPU code, run only where they were built)."""

    versions: tuple[str, ...]
    backend: str
    device_kinds: tuple[str, ...]
    process_count: int
    host_cpu: str


def _versions() -> tuple[str, ...]:
    """jax, jaxlib and the CUDA plugin's distributions (the GPU's compiler), as installed."""
    plugins = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
                     if (d.metadata["Name"] or "").lower().startswith(("jax-cuda", "jax_cuda")))
    return (jax.__version__, jaxlib.__version__, *plugins)


@functools.cache
def this_platform() -> Platform:
    backend = jax.default_backend()
    return Platform(_versions(), backend, tuple(sorted({d.device_kind for d in jax.devices()})),
                    jax.process_count(), cpu_kernels.host_cpu() if backend == "cpu" else "")


def gpu_platform(device_kind: str) -> Platform:
    """A GPU machine of one process whose cards are `device_kind`, with this machine's jax build."""
    return Platform(_versions(), "gpu", (device_kind,), 1, "")


def for_runner(context: str, platform: Platform | None = None) -> ExecutableCache | None:
    """The cache of a runner whose static settings `context` describes, under the infire_jax cache
    dir, for this machine or `platform`; None with several processes (each would need the others'
    executables), with on-disk compilation caches turned off (INFIRE_JAX_NO_COMPILE_CACHE), or with
    INFIRE_JAX_NO_EXECUTABLE_CACHE=1."""
    if os.environ.get("INFIRE_JAX_NO_EXECUTABLE_CACHE") or os.environ.get("INFIRE_JAX_NO_COMPILE_CACHE") \
            or jax.process_count() > 1:
        return None
    return ExecutableCache(os.path.join(cache_dir(), "executables"), context, platform=platform)


@functools.cache
def _source_fingerprint() -> str:
    """Every source file of the packages that build the programs (a code change is a new program)."""
    h = hashlib.sha256()
    infire_jax_dir = os.path.dirname(os.path.dirname(__file__))  # this file is infire_jax/runner/executable_cache.py
    for pkg in (infire_jax_dir, os.path.dirname(pallas_kernels.__file__),
                os.path.dirname(sharding.plan.__file__)):
        for root, dirs, files in os.walk(pkg):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(_SOURCE_SUFFIXES)):
                path = os.path.join(root, name)
                h.update(os.path.relpath(path, os.path.dirname(pkg)).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def _runtime_fingerprint(platform: Platform) -> str:
    """What else decides the executable: the platform, the environment's compiler settings, and on
    CPU whether the CPU kernels are there (read anew for each runner: tests switch the last two
    within a process)."""
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) and k not in _ENV_IGNORED)
    return repr([platform, env, jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision,
                 platform.backend == "cpu" and cpu_kernels.available()])


def _placement(sharding: Any) -> Any:
    """A sharding as the devices (by id) and layout it stands for: an argument without one runs on
    the first device, as one placed there does; a topology's device and the card's own are alike."""
    if sharding is None:
        return ("device", 0, "device")
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (device,) = sharding.device_set
        return ("device", device.id, sharding.memory_kind or "device")
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        return ("mesh", tuple(mesh.axis_names), tuple(mesh.devices.shape), tuple(d.id for d in mesh.devices.flat),
                str(sharding.spec), sharding.memory_kind or "device")
    return repr(sharding)


def _signature(args: Any) -> str:
    """The arguments' tree, shapes, dtypes and placements (arrays and ShapeDtypeStructs alike)."""
    leaves, tree = jax.tree.flatten(args)
    return repr((str(tree), [(tuple(a.shape), str(a.dtype), _placement(getattr(a, "sharding", None)),
                              bool(getattr(a, "weak_type", False))) for a in leaves]))


_switch = threading.Lock()  # XLA's cache is switched process-wide: off while any fresh compile runs
_fresh_compiles = 0
_switched_off = False


@contextlib.contextmanager
def _without_xla_cache():
    global _fresh_compiles, _switched_off
    with _switch:
        if _fresh_compiles == 0 and jax.config.jax_compilation_cache_dir and jax.config.jax_enable_compilation_cache:
            jax.config.update("jax_enable_compilation_cache", False)
            compilation_cache.reset_cache()
            _switched_off = True
        _fresh_compiles += 1
    try:
        yield
    finally:
        with _switch:
            _fresh_compiles -= 1
            if _fresh_compiles == 0 and _switched_off:
                jax.config.update("jax_enable_compilation_cache", True)
                compilation_cache.reset_cache()
                _switched_off = False


class ExecutableCache:
    """A directory of serialized executables for one runner (`context`: its static settings)."""

    def __init__(self, directory: str, context: str, max_bytes: int | None = None, platform: Platform | None = None):
        self.directory = directory
        self.max_bytes = max_bytes if max_bytes is not None else \
            int(float(os.environ.get("INFIRE_JAX_EXECUTABLE_CACHE_GB", "4")) * 2**30)
        self._runtime = _source_fingerprint() + _runtime_fingerprint(platform or this_platform())
        self._prefix = self._runtime + context
        self.loaded = 0  # programs deserialized from the cache
        self.compiled = 0  # programs compiled (and written) because the cache missed
        self.shared = 0  # programs traced, then loaded: another runner had stored the same one

    def path(self, name: str, args: Any) -> str:
        key = hashlib.sha256((self._prefix + name + _signature(args)).encode()).hexdigest()
        return os.path.join(self.directory, key[:40] + ".exe")

    def get(self, name: str, args: Any, lower: Callable[[], jax.stages.Lowered]) -> jax.stages.Compiled:
        """The executable of program `name` called on `args`: from the cache, else compiled."""
        return self.load(name, args) or self.compile(name, args, lower)

    def load(self, name: str, args: Any) -> jax.stages.Compiled | None:
        """The cached executable, or None (nothing traced or compiled)."""
        compiled = self._load(self.path(name, args), args)
        self.loaded += compiled is not None
        return compiled

    def put(self, name: str, args: Any, compiled: jax.stages.Compiled) -> int:
        """Stores `compiled`, built elsewhere (`infire-jax precompile`), as program `name` on `args`;
        its size in bytes, 0 where it cannot be serialized."""
        path = self.path(name, args)
        return os.path.getsize(path) if self._store(path, compiled) else 0

    def compile(self, name: str, args: Any, lower: Callable[[], jax.stages.Lowered]) -> jax.stages.Compiled:
        """`lower()` compiled and written to the cache; or, where a runner of other settings already
        stored the same program (the same lowered text for the same devices: a sampler does not
        change with the pool's size), that executable, loaded. XLA's persistent cache is switched off
        while compiling, process-wide: other compiles of the process should not run at the same time
        (they would miss it too, and not be written to it)."""
        lowered = lower()
        shared = self._shared_path(lowered, args)
        compiled = self._load(shared, args)
        if compiled is None:
            with _without_xla_cache():
                compiled = lowered.compile()
            self.compiled += 1
            self._store(shared, compiled)
        else:
            self.shared += 1
        _link(shared, self.path(name, args))
        return compiled

    def _shared_path(self, lowered: jax.stages.Lowered, args: Any) -> str:
        """The file of a program by its lowered text and its arguments' shapes, dtypes and devices. The
        text alone is not enough: it leaves out the arguments a program does not read, and an
        executable loads only for the arguments it was compiled with (`_load`), so two programs
        differing there (a kept-quantized model's and a dequantized one's) would overwrite each other."""
        leaves = jax.tree.leaves(args)
        devices = sorted({d.id for a in leaves
                          for d in (a.sharding.device_set if getattr(a, "sharding", None) is not None
                                    else (jax.devices()[0],))})
        shapes = [(tuple(a.shape), str(a.dtype)) for a in leaves]
        h = hashlib.sha256((self._runtime + repr(devices) + repr(shapes)).encode())
        h.update(lowered.as_text().encode())
        return os.path.join(self.directory, "hlo-" + h.hexdigest()[:40] + ".exe")

    def _load(self, path: str, args: Any) -> jax.stages.Compiled | None:
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return None
        try:
            head = len(_MAGIC) + 32
            if blob[:len(_MAGIC)] != _MAGIC or hashlib.sha256(blob[head:]).digest() != blob[len(_MAGIC):head]:
                raise ValueError("bad header or checksum")
            serialized, in_tree, out_tree, device_ids = pickle.loads(blob[head:])
            devices = {d.id: d for d in jax.devices()}
            if not set(device_ids) <= devices.keys():
                raise ValueError(f"it runs on devices {device_ids}, this process has {sorted(devices)}")
            # Its own devices, in its order: by default all of the process's would be assumed.
            compiled = serialize_executable.deserialize_and_load(
                serialized, in_tree, out_tree, execution_devices=[devices[i] for i in device_ids])
            want = [(a.shape, a.dtype) for a in jax.tree.leaves(args)]
            got = [(i.shape, i.dtype) for i in jax.tree.leaves(compiled.args_info[0])]
            if [(tuple(s), str(d)) for s, d in want] != [(tuple(s), str(d)) for s, d in got]:
                raise ValueError("its arguments differ from the ones asked for")
        except Exception as e:  # noqa: BLE001 - any unreadable entry is rebuilt, never run
            log.warning("executable cache: rebuilding %s (%s: %s)", os.path.basename(path), type(e).__name__, e)
            _remove(path)
            return None
        return compiled

    def _store(self, path: str, compiled: jax.stages.Compiled) -> bool:
        try:
            payload = pickle.dumps((*serialize_executable.serialize(compiled), _device_ids(compiled)))
        except (ValueError, TypeError, AttributeError, pickle.PicklingError) as e:  # e.g. host callbacks
            log.info("executable cache: %s not stored (%s)", os.path.basename(path), e)
            return False
        os.makedirs(self.directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=self.directory)
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, path)  # atomic: a concurrent start reads the old file or the new one
        self._bound()
        return True

    def _bound(self) -> None:
        """Deletes the oldest executables while the directory holds over max_bytes (a code change
        or an upgrade leaves the earlier ones behind). A program's names (its runners' keys and its
        lowered text's, hard links of one file) count once and go together."""
        files: dict[int, list] = {}  # inode -> [mtime, size, names]
        for name in os.listdir(self.directory):
            try:
                st = os.stat(os.path.join(self.directory, name))
            except FileNotFoundError:
                continue
            files.setdefault(st.st_ino, [st.st_mtime, st.st_size, []])[2].append(name)
        total = sum(size for _, size, _ in files.values())
        for _, size, names in sorted(files.values()):
            if total <= self.max_bytes:
                break
            for name in names:
                _remove(os.path.join(self.directory, name))
            total -= size


def _device_ids(compiled: jax.stages.Compiled) -> list[int]:
    """The devices the executable was compiled for, in its device assignment's order (the private
    field serialize_executable itself reads the executable from; missing, nothing is stored)."""
    return [d.id for d in compiled._executable._unloaded_executable.device_list]


def _link(target: str, path: str) -> None:
    """`path` names the file `target` (a hard link; a copy where links are not possible). Nothing when
    `target` was not stored."""
    if not os.path.exists(target) or target == path:
        return
    os.utime(target)  # used now: the size bound drops the least recently written first
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        os.link(target, tmp)
    except OSError:
        shutil.copyfile(target, tmp)
    os.replace(tmp, path)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
