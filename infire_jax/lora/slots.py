"""Which adapter holds which device slot (host bookkeeping, no jax).

Slots 1..max_loras hold adapters (slot 0 is the base model). A running request pins its adapter's
slot from admission until it finishes or is preempted; an unpinned slot keeps its adapter, so a
later request for it needs no copy, until another adapter needs the room: the least recently
used unpinned slot is taken. When every slot is pinned, a request for an adapter that has none
waits (the scheduler admits others meanwhile), so a step's rows are always all resident.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable


class SlotTable:
    def __init__(self, num_slots: int):
        self.owner: list[Hashable | None] = [None] * (num_slots + 1)  # index 0: the base model, never owned
        self.pins = [0] * (num_slots + 1)
        self._slot_of: dict[Hashable, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(1, num_slots + 1))  # LRU first

    def slot_of(self, key: Hashable) -> int | None:
        return self._slot_of.get(key)

    def acquire(self, key: Hashable) -> tuple[int, bool] | None:
        """Pins a slot holding `key`: (slot, whether the adapter must be copied into it), or None when
        every slot is pinned by other adapters."""
        slot = self._slot_of.get(key)
        if slot is not None:
            self._pin(slot)
            return slot, False
        if not self._idle:
            return None
        slot = next(iter(self._idle))  # empty slots were queued first, then the least recently used
        old = self.owner[slot]
        if old is not None:
            del self._slot_of[old]
        self.owner[slot], self._slot_of[key] = key, slot
        self._pin(slot)
        return slot, True

    def _pin(self, slot: int) -> None:
        self.pins[slot] += 1
        self._idle.pop(slot, None)

    def release(self, slot: int) -> None:
        """Unpins once; an unpinned slot keeps its adapter until the room is needed."""
        if self.pins[slot] <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        self.pins[slot] -= 1
        if self.pins[slot] == 0:
            self._idle[slot] = None  # most recently used: taken last

    def evict(self, key: Hashable) -> None:
        """Forgets `key`'s slot (an unloaded adapter); only once nothing pins it."""
        slot = self._slot_of.get(key)
        if slot is None:
            return
        if self.pins[slot]:
            raise RuntimeError(f"LoRA slot {slot} is still pinned")
        del self._slot_of[key]
        self.owner[slot] = None
        self._idle.pop(slot, None)
        self._idle[slot] = None
        self._idle.move_to_end(slot, last=False)  # empty: taken first

    def clear(self) -> None:
        """Every slot empty (the device's copies are gone: the model left the device); none may be pinned."""
        if any(self.pins):
            raise RuntimeError("LoRA slots are pinned by running requests")
        for key in list(self._slot_of):
            self.evict(key)

    @property
    def num_pinned(self) -> int:
        return sum(1 for p in self.pins if p)
