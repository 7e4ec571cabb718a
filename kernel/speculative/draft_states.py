"""Prefix hits for a hybrid draft model: its recurrent state at page boundaries it read.

A hybrid draft's KV pages get the marks a dense draft's do (kernel/speculative/draft_pages.py),
but its recurrent state cannot be rebuilt from pages: a request's first job could only start
over from its first token. So a job whose chunk of known tokens crosses a page boundary
keeps the draft's state at the last one it crosses (the chunk's `state_track`) in a
snapshot slot of the draft's state pool, keyed by the page chain key of the tokens before
it; a later request whose leading pages carry those marks and keys copies the snapshot
into its `base` slot and starts its first job there (a multi-turn chat's next turn).

The slots are a fixed range of the draft's pool, reused least recently used first. A
snapshot a step's job writes is findable from the next step on (`settle`): the jobs of one
step copy their snapshots before their forward writes any.

NOTE: like the page marks, a snapshot only ever makes drafts better or worse, never an
output different (the target verifies every draft).
"""

from __future__ import annotations

from collections import OrderedDict


class DraftStates:
    def __init__(self, first_slot: int, count: int) -> None:
        self._free = list(range(first_slot + count - 1, first_slot - 1, -1))
        self._slots: OrderedDict[int, int] = OrderedDict()  # page chain key -> slot, least recent first
        self._pending: set[int] = set()  # keys written by the step being planned

    def find(self, keys: list[int]) -> tuple[int, int]:
        """(pages, slot): the longest leading run of `keys` (a request's page chain keys)
        whose last key has a settled snapshot, and its slot; (0, 0) if none."""
        for n in range(len(keys), 0, -1):
            slot = self._slots.get(keys[n - 1])
            if slot is not None and keys[n - 1] not in self._pending:
                self._slots.move_to_end(keys[n - 1])
                return n, slot
        return 0, 0

    def keep(self, key: int) -> int:
        """The slot the snapshot for `key` is to be written to (this step's forward); 0 if
        another job of the step writes it already (the same tokens: one slot, one writer)."""
        if key in self._pending:
            return 0
        slot = self._slots.pop(key, None)
        if slot is None:
            slot = self._free.pop() if self._free else self._slots.popitem(last=False)[1]
        self._slots[key] = slot
        self._pending.add(key)
        return slot

    def settle(self, written: bool = True) -> None:
        """The planned step's draft forward ran (written) or failed (its snapshots are dropped)."""
        if not written:
            for key in self._pending:
                self._free.append(self._slots.pop(key))
        self._pending.clear()
