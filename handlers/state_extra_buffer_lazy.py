"""`extra_buffer_lazy`: one slot per request; a second one only for the forward that
crosses a checkpoint, donated to the cache right after (or, if the cache already had
that state, kept as the live slot while the old live slot is freed)."""

from __future__ import annotations

from kernel.registry import register
from kernel.request import Request
from kernel.states.state_strategy import StateSlots, StateStrategy


@register("state_strategy", "extra_buffer_lazy")
class ExtraBufferLazy(StateStrategy):
    tracks_inside_chunks = True
    def checkpoint_dst(self, req: Request, slots: StateSlots) -> int:
        assert req.state_slot is not None and req.track_slot is None
        req.track_slot = slots.allocate()
        return req.track_slot if req.track_slot is not None else req.state_slot

    def take_checkpoint(self, req: Request, written: int, slots: StateSlots) -> int | None:
        return written if written == req.track_slot else None

    def after_insert(self, req: Request, slot: int, donated: bool, slots: StateSlots) -> None:
        req.track_slot = None  # the second slot lives for one forward only
        if donated:
            req.resume_slot = slot
            return
        assert req.state_slot is not None
        slots.free(req.state_slot)  # stale: the state after this step is in `slot`
        req.state_slot, req.resume_slot = slot, None
