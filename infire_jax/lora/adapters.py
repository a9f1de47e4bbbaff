"""An engine's LoRA adapters: the registry by name, the host copies (LRU, `max_cpu_loras`), paging
into the device slots as requests are admitted (the scheduler's admission gate), and the salt that
keeps their KV apart in the prefix cache.

Everything here runs on the engine's thread. A request is bound to its adapter when it is added
(its host copy is made then, read from disk if it was evicted, so admission never touches the
disk); admission pins a device slot (slots.py), copying the adapter in when it has none, with one
compiled program of fixed shapes: adding, removing or swapping adapters compiles nothing.

Unloading, as vLLM does it: the name is gone at once (new requests naming it are refused), while
requests already added with it run to the end on it; its host copy and device slot are freed when
the last of them finishes.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import jax
import numpy as np

from infire_jax.errors import InvalidRequestError
from infire_jax.lora.config import LoRAConfig
from infire_jax.lora.layout import slot_arrays, stack_layout
from infire_jax.lora.peft import AdapterNotFoundError, PeftAdapter, read_adapter
from infire_jax.lora.request import LoRARequest
from infire_jax.lora.slots import SlotTable
from infire_jax.models.config import ModelConfig


@dataclasses.dataclass(eq=False)
class Adapter:
    """A loaded adapter: how it was asked for, what it computes (`digest`), and its unfinished requests."""

    request: LoRARequest
    digest: str
    rank: int
    users: int = 0
    registered: bool = True  # False once unloaded: freed when its last user finishes

    @property
    def name(self) -> str:
        return self.request.lora_name


def cache_salt(tenant: str | None, adapter: Adapter | None) -> str | None:
    """The prefix cache's salt for a tenant's request with an adapter: its pages are never shared
    with the base model's, another adapter's or another tenant's (kv_cache.block_hash). The digest
    names what the adapter computes, so a name loaded again with other weights shares nothing."""
    if adapter is None:
        return tenant
    return f"\0lora\0{adapter.digest}" + ("" if tenant is None else f"\1{tenant}")


def _put(stacks: dict, slot, arrays: dict) -> dict:
    return {k: v.at[:, slot].set(arrays[k]) for k, v in stacks.items()}


class Adapters:
    def __init__(self, lc: LoRAConfig, model_config: ModelConfig, runner, *, dtype):
        """`runner` holds the stacks in its cache (`DeviceCache.lora`); `model_config` is the checkpoint's."""
        self.config = lc
        self.model_config = model_config
        self._runner = runner
        self._dtype = dtype
        self.by_name: dict[str, Adapter] = {}
        self._host: OrderedDict[Adapter, dict[str, np.ndarray]] = OrderedDict()  # least recently used first
        self.slots = SlotTable(lc.max_loras)
        plan = runner.plan
        stacks = runner.cache.lora
        one = {k: jax.ShapeDtypeStruct((shape[0], *shape[2:]), dtype,
                                       sharding=plan.sharding((axes[0], *axes[2:])) if plan else None)
               for k, (shape, axes) in stack_layout(runner.cfg, lc).items()}
        shardings = jax.tree.map(lambda a: a.sharding, stacks) if plan else None
        self._upload = jax.jit(_put, donate_argnums=(0,), out_shardings=shardings).lower(
            jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding if plan else None),
                         stacks), jax.ShapeDtypeStruct((), np.int32), one).compile()

    # ---- the registry --------------------------------------------------------------------------
    def read(self, request: LoRARequest) -> PeftAdapter:
        """Reads and checks an adapter's files (host only: any thread may call it)."""
        return self.read_path(request.lora_path)

    def read_path(self, path: str) -> PeftAdapter:
        return read_adapter(path, self.model_config, self.config.max_lora_rank)

    def free_id(self) -> int:
        """An id no registered adapter has (the largest one's next)."""
        return max((e.request.lora_int_id for e in self.by_name.values()), default=0) + 1

    def register(self, request: LoRARequest, adapter: PeftAdapter | None = None) -> Adapter:
        """Adds an adapter under its name (read from its path unless `adapter` is given). The same
        name and path again is a no-op (the known adapter, whatever id was asked); a name or id already
        used otherwise is refused."""
        known = self.by_name.get(request.lora_name)
        if known is not None:
            if known.request.lora_path == request.lora_path:
                return known
            raise InvalidRequestError(f"the LoRA adapter {request.lora_name!r} has already been loaded "
                                      f"(id {known.request.lora_int_id}, {known.request.lora_path})", param="lora_name")
        for other in self.by_name.values():
            if other.request.lora_int_id == request.lora_int_id:
                raise InvalidRequestError(f"LoRA id {request.lora_int_id} is already used by {other.name!r}",
                                          param="lora_int_id")
        adapter = adapter or self.read(request)
        entry = Adapter(request, adapter.digest, adapter.rank)
        self._keep(entry, adapter)
        self.by_name[request.lora_name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Unloads `name` (see the module docstring); AdapterNotFoundError if it is not loaded."""
        entry = self.by_name.pop(name, None)
        if entry is None:
            raise AdapterNotFoundError(f"the LoRA adapter {name!r} cannot be found", param="lora_name")
        entry.registered = False
        if entry.users == 0:
            self._free(entry)

    def resolve(self, lora: LoRARequest | str | Adapter) -> Adapter:
        """The adapter a request names: a loaded name, a LoRARequest (registered on first use), or an
        adapter held (`hold`) across several requests, unloaded since or not."""
        if isinstance(lora, Adapter):
            return lora
        if isinstance(lora, str):
            entry = self.by_name.get(lora)
            if entry is None:
                raise AdapterNotFoundError(f"the LoRA adapter {lora!r} is not loaded", param="model")
            return entry
        return self.register(lora)

    # ---- requests ------------------------------------------------------------------------------
    def add_user(self, entry: Adapter) -> None:
        """A request runs with `entry`: its host copy is kept (read again if it was evicted) until
        the request finishes."""
        if entry not in self._host:
            adapter = self.read(entry.request)
            if adapter.digest != entry.digest:
                raise InvalidRequestError(f"the files of LoRA adapter {entry.name!r} changed since it was loaded; "
                                          f"unload it and load it again", param="model")
            self._host[entry] = self._slot_arrays(adapter)
        self._host.move_to_end(entry)
        entry.users += 1
        self._trim()

    def hold(self, lora: LoRARequest | str) -> Adapter:
        """The adapter `lora` names, kept for a run of requests (a beam search's steps) until `let_go`:
        unloading it meanwhile drops its name only, as for a running request."""
        entry = self.resolve(lora)
        self.add_user(entry)
        return entry

    def let_go(self, entry: Adapter) -> None:
        entry.users -= 1
        if entry.users == 0 and not entry.registered:
            self._free(entry)
        self._trim()

    def acquire(self, req) -> bool:
        """The scheduler's admission gate: pins a device slot for the request's adapter, copying it
        in if needed (`req.lora_slot`); False when every slot is pinned by other adapters."""
        entry = req.lora
        if entry is None:
            return True
        got = self.slots.acquire(entry)
        if got is None:
            return False
        slot, copy = got
        if copy:
            runner = self._runner
            stacks = self._upload(runner.cache.lora, np.int32(slot), self._host[entry])
            runner.cache = runner.cache._replace(lora=stacks)
        req.lora_slot = slot
        return True

    def release(self, req, finished: bool) -> None:
        """Unpins the request's slot (preempted or finished); a finished request stops using its adapter."""
        if req.lora_slot:
            self.slots.release(req.lora_slot)
            req.lora_slot = 0
        if finished and req.lora is not None:
            self.let_go(req.lora)

    def drop_device(self) -> None:
        """The device's copies are gone (the model left the device): every slot is empty."""
        self.slots.clear()

    # ---- host copies ---------------------------------------------------------------------------
    def _slot_arrays(self, adapter: PeftAdapter) -> dict[str, np.ndarray]:
        return slot_arrays(adapter, self.model_config, self.config, self._dtype, self._runner.plan)

    def _keep(self, entry: Adapter, adapter: PeftAdapter) -> None:
        self._host[entry] = self._slot_arrays(adapter)
        self._trim()

    def _trim(self) -> None:
        """Evicts the least recently used host copies past max_cpu_loras, of adapters no request uses."""
        extra = len(self._host) - self.config.cpu_loras
        for entry in [e for e in self._host if e.users == 0][:max(0, extra)]:
            del self._host[entry]

    def _free(self, entry: Adapter) -> None:
        self.slots.evict(entry)
        self._host.pop(entry, None)


def resolve_lora(adapters: Adapters | None, lora: LoRARequest | str | Adapter | None) -> Adapter | None:
    """The adapter a request asks for (None: the base model); refused when the engine has no LoRA."""
    if lora is None:
        return None
    if adapters is None:
        raise InvalidRequestError("this engine serves no LoRA adapters (start it with enable_lora / --enable-lora)",
                                  param="lora_request")
    return adapters.resolve(lora)


def lora_digest(adapters: Adapters | None, name: str | None) -> str | None:
    """What the named adapter computes (None: the base model), for a KV transfer's check that both
    workers ran the same adapter."""
    return None if name is None else resolve_lora(adapters, name).digest
