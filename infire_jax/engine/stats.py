"""What an engine reports about itself: where its start-up went, and its running counters."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable


def timed(fn: Callable, *args) -> float:
    start = time.monotonic()
    fn(*args)
    return time.monotonic() - start


@dataclasses.dataclass(frozen=True)
class BootTimeline:
    """Where an engine's start-up went: the weights (restored from the checkpoint or built from the
    source) and the warmup of every step (XLA compilations, executables deserialized from the executable
    cache, or executables from XLA's persistent cache)."""

    weight_bytes: int  # placed on the devices, all shards
    load_seconds: float
    restored: bool
    compile_seconds: float
    num_steps: int  # token buckets warmed up
    compiled: int  # XLA compilations during warmup (the cache loads below not counted)
    executables_loaded: int  # step programs deserialized from the executable cache (nothing traced)
    cache_loaded: int  # executables loaded from XLA's persistent cache during warmup
    overlapped: bool  # the warmup ran while the weights were read
    ready_seconds: float  # the engine's construction, from its first compile or read to ready

    def describe(self) -> str:
        source = "restored from its checkpoint" if self.restored else "loaded from the source"
        return (f"boot: weights {self.weight_bytes / 1e9:.3f} GB {source} in {self.load_seconds:.2f} s "
                f"({self.weight_bytes / 1e9 / max(self.load_seconds, 1e-9):.2f} GB/s); warmup of {self.num_steps} "
                f"steps in {self.compile_seconds:.2f} s ({self.compiled} programs compiled, "
                f"{self.executables_loaded} loaded from the executable cache, {self.cache_loaded} from XLA's cache"
                f"{', while the weights were read' if self.overlapped else ''}); "
                f"engine ready in {self.ready_seconds:.2f} s")


@dataclasses.dataclass
class EngineStats:
    steps: int = 0
    step_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    step_seconds: float = 0.0  # wall time inside step()
    device_wait_seconds: float = 0.0  # of which blocked on the device's results; the rest is host work
    images_encoded: int = 0  # images through the vision tower (engine/images.py: none whose tokens were cached)

    @property
    def host_seconds(self) -> float:
        return self.step_seconds - self.device_wait_seconds
