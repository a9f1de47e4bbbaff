"""The bfloat16 panel matmul through oneDNN, for CPUs with AMX.

On an AMX CPU (Sapphire Rapids and later: `amx_bf16`, `amx_tile`) oneDNN's brgemm kernels multiply on
the tile units, several times what the `vdpbf16ps` kernel (`cpu_matmul.panel_matmul`) or XLA's dot
reach on prefill and batched steps. The model runner's bfloat16 panels (`cpu_matmul.pack_panels`) are,
for K a multiple of 32, oneDNN's blocked weight format BA16a32b2a, so the call
(`csrc/onednn/panel_matmul.cc`) reads the stacked weights in place, as the hand-written kernels do.

The call is built against the oneDNN wheel (`onednn-cpu-gomp`, with its headers from
`onednn-devel-cpu-gomp`) into a library of its own beside `cpu_kernels`' one, so the other kernels
stand without it. It is chosen once, from the ISA oneDNN finds on this CPU: AMX, and only for steps
of at least MIN_ROWS tokens (batch-1 decode is bound by memory, where the hand-written kernel stays).
`INFIRE_JAX_FORCE_ONEDNN=1` chooses it on any x86 CPU (oneDNN then runs its AVX-512 kernels), to test
it where no AMX is; `INFIRE_JAX_NO_ONEDNN=1` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib.metadata
import logging
import os
import subprocess

import jax
import jax.numpy as jnp
from jaxtyping import Array, BFloat16, Float, Int

from pallas_kernels import cpu_kernels

log = logging.getLogger(__name__)

TARGET = "infire_onednn_panel_matmul"
# Steps with fewer tokens keep the `vdpbf16ps` kernel. Unmeasured on AMX (no AMX machine so far):
# oneDNN's tiles take 16 rows, and at 1 row the step is bound by reading the weights.
MIN_ROWS = 2
_SOURCES = os.path.join(os.path.dirname(__file__), "csrc", "onednn")
_LIB_DIST, _HEADERS_DIST = "onednn-cpu-gomp", "onednn-devel-cpu-gomp"


def _installed() -> tuple[str, str, str]:
    """(include dir, lib dir, version) of the installed oneDNN wheels; raises if they are missing."""
    def locate(dist: str, suffix: str) -> str:
        d = importlib.metadata.distribution(dist)
        for f in d.files or ():
            if str(f).endswith(suffix):
                return str(d.locate_file(f).resolve())[:-len(suffix)]
        raise FileNotFoundError(f"{dist} holds no {suffix}")

    version = importlib.metadata.version(_LIB_DIST)
    return locate(_HEADERS_DIST, "/oneapi/dnnl/dnnl.hpp"), locate(_LIB_DIST, "/libdnnl.so"), version


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built call, registered with jax, or None (no oneDNN wheel, or no CPU kernels: no compiler, or
    INFIRE_JAX_NO_CPU_KERNELS)."""
    if not cpu_kernels.available():
        return None
    try:
        include, lib_dir, version = _installed()
        path = cpu_kernels.build("infire_onednn", glob.glob(os.path.join(_SOURCES, "*.cc")),
                                 [f"-I{include}", f"-L{lib_dir}", "-ldnnl", f"-Wl,-rpath,{lib_dir}"],
                                 key_extra=f"onednn {version} {include}")
        lib = ctypes.cdll.LoadLibrary(path)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.InfireOnednnPanelMatmul), platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError, importlib.metadata.PackageNotFoundError) as e:
        log.info("oneDNN matmul unavailable, keeping the hand-written kernels: %s", e)
        return None
    return lib


@functools.cache
def amx() -> bool:
    """Whether oneDNN runs its AMX kernels on this CPU (it asks the kernel for the tile state)."""
    lib = library()
    return lib is not None and bool(lib.InfireOnednnAmx())


def isa() -> str:
    """The instruction set oneDNN dispatches to here (for the benchmarks' notes), or '' without it."""
    lib = library()
    if lib is None:
        return ""
    lib.InfireOnednnIsaName.restype = ctypes.c_char_p
    return lib.InfireOnednnIsaName().decode()


def chosen() -> bool:
    """Whether bfloat16 panel steps go to oneDNN here: on an AMX CPU, unless turned off; anywhere the
    call is built with `INFIRE_JAX_FORCE_ONEDNN=1`."""
    if os.environ.get("INFIRE_JAX_NO_ONEDNN"):
        return False
    return library() is not None if os.environ.get("INFIRE_JAX_FORCE_ONEDNN") else amx()


def takes(rows: int, panels: Array | jax.ShapeDtypeStruct) -> bool:
    """Whether `cpu_matmul.panel_matmul` hands a [rows, K] step on these panels to oneDNN (decided at
    trace time): bfloat16 panels with K a multiple of 32, at least MIN_ROWS rows, on the CPU, where
    `chosen()`."""
    return (panels.dtype == jnp.bfloat16 and panels.ndim == 4 and (2 * panels.shape[2]) % 32 == 0
            and rows >= MIN_ROWS and cpu_kernels.on_cpu() and chosen())


def panel_matmul(x: BFloat16[Array, "M K"], panels: BFloat16[Array, "L P K2 64"],
                 layer: Int[Array, ""]) -> Float[Array, "M N"]:
    """x @ w[layer] in float32 through oneDNN, reading the layer's bfloat16 panels in place."""
    if x.dtype != jnp.bfloat16 or panels.dtype != jnp.bfloat16:
        raise ValueError(f"the oneDNN panel matmul takes bfloat16 x and panels, got {x.dtype} and {panels.dtype}")
    if x.shape[1] != 2 * panels.shape[2] or x.shape[1] % 32:
        raise ValueError(f"x has {x.shape[1]} features; the panels hold {2 * panels.shape[2]} (a multiple of 32 "
                         f"for oneDNN's blocked format)")
    if library() is None:
        raise RuntimeError("the oneDNN matmul is not available (install onednn-cpu-gomp and onednn-devel-cpu-gomp, "
                           "and a C++ compiler): check `cpu_onednn.library()` first")
    out = jax.ShapeDtypeStruct((x.shape[0], 32 * panels.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x, panels, layer.astype(jnp.int32))
