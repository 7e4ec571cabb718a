"""`no_buffer`: one slot per request; at a checkpoint the live state is copied into a
new slot that the cache then owns (the copy runs before the next forward)."""

from __future__ import annotations

from kernel.registry import register
from kernel.request import Request
from kernel.states.state_strategy import StateSlots, StateStrategy


@register("state_strategy", "no_buffer")
class NoBuffer(StateStrategy):
    def take_checkpoint(self, req: Request, written: int, slots: StateSlots) -> int | None:
        copy = slots.allocate()
        if copy is None:
            return None  # no slot to spare: skip this checkpoint
        slots.copy_later(written, copy)
        return copy
