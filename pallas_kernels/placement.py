"""The platform a call traced now will run on, which picks its kernels (Pallas on a GPU, the FFI
calls on a CPU): `jax.default_device`'s where one is set, so a CPU-pinned call on a GPU machine
takes the CPU kernels, else the default backend's."""

from __future__ import annotations

import jax


def platform() -> str:
    """"cpu", "gpu" or "tpu", as `jax.default_backend()` names them."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.default_backend()
    return jax.devices(device)[0].platform if isinstance(device, str) else device.platform
