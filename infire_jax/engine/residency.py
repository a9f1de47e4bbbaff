"""Hot standby: several models in one process, at most `max_resident` of them on the device.

Every model has its own engine (weights, KV pool, compiled steps) and its own engine thread
(async_engine.py). Before each step a thread acquires residency for its model. A model off the
device is promoted: its weights are copied back and it gets an empty KV pool; to make room, the
least recently used resident model with no work is demoted (weights to host memory, KV pool and
prefix cache dropped). When every resident model is busy, the least recently used one drains: it
admits nothing new until its running requests finish, so a waiting model gets the device after
one drain and no request fails. The compiled steps stay cached in the process, and the weights
come back on the same shardings, so a swap compiles nothing.

Memory (GPU): the models that may be on the device together must fit in `gpu_memory_utilization`
of it, whichever they are. Each model's KV pool is sized within 1/R of that budget (R: the models
resident at once), counting as its weights the mean of the R heaviest models' weights (or its own,
if heavier), so any R of them fit beside each other. With R = 1 every pool leaves room for the
heaviest model's weights: a 1B model standing by for an 8B one gets a pool no larger than the
8B's, and fits in the space the 8B leaves. (Sized as if alone, as before, the 1B's pool took
the whole budget less its 2.5 GB, 68.5 GiB on an 80 GB H100: its 34.25 GiB halves did not fit in
what the 8B left.) A promotion that still runs out of memory raises DeviceMemoryError, and the
model stays off the device.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import OrderedDict
from typing import Callable

import jax
import numpy as np

from infire_jax.engine.engine import Engine
from infire_jax.engine.setup import EngineConfig, resolve_dtype
from infire_jax.errors import ConfigError, DeviceMemoryError
from infire_jax.loaders.load import load_config
from infire_jax.models.registry import abstract_state
from sharding.mesh import load_mesh_config
from sharding.plan import ShardPlan

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SwapStats:
    """A model's promotions: how many, their wall time (the demotion that made room included) and
    the weight bytes copied to the device."""

    promotions: int = 0
    seconds: float = 0.0
    bytes: int = 0


class Residency:
    """Which models are on the device. Thread-safe; called from the engine threads."""

    def __init__(self, engines: dict[str, Engine], max_resident: int):
        if max_resident < 1:
            raise ConfigError(f"max_resident must be >= 1, got {max_resident}")
        self.engines = engines
        self.max_resident = max_resident
        self.stats = {name: SwapStats() for name in engines}
        self._cond = threading.Condition()
        self._lru: OrderedDict[str, None] = OrderedDict((n, None) for n, e in engines.items() if e.resident)
        self._arriving: set[str] = set()  # being promoted (counts as resident)
        self._busy: set[str] = set()  # resident models whose threads have work
        self._waiting: set[str] = set()  # models whose threads wait for the device
        if len(self._lru) > max_resident:
            raise ConfigError(f"{len(self._lru)} models are on the device, more than max_resident={max_resident}")

    def is_resident(self, name: str) -> bool:
        return name in self._lru

    def should_drain(self, name: str) -> bool:
        """Whether `name` must stop admitting requests so that a waiting model gets the device."""
        with self._cond:
            if not self._waiting or name not in self._lru or self._free_slots() > 0:
                return False
            if any(n not in self._busy for n in self._lru):
                return False  # an idle model will make room
            return next(iter(self._lru)) == name

    def acquire(self, name: str, timeout: float) -> bool:
        """Makes `name` resident and marks it busy; False if that did not happen within `timeout`
        seconds (the caller then serves its commands and asks again)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while name not in self._lru:
                self._waiting.add(name)
                victim = self._room()
                if victim is not False:
                    try:
                        self._swap(name, victim)
                    except BaseException:
                        self._waiting.discard(name)  # no resident model should drain for it
                        self._cond.notify_all()
                        raise
                    continue
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    return False
            self._waiting.discard(name)
            self._lru.move_to_end(name)
            self._busy.add(name)
            return True

    def release(self, name: str) -> None:
        """The model's thread has no work left: the model may be demoted."""
        with self._cond:
            self._busy.discard(name)
            self._waiting.discard(name)
            self._cond.notify_all()

    # ---- under the lock ----------------------------------------------------------------------------
    def _free_slots(self) -> int:
        return self.max_resident - len(self._lru) - len(self._arriving)

    def _room(self) -> str | None | bool:
        """None: a slot is free; a name: demote that idle model; False: wait."""
        if self._free_slots() > 0:
            return None
        return next((n for n in self._lru if n not in self._busy), False)

    def _swap(self, name: str, victim: str | None) -> None:
        """Demotes `victim` and promotes `name` with the lock released, so other models keep stepping."""
        if victim is not None:
            del self._lru[victim]
        self._arriving.add(name)
        self._cond.release()
        try:
            start = time.perf_counter()
            if victim is not None:
                self.engines[victim].demote()
            nbytes = promote(self.engines[name], name, f" ({victim} demoted)" if victim else "")
            seconds = time.perf_counter() - start
            log.info("model %s on the device in %.3f s (%d bytes)%s", name, seconds, nbytes,
                     f", {victim} demoted" if victim else "")
        finally:
            self._cond.acquire()
            self._arriving.discard(name)
        s = self.stats[name]
        s.promotions, s.seconds, s.bytes = s.promotions + 1, s.seconds + seconds, s.bytes + nbytes
        self._lru[name] = None
        self._cond.notify_all()


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` is XLA running out of device memory."""
    return isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e)


def promote(engine: Engine, name: str, context: str = "") -> int:
    """`engine.promote()`, with running out of device memory as a DeviceMemoryError that names the model."""
    try:
        return engine.promote()
    except jax.errors.JaxRuntimeError as e:
        if not out_of_memory(e):
            raise
        raise DeviceMemoryError(f"model {name} does not fit on the device{context}: {e}") from e


def weight_bytes_bound(config: EngineConfig) -> int:
    """One device's bytes of the model's weights uncompressed in the engine's dtype, from the config
    alone: what the weights take at most (compressed or quantized ones take less)."""
    cfg = load_config(config.model)
    mesh = load_mesh_config(config.mesh, jax.device_count())
    plan = ShardPlan.create(cfg, mesh) if mesh.num_devices > 1 else None
    _, state = abstract_state(cfg, resolve_dtype(config.dtype), plan)
    return sum(math.prod(a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape)
               * a.dtype.itemsize for a in jax.tree.leaves(state))


def pool_weight_bytes(bounds: list[int], max_resident: int) -> int:
    """The weights each model's pool leaves room for: the mean of the `max_resident` heaviest
    (residency.py's docstring). Then any `max_resident` models fit in the budget together."""
    resident = min(max_resident, len(bounds))
    return sum(sorted(bounds, reverse=True)[:resident]) // resident


def start_engines(models: list[tuple[str | None, EngineConfig]], max_resident: int,
                  make: Callable[[EngineConfig], Engine] = Engine) -> tuple[dict[str, Engine], Residency]:
    """Builds every model's engine (load, place, compile) one at a time, then keeps the first
    `max_resident` on the device and the rest in host memory. Models are (served name, settings);
    a None name means the model's own.

    On a GPU each model's KV pool is sized within 1/max_resident of the card's budget
    (`gpu_memory_utilization`); when models swap, each pool also leaves room for the heaviest
    models' weights (the module docstring). Each is built alone on the device (the others demoted
    meanwhile), so its sizing sees only itself. Running out of device memory raises DeviceMemoryError.
    """
    if max_resident < 1:
        raise ConfigError(f"max_resident must be >= 1, got {max_resident}")
    share = 1.0 / min(max_resident, len(models))
    reserve = pool_weight_bytes([weight_bytes_bound(c) for _, c in models], max_resident) \
        if len(models) > max_resident else 0
    engines: dict[str, Engine] = {}
    for name, config in models:
        for other in engines.values():
            if other.resident:
                other.demote()
        label = name or config.model or "default"
        try:
            engine = make(dataclasses.replace(config, gpu_memory_utilization=config.gpu_memory_utilization * share,
                                              pool_weight_bytes=max(config.pool_weight_bytes, reserve)))
        except ConfigError as e:
            raise ConfigError(f"model {label}: {e}") from e
        except jax.errors.JaxRuntimeError as e:
            if not out_of_memory(e):
                raise
            raise DeviceMemoryError(f"model {label} does not fit on the device: {e}") from e
        name = name or engine.model_name
        if name in engines:
            raise ConfigError(f"two models would be served as {name!r}; give each its own --served-model-name")
        engines[name] = engine
    ordered = list(engines.items())
    if len(ordered) > max_resident:
        ordered[-1][1].demote()
    for name, engine in ordered[:max_resident]:
        if not engine.resident:
            promote(engine, name)
    return engines, Residency(engines, max_resident)


def host_to_device_bandwidth(nbytes: int = 64 << 20, repeats: int = 3) -> float:
    """Bytes per second of a host-to-device copy of `nbytes` (the best of `repeats`), the floor of a swap."""
    host = np.ones(nbytes // 4, np.float32)
    device = jax.local_devices()[0]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(jax.device_put(host, device)).delete()
        best = min(best, time.perf_counter() - start)
    return nbytes / best
