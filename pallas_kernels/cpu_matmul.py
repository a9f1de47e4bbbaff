"""The skinny matmul of CPU decode steps: a C++ XLA FFI call that streams a layer's weights once.

XLA CPU's dot reaches 8-14 GB/s on a decode step's [T <= 16, K] x [K, N] products, a third of
what the machine streams, and those products are most of a small model's step. `csrc/
skinny_matmul.cc` reads the layer's slice of the stacked weight in place (the call takes the whole
stack and the layer index, so the scan makes no copy of the slice) on XLA's own thread pool.

The source is compiled once per machine with the system's C++ compiler (`CXX`, else `c++`) into
the infire_jax cache, keyed by the source, the jax version and the host CPU. Without a compiler,
or with `INFIRE_JAX_NO_CPU_KERNELS=1`, `available()` is False and the models keep XLA's dot.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

log = logging.getLogger(__name__)

TARGET = "infire_skinny_matmul"
HEAD_TARGET = "infire_skinny_matmul_nt"
MAX_ROWS = 16  # decode-sized steps: measured up to 16 rows (docs/PERFORMANCE.md); larger steps keep XLA's dot
_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "skinny_matmul.cc")


def _cache_dir() -> str:
    base = os.environ.get("INFIRE_JAX_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "infire_jax"))
    return os.path.join(base, "cpu_kernels")


def host_cpu() -> str:
    """The CPU model and flags: `-march=native` code is only valid on the CPU that built it."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor()


def _build() -> str:
    """Compiles the source (once per source, jax version and CPU) and returns the library's path."""
    with open(_SOURCE, "rb") as f:
        source = f.read()
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", f"-I{jax.ffi.include_dir()}"]
    key = hashlib.sha256(source + jax.__version__.encode() + host_cpu().encode() + " ".join(flags).encode())
    path = os.path.join(_cache_dir(), f"skinny_matmul-{key.hexdigest()[:16]}.so")
    if not os.path.exists(path):
        os.makedirs(_cache_dir(), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
        os.close(fd)
        try:
            subprocess.run([cxx, *flags, _SOURCE, "-o", tmp], check=True, capture_output=True, text=True)
            os.replace(tmp, path)  # atomic: concurrent builders each write their own file
        except subprocess.CalledProcessError as e:
            os.unlink(tmp)
            raise RuntimeError(f"{cxx} failed on {_SOURCE}: {e.stderr.strip()[-2000:]}") from e
    return path


@functools.cache
def available() -> bool:
    """Whether the FFI call is built and registered (on CPU, unless turned off)."""
    if os.environ.get("INFIRE_JAX_NO_CPU_KERNELS"):
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(_build())
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.InfireSkinnyMatmul), platform="cpu")
        jax.ffi.register_ffi_target(HEAD_TARGET, jax.ffi.pycapsule(lib.InfireSkinnyMatmulNT), platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("CPU skinny-matmul kernel unavailable, using XLA's dot: %s", e)
        return False
    return True


def applies(rows: int, weight: Array) -> bool:
    """Whether a [rows, K] x weight product should take the FFI call (decided at trace time)."""
    return (rows <= MAX_ROWS and weight.dtype in (jnp.float32, jnp.bfloat16) and weight.shape[-2] % 4 == 0
            and weight.shape[-1] % 16 == 0 and jax.default_backend() == "cpu" and available())


def skinny_matmul(x: Float[Array, "M K"], stacked: Float[Array, "L K N"],
                  layer: Int[Array, ""]) -> Float[Array, "M N"]:
    """x @ stacked[layer] in float32, reading the layer's float32 or bfloat16 weights in place; M <= MAX_ROWS."""
    m, k = x.shape
    if stacked.shape[1] != k:
        raise ValueError(f"x has {k} features but the weight's layers are {stacked.shape[1:]}")
    out = jax.ShapeDtypeStruct((m, stacked.shape[2]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x.astype(jnp.float32), stacked, layer.astype(jnp.int32))


def head_applies(rows: int, head: Array) -> bool:
    """Whether the LM head product takes the FFI call: bfloat16 heads only. XLA CPU converts the
    whole bfloat16 head to float32 every step (25 ms of a 70 ms step here); a float32 head gets
    XLA's best rate already (docs/PERFORMANCE.md)."""
    return (rows <= MAX_ROWS and head.dtype == jnp.bfloat16 and head.ndim == 2 and head.shape[1] % 16 == 0
            and jax.default_backend() == "cpu" and available())


def head_matmul(x: Float[Array, "M E"], head: Float[Array, "V E"]) -> Float[Array, "M V"]:
    """x @ head.T in float32, `head` in the embedding's [V, E] layout, read in place; M <= MAX_ROWS."""
    if head.shape[1] != x.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features but the head is {head.shape}")
    out = jax.ShapeDtypeStruct((x.shape[0], head.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(HEAD_TARGET, out)(x.astype(jnp.float32), head)
