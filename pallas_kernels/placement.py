"""The platform a call traced now will run on, which picks its kernels (Pallas on a GPU, the FFI
calls on a CPU): the compile target where one is set (`compiling_for`: a GPU's programs built on a
machine without one, bench/gpu_compile.py), else `jax.default_device`'s where one is set, so a
CPU-pinned call on a GPU machine takes the CPU kernels, else the default backend's."""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax

_target: str | None = None  # set by `compiling_for`; process-wide, since compiles run on worker threads


def platform() -> str:
    """"cpu", "gpu" or "tpu", as `jax.default_backend()` names them."""
    if _target is not None:
        return _target
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    return jax.devices(device)[0].platform if isinstance(device, str) else device.platform


@contextlib.contextmanager
def compiling_for(target: str) -> Iterator[None]:
    """Everything traced inside chooses kernels and defaults for `target` ("gpu"), whatever this
    machine runs on: for compiling another machine's programs (they are lowered for its devices)."""
    global _target
    previous, _target = _target, target
    try:
        yield
    finally:
        _target = previous
