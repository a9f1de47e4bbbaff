"""The C++ XLA FFI kernels of the CPU path (`csrc/*.cc`): built once per machine, registered with jax.

`cpu_matmul` (the layer weights' and LM head's matmuls, palette-compressed and GGUF Q4_1 ones included),
`cpu_attention` (decode-step paged attention) and `cpu_lora` (LoRA adapters' deltas, a slot per token)
are calls into one library. Its sources are compiled with the system's C++ compiler (`CXX`, else
`c++`) and `-march=native` into the infire_jax cache (or `INFIRE_JAX_KERNEL_CACHE`), keyed by the
sources, the jax version and the host CPU. Without a compiler, or with `INFIRE_JAX_NO_CPU_KERNELS=1`,
`available()` is False and the models keep XLA's ops (the pure-`jnp` path). The decode-step layer
matmul and the attention run on any CPU (`chosen()`); the kernels on 16-float register tiles (panels,
the LM head) only where it was built for AVX-512 (`wide_chosen()`). `cpu_onednn`'s call
(`csrc/onednn/`) is built the same way (`build`) into a library of its own, linked to oneDNN.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import jax

from pallas_kernels import placement

log = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
# FFI target name -> the library's handler symbol.
TARGETS = {"infire_skinny_matmul": "InfireSkinnyMatmul", "infire_skinny_matmul_nt": "InfireSkinnyMatmulNT",
           "infire_skinny_matmul_panels": "InfireSkinnyMatmulPanels", "infire_paged_attention": "InfirePagedAttention",
           "infire_paged_attention_local": "InfirePagedAttentionLocal",
           "infire_paged_attention_sinks": "InfirePagedAttentionSinks",
           "infire_palette_matmul": "InfirePaletteMatmul", "infire_q4_1_matmul": "InfireQ41Matmul",
           "infire_lora_sgmv": "InfireLoraSgmv"}


def _cache_dir() -> str:
    """`INFIRE_JAX_KERNEL_CACHE`, else the infire_jax cache's `cpu_kernels/`: a process given a fresh cache
    of its own (a cold-boot measurement, the tests' subprocesses) may still share the built library."""
    if os.environ.get("INFIRE_JAX_KERNEL_CACHE"):
        return os.environ["INFIRE_JAX_KERNEL_CACHE"]
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


def build(name: str, sources: list[str], flags: list[str], key_extra: str = "") -> str:
    """Compiles `sources` into the shared library `name` in the cache (once per sources, flags, jax
    version, CPU and `key_extra`) and returns its path."""
    key = hashlib.sha256()
    for path in sorted(sources):
        with open(path, "rb") as f:
            key.update(os.path.basename(path).encode() + b"\0" + f.read())
    for path in sorted(glob.glob(os.path.join(_CSRC, "*.h"))):  # the headers the sources share
        with open(path, "rb") as f:
            key.update(os.path.basename(path).encode() + b"\0" + f.read())
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    compile_flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", f"-I{jax.ffi.include_dir()}", f"-I{_CSRC}"]
    key.update(jax.__version__.encode() + host_cpu().encode() + " ".join(compile_flags + flags).encode()
               + key_extra.encode())
    path = os.path.join(_cache_dir(), f"{name}-{key.hexdigest()[:16]}.so")
    if not os.path.exists(path):
        os.makedirs(_cache_dir(), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
        os.close(fd)
        try:  # the flags (libraries to link) go after the sources
            subprocess.run([cxx, *compile_flags, *sources, *flags, "-o", tmp], check=True, capture_output=True,
                           text=True)
            os.replace(tmp, path)  # atomic: concurrent builders each write their own file
        except subprocess.CalledProcessError as e:
            os.unlink(tmp)
            raise RuntimeError(f"{cxx} failed on {', '.join(map(os.path.basename, sources))}: "
                               f"{e.stderr.strip()[-2000:]}") from e
    return path


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built library with every target registered (on CPU, unless turned off), or None."""
    if os.environ.get("INFIRE_JAX_NO_CPU_KERNELS"):
        return None
    try:
        lib = ctypes.cdll.LoadLibrary(build("infire_cpu_kernels", glob.glob(os.path.join(_CSRC, "*.cc")), []))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("CPU kernels unavailable, using XLA's ops: %s", e)
        return None
    return lib


def available() -> bool:
    """Whether the FFI calls are built and registered (on CPU, unless turned off)."""
    return library() is not None


def require() -> None:
    """Raises unless the FFI targets are registered (the calls' wrappers check before tracing one)."""
    if not available():
        raise RuntimeError("the CPU kernels are not available (no C++ compiler, a failed build, or "
                           "INFIRE_JAX_NO_CPU_KERNELS is set): check `cpu_kernels.available()` first")


def on_cpu() -> bool:
    """Whether a call traced now runs on the CPU with the kernels there."""
    return placement.platform() == "cpu" and available()


def chosen() -> bool:
    """Whether the models choose the layer matmul kernel (`cpu_matmul.skinny_matmul`, decode-sized
    steps) over XLA's dot for a call traced now: on the CPU, wherever the library is built. It reads
    each layer's weights in place, where a scan over the stacked weights copies every layer's slice
    each step; with AVX2 alone it still ran a decode step's products 2-7x faster than XLA's dot
    (docs/PERFORMANCE.md)."""
    return on_cpu()


def wide_chosen() -> bool:
    """Whether the models also choose the kernels built on 16-float register tiles (the panel
    matmuls, the LM head): on the CPU with the library built for AVX-512. Built for AVX2 the compiler
    moves those tiles through the stack, and they ran 2-16x slower than XLA's ops at 8 or more rows.
    The calls still run there where asked for directly, and `INFIRE_JAX_FORCE_CPU_KERNELS=1` has the
    models choose them on any CPU (to test them there)."""
    return on_cpu() and (avx512() or bool(os.environ.get("INFIRE_JAX_FORCE_CPU_KERNELS")))


def bf16_dot() -> bool:
    """Whether the library was built for a CPU with AVX512-BF16, so bfloat16 x bfloat16 products
    take `vdpbf16ps`."""
    lib = library()
    return lib is not None and bool(lib.InfireHasBf16Dot())


@functools.cache
def avx512() -> bool:
    """Whether the library was built for a CPU with AVX-512 (the GGUF Q4_1 matmul needs it)."""
    lib = library()
    return lib is not None and bool(lib.InfireHasAvx512())
