"""Kernels and programs compiled for an H100 (sm_90a) on this CPU machine, for the tests that check
the GPU path without a GPU: the CUDA plugin's compiler and ptxas (the dev extra) turn the Triton IR
that lowering emits into machine code, so a block shape or shared-memory use the card refuses fails
here, as it would on the GPU (bench/gpu_target.py). On a GPU machine they compile for its own GPU."""

from __future__ import annotations

import glob
import importlib.metadata
import os
import re
import tempfile

import jax
import pytest


def jaxlib_version() -> tuple[int, ...]:
    return tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:3])


# jaxlib <= 0.10.2 emits a kernel's Triton IR without compiling it, so CUDA lowering runs on CPU; later
# jaxlibs compile it while lowering, which needs a GPU. The dev extra pins 0.10.2: CI runs these.
LOWERS_TRITON_HERE = jax.default_backend() == "gpu" or jaxlib_version() <= (0, 10, 2)
lowers_triton_here = pytest.mark.skipif(
    not LOWERS_TRITON_HERE,
    reason="this jaxlib compiles Triton kernels while lowering, which needs a GPU (the dev extra pins jaxlib "
           "0.10.2, which does not)")

_KERNEL = re.compile(r"^\s*\d+: kCustomKernel\s+\[[^\]]*\]\s+(\S+) grid:", re.M)


def gpu_lowered(jitted, *args) -> jax.stages.Lowered:
    """`jitted` on `args` (arrays or shapes) lowered for one H100 (on a GPU machine, for its own GPU):
    its `as_text()` is the StableHLO a GPU compiles, and `compiled_kernels` compiles it without
    lowering it again."""
    from infire_jax.bench import gpu_target

    on_gpu = jax.default_backend() == "gpu"
    device = gpu_target.devices(gpu_target.here() if on_gpu else gpu_target.target("h100"), here=on_gpu)[0]
    return jitted.lower(*gpu_target.on_device(args, device))


def compiled_kernels(jitted, *args) -> list[str]:
    """The kernels (by name, in launch order) of `jitted` on `args` (arrays or shapes) compiled for one
    H100 (on a GPU machine, for its own GPU); `jitted` may be `gpu_lowered`'s result (no `args`)."""
    lowered = jitted if isinstance(jitted, jax.stages.Lowered) else gpu_lowered(jitted, *args)
    with tempfile.TemporaryDirectory() as dump:
        lowered.compile(compiler_options={"xla_dump_to": dump})
        sequence = max(glob.glob(f"{dump}/*.thunk_sequence.txt"), key=os.path.getsize)  # the program, not a helper
        with open(sequence) as f:
            return _KERNEL.findall(f.read())


def launches(kernels: list[str], name: str) -> bool:
    """Whether `name` (a pallas_call's name) is among the compiled kernels (XLA may suffix `__N`)."""
    return any(k == name or k.startswith(f"{name}__") for k in kernels)
