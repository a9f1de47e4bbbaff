"""How many KV pages the pool gets, and the arithmetic behind it (logged, and exported as metrics).

On a GPU the pool takes what is left of the card, as vLLM's `--gpu-memory-utilization` does:
device memory x utilization - the weights - the activation peak of the largest step, where the
peak is the compiled step's own temporary buffers (XLA's memory analysis), not a guess. The usable
part is also capped by XLA's allocator limit (`XLA_PYTHON_CLIENT_MEM_FRACTION` of the card; see
xla_flags.py). Elsewhere (CPU) there is no device memory figure, so the pool gets a fixed budget.

A pool sized so is allocated only after the warmup compiled the steps against its shapes: XLA's
autotuning on a GPU takes scratch memory while it compiles (1.97 GiB at once for the 8B model),
and a pool filling the allocator's share left it none (two workers sharing one card, each at 0.45
of it within an allocator share of 0.47, failed so).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from infire_jax.runner.device_memory import kv_bytes_per_page
from infire_jax.errors import ConfigError
from infire_jax.core.kv_groups import KVCapacity, KVGroupLayout
from infire_jax.models.config import ModelConfig
from infire_jax.models.kv_entry import kv_entry
from infire_jax.runner.xla_flags import allocator_fraction

_GIB = float(1 << 30)
# The pool's page count is rounded down to a multiple of this, so that small run-to-run differences
# in memory use keep the pool's shape, and with it the persistent compilation cache's hits.
PAGE_MULTIPLE = 64


@dataclasses.dataclass(frozen=True)
class PoolSizing:
    num_pages: int
    page_bytes: int  # one page on one device (its share of layers and kv heads)
    source: str  # "device memory", "kv_cache_memory" or "num_kv_pages"
    device_bytes: int = 0  # one device's memory, for "device memory"
    utilization: float = 0.0
    usable_bytes: int = 0  # min(utilization x device memory, XLA's allocator limit)
    weight_bytes: int = 0  # one device's share of the weights (hot standby: at least the room kept for them)
    activation_bytes: int = 0  # the largest step's temporaries on one device
    other_bytes: int = 0  # other buffers already in use (sampling history, the minimal pool measured with)
    capacity: KVCapacity | None = None  # the tokens of context it holds (PoolPlanner sets it)

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def describe(self) -> str:
        return self._describe_bytes() + ("" if self.capacity is None else "\n" + self.capacity.describe())

    def _describe_bytes(self) -> str:
        pool = f"{self.num_pages} pages x {self.page_bytes / 2**20:.2f} MiB = {self.pool_bytes / _GIB:.2f} GiB"
        if self.source != "device memory":
            return f"KV pool ({self.source}): {pool}"
        capped = " (XLA's allocator limit)" if self.usable_bytes < int(self.utilization * self.device_bytes) else ""
        return (f"KV pool: {self.utilization:.2f} x {self.device_bytes / _GIB:.2f} GiB device memory = "
                f"{self.usable_bytes / _GIB:.2f} GiB usable{capped}, - {self.weight_bytes / _GIB:.2f} GiB weights "
                f"- {self.activation_bytes / _GIB:.2f} GiB activations - {self.other_bytes / _GIB:.2f} GiB other buffers "
                f"-> {pool}")


def size_from_device_memory(*, device_bytes: int, allocator_limit: int, utilization: float, weight_bytes: int,
                            activation_bytes: int, other_bytes: int, page_bytes: int, min_pages: int) -> PoolSizing:
    """The pool that fills `utilization` of the device beside the weights and the activation peak."""
    if not 0.0 < utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    usable = min(int(device_bytes * utilization), allocator_limit)
    budget = usable - weight_bytes - activation_bytes - other_bytes
    num_pages = budget // page_bytes if budget > 0 else 0
    if num_pages >= 2 * PAGE_MULTIPLE:
        num_pages -= num_pages % PAGE_MULTIPLE
    if num_pages < min_pages:
        raise ConfigError(
            f"no room for the KV pool: {usable / _GIB:.2f} GiB usable ({utilization:.2f} x {device_bytes / _GIB:.2f} GiB "
            f"of device memory, within XLA's allocator limit of {allocator_limit / _GIB:.2f} GiB), "
            f"less {weight_bytes / _GIB:.2f} GiB of weights, {activation_bytes / _GIB:.2f} GiB of activations and "
            f"{other_bytes / _GIB:.2f} GiB of other buffers, "
            f"holds {max(num_pages, 0)} pages of {page_bytes} bytes, and one sequence of max_model_len needs "
            f"{min_pages}; raise gpu_memory_utilization, or lower max_model_len or max_num_batched_tokens")
    return PoolSizing(num_pages, page_bytes, "device memory", device_bytes, utilization, usable, weight_bytes,
                      activation_bytes, other_bytes)


def size_from_budget(budget_bytes: int, page_bytes: int, source: str) -> PoolSizing:
    return PoolSizing(max(2, budget_bytes // page_bytes), page_bytes, source)


def device_memory() -> tuple[int, int, int] | None:
    """(the card's memory, XLA's allocator limit, bytes in use) of the first local device, on GPU."""
    stats = jax.local_devices()[0].memory_stats() if jax.default_backend() == "gpu" else None
    if not stats or "bytes_limit" not in stats:
        return None
    limit = stats["bytes_limit"]
    return int(limit / allocator_fraction()), limit, stats.get("bytes_in_use", 0)


@dataclasses.dataclass(frozen=True)
class PoolPlanner:
    """The engine's pool settings, and the page one device pays for (its share of layers and kv heads,
    plus any speculative head's cache)."""

    page_bytes: int
    page_size: int
    max_model_len: int
    num_kv_pages: int | None
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    kv_groups: KVGroupLayout | None = None  # a hybrid cache's groups (None: one group, every page kept)
    step_tokens: int = 0  # the most tokens of one step (a bounded group's pages grow with it)
    devices: int = 1  # the devices the pool is placed on (they split the default budget)

    @staticmethod
    def page_bytes_of(cfg: ModelConfig, plan: Any, page_size: int, dtype, extra_bytes: int,
                      kv_groups: KVGroupLayout | None = None) -> int:
        """Bytes one page costs each device of `plan` (a ShardPlan or None): the pool is split over pp
        (layers) and tp (kv heads; an MLA latent is replicated over tp). A hybrid cache's page holds one
        group's layers."""
        cfg = plan.effective_config(cfg) if plan else cfg
        layers = None if kv_groups is None else kv_groups.page_layers
        per_page = kv_bytes_per_page(cfg, page_size, dtype, layers)
        if plan:
            split = plan.axis("kv_heads") and kv_entry(cfg).split_heads
            per_page //= plan.sizes["pp"] * (plan.sizes["tp"] if split else 1)
        return per_page + extra_bytes

    @property
    def min_pages(self) -> int:
        """One sequence of max_model_len (a hybrid cache: in every group, its bounded ones holding their
        chunk or window and a step), plus the null page."""
        if self.kv_groups is None:
            return -(-self.max_model_len // self.page_size) + 1
        return self.kv_groups.seq_blocks(self.max_model_len, self.page_size, self.step_tokens) + 1

    def _with_capacity(self, sizing: PoolSizing) -> PoolSizing:
        """The sizing with what it holds in tokens (KVCapacity)."""
        groups = self.kv_groups or KVGroupLayout.single(1)
        return dataclasses.replace(sizing, capacity=KVCapacity(groups, sizing.num_pages, self.page_size,
                                                               self.step_tokens))

    def fixed(self) -> PoolSizing | None:
        """The pool when it is given (pages or bytes) or no device memory figure exists; else None
        (it then fills the device: `from_device_memory`)."""
        if self.num_kv_pages:
            sizing = PoolSizing(self.num_kv_pages, self.page_bytes, "num_kv_pages")
        elif self.kv_cache_memory is not None:
            sizing = size_from_budget(self.kv_cache_memory, self.page_bytes, "kv_cache_memory")
        elif device_memory() is None:
            # No device memory figure (CPU): its devices are one host's memory, so the default 1 GiB is the
            # whole pool's, not each device's (8 virtual devices took 8 GiB for a 2-layer model).
            sizing = size_from_budget(int(_GIB) // self.devices, self.page_bytes,
                                      "default budget, no device memory figure")
        else:
            return None
        if sizing.num_pages < self.min_pages:
            raise ConfigError(f"the KV pool ({sizing.num_pages - 1} pages of {self.page_size}) cannot hold one "
                              f"sequence of max_model_len={self.max_model_len}")
        return self._with_capacity(sizing)

    def fitted(self) -> PoolPlanner:
        """max_model_len "auto": the planner with max_model_len cut to what one sequence can hold of a
        pool fixed in advance; as it is where the pool fills the device (sized only after the weights
        are on it: a longer context than fits is refused then, naming max_model_len)."""
        sizing = dataclasses.replace(self, max_model_len=1).fixed()
        tokens = None if sizing is None else sizing.capacity.context_tokens(1)
        if tokens is None or tokens >= self.max_model_len:
            return self
        return dataclasses.replace(self, max_model_len=tokens)

    def from_device_memory(self, weights: Any, minimal_pool: Any, activation_bytes: int,
                           reserved_weight_bytes: int = 0, later_weight_bytes: int = 0) -> PoolSizing:
        """Measured with the weights and a minimal pool on the devices (the pool is not counted as in
        use: resizing frees it). `later_weight_bytes`: weights placed after the pool (the vision tower),
        counted with them. The weights count at least `reserved_weight_bytes` (hot standby: room for a
        heavier model that may be on the device instead, engine/residency.py)."""
        total, limit, in_use = device_memory()
        device = jax.local_devices()[0]

        def on_device(tree) -> int:
            return sum(s.data.nbytes for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards
                       if s.device == device)

        weight_bytes, pool = on_device(weights), on_device(minimal_pool)
        other_bytes = max(0, in_use - weight_bytes - pool)
        return self._with_capacity(size_from_device_memory(
            device_bytes=total, allocator_limit=limit, utilization=self.gpu_memory_utilization,
            weight_bytes=max(weight_bytes + later_weight_bytes, reserved_weight_bytes),
            activation_bytes=activation_bytes, other_bytes=other_bytes, page_bytes=self.page_bytes,
            min_pages=self.min_pages))
