"""The platform a call traced now will run on, which picks its kernels (Pallas on a GPU, the FFI
calls on a CPU): the compile target where one is set (`compiling_for`: a GPU's programs built on a
machine without one, bench/gpu_compile.py), else `jax.default_device`'s where one is set, so a
CPU-pinned call on a GPU machine takes the CPU kernels, else the default backend's."""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax

_target: str | None = None  # set by `compiling_for`; process-wide, since compiles run on worker threads
_target_devices: list | None = None


def platform() -> str:
    """"cpu", "gpu" or "tpu", as `jax.default_backend()` names them."""
    if _target is not None:
        return _target
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    return jax.devices(device)[0].platform if isinstance(device, str) else device.platform


def devices() -> list:
    """The devices an engine built now places its model on: the target's (`compiling_for`), else jax's."""
    return list(_target_devices) if _target_devices is not None else jax.devices()


@contextlib.contextmanager
def compiling_for(target: str, target_devices: list | None = None) -> Iterator[None]:
    """Everything traced inside chooses kernels and defaults for `target` ("gpu"), whatever this
    machine runs on, and an engine built inside places its model on `target_devices` (a topology's,
    which compile but never run): for compiling another machine's programs."""
    global _target, _target_devices
    previous = _target, _target_devices
    _target, _target_devices = target, target_devices
    try:
        yield
    finally:
        _target, _target_devices = previous
