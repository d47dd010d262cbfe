"""Small variables updated as one: a shard lays the small variables of one dtype end to end in
one array, and their optimizer state likewise, so that a push carrying all of them is one
overflow screen and one update instead of one per variable.

A step's update rule costs the same fixed price per array, whatever its size: for the 15K
parameter MLP (six arrays of 0.04-40 KiB) a push's checks and update took the shard 213 us one
array at a time and 108 us as one group (thread CPU, 2 shards x 2 workers); the cluster's
throughput went from 137K to 146K samples/s in psbench. Every rule is elementwise, so an update
of the concatenation is, bit for bit, the updates of its pieces.

Each slot keeps holding its own variable and state (views into the group's arrays), its own
``step`` and its own version: checkpoints, pulls and exports see what they saw before. The
group is used only for a push of every member whose steps agree (a push that leaves one out,
possible when a parameter has no gradient, updates its members one by one, as before).
A pull that holds a member's value makes the next update copy the whole group first (copy on
write, as for one variable).

Caller holds the store's lock for everything here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pswire.dtypes import dtype_of
from pswire.errors import InvalidArgumentError
from psserver.state import Slot

__all__ = ["GROUP_PART_BYTES", "SlotGroup", "group_slots"]

GROUP_PART_BYTES = 256 << 10
"""Variables of at most this many bytes are grouped (as ``pswire.placement.PACK_BELOW`` packs
small models whole onto one shard); larger ones are updated alone, where the fixed price per
array is lost in the arithmetic."""


class SlotGroup:
    """The slots of one floating-point dtype that live in shared arrays, in their order."""

    def __init__(self, slots: Sequence[Slot]) -> None:
        self.slots = list(slots)
        self.keys = frozenset(slot.part.key for slot in self.slots)
        dtype = self.slots[0].value.dtype
        spans, start = [], 0
        for slot in self.slots:
            spans.append((start, start + slot.value.size))
            start += slot.value.size
        self.spans = spans
        self.value = np.empty(start, dtype)
        self.state = {name: np.empty(start, dtype) for name in self.slots[0].state if name != "step"}
        self.grad = np.empty(start, dtype)
        """Scratch for a push's gradients, gathered in the members' order."""
        for slot, (begin, end) in zip(self.slots, spans):
            self.value[begin:end] = slot.value.reshape(-1)
            for name, buffer in self.state.items():
                buffer[begin:end] = slot.state[name].reshape(-1)
                slot.state[name] = buffer[begin:end].reshape(slot.value.shape)
            slot.group = self
        self._bind()

    def _bind(self) -> None:
        for slot, (begin, end) in zip(self.slots, self.spans):
            slot.value, slot.readers = self.value[begin:end].reshape(slot.part.shape), 0

    def writable(self) -> np.ndarray:
        """The group's array once no pull holds a member's value: a copy of the whole group
        then, every member's value a view of it."""
        if any(slot.readers for slot in self.slots):
            self.value = self.value.copy()
            self._bind()
        return self.value

    def covers(self, grads: Mapping[str, np.ndarray]) -> bool:
        """Whether a push with these gradients (by part key) updates the group whole: it
        carries every member, and the members' steps agree."""
        if not self.keys <= grads.keys():
            return False
        step = int(self.slots[0].state["step"])
        return all(int(slot.state["step"]) == step for slot in self.slots)

    def gather(self, grads: Mapping[str, np.ndarray]) -> np.ndarray:
        """The members' gradients end to end, in :attr:`grad` (reused push after push)."""
        for slot, (begin, end) in zip(self.slots, self.spans):
            self.grad[begin:end] = grads[slot.part.key].reshape(-1)
        return self.grad

    def step_state(self) -> dict[str, np.ndarray]:
        """The group's state for one update: its buffers and a copy of the members' step."""
        return {"step": self.slots[0].state["step"].copy(), **self.state}

    def set_step(self, state: Mapping[str, np.ndarray], bound: float | None) -> None:
        """After an update of the whole group: every member's step and magnitude bound."""
        for slot in self.slots:
            slot.state["step"][...] = state["step"]
            slot.largest = bound

    def known_largest(self) -> float | None:
        """A bound on every member's magnitudes, when each member's is known."""
        bounds = [slot.largest for slot in self.slots]
        return None if None in bounds else max(bounds)


def group_slots(slots: Mapping[str, Slot]) -> None:
    """Group the small floating-point variables of ``slots`` by dtype (in their order), where
    two or more share one; the others stay alone."""
    by_dtype: dict[np.dtype, list[Slot]] = {}
    for slot in slots.values():
        slot.group = None
        if _groupable(slot.value):
            by_dtype.setdefault(slot.value.dtype, []).append(slot)
    for members in by_dtype.values():
        if len(members) > 1:
            SlotGroup(members)


def _groupable(value: np.ndarray) -> bool:
    if not (value.size and value.nbytes <= GROUP_PART_BYTES and value.flags.c_contiguous):
        return False
    try:
        return dtype_of(value.dtype).is_floating_point
    except InvalidArgumentError:
        return False
