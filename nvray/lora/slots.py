"""LoRASlots (driver): which adapter each of the ranks' ``max_loras`` GPU slots holds.

The scheduler asks ``can_admit(adapter)`` before it admits a waiting sequence and calls
``acquire(seq)`` when it does (``seq.lora_slot`` set; the adapter's slot, or a free one, or the
least recently used slot that no running sequence uses, whose adapter is then loaded over:
``take_loads()`` hands the step the (slot, adapter) pairs to load first); a sequence that stops
running (finished, preempted) calls ``release(seq)``. A slot is reloaded only when no running
sequence uses it, and a step in flight still reads the old adapter: the ranks run the load
after it, in stream order. ``num_loads`` counts the loads (swaps) since start. ``reset()``
(the engine failed its requests) forgets what the slots hold.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from nvray.lora.adapter import LoRAAdapter


class LoRASlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.holds: list[LoRAAdapter | None] = [None] * num_slots
        self.slot_of: dict[tuple[str, str, int], int] = {}
        self.users = [0] * num_slots
        self.idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))
        self.loads: list[tuple[int, LoRAAdapter]] = []
        self.num_loads = 0

    def can_admit(self, adapter: LoRAAdapter) -> bool:
        return adapter.key in self.slot_of or bool(self.idle)

    def is_resident(self, adapter: LoRAAdapter) -> bool:
        """Whether a slot holds ``adapter`` (admitting a sequence of it loads nothing)."""
        return adapter.key in self.slot_of

    def acquire(self, seq: Any) -> None:
        adapter: LoRAAdapter = seq.lora
        slot = self.slot_of.get(adapter.key)
        if slot is None:
            slot, _ = self.idle.popitem(last=False)  # least recently used
            old = self.holds[slot]
            if old is not None:
                del self.slot_of[old.key]
            self.holds[slot] = adapter
            self.slot_of[adapter.key] = slot
            self.loads.append((slot, adapter))
            self.num_loads += 1
        elif self.users[slot] == 0:
            del self.idle[slot]
        self.users[slot] += 1
        seq.lora_slot = slot

    def release(self, seq: Any) -> None:
        slot = seq.lora_slot
        if slot < 0:
            return
        seq.lora_slot = -1
        self.users[slot] -= 1
        if self.users[slot] == 0:
            self.idle[slot] = None  # most recently used

    def reset(self) -> None:
        """Forget what every slot holds (a failed step may have left a load half done): each
        adapter is loaded again on its next use. Call with no sequence running."""
        loads = self.num_loads
        self.__init__(self.num_slots)  # type: ignore[misc]
        self.num_loads = loads

    def take_loads(self) -> list[tuple[int, LoRAAdapter]]:
        loads, self.loads = self.loads, []
        return loads

    def resident(self) -> list[str]:
        return [a.name for a in self.holds if a is not None]
