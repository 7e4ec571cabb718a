"""`extra_buffer`: two ping-pong slots per request. A checkpoint step writes its state
into the second (track) slot, which is then donated to the cache with no copy; the
request reads its next chunk from it and takes a fresh track slot."""

from __future__ import annotations

from kernel.registry import register
from kernel.request import Request
from kernel.states.state_strategy import StateSlots, StateStrategy


@register("state_strategy", "extra_buffer")
class ExtraBuffer(StateStrategy):
    own_slots = 2
    tracks_inside_chunks = True

    def admit(self, req: Request, slots: StateSlots) -> bool:
        live = slots.allocate()
        if live is None:
            return False
        track = slots.allocate()
        if track is None:
            slots.free(live)
            return False
        req.state_slot, req.track_slot = live, track
        return True

    def checkpoint_dst(self, req: Request, slots: StateSlots) -> int:
        if req.track_slot is None:  # the last donation found no replacement: try again
            req.track_slot = slots.allocate()
        assert req.state_slot is not None
        return req.track_slot if req.track_slot is not None else req.state_slot

    def take_checkpoint(self, req: Request, written: int, slots: StateSlots) -> int | None:
        return written if written == req.track_slot else None

    def after_insert(self, req: Request, slot: int, donated: bool, slots: StateSlots) -> None:
        # NOTE: the ping-pong pick. The state after this step is in `slot` (the track
        # slot); the live slot holds the state of an earlier step.
        if donated:
            req.resume_slot = slot  # the cache's now: read it, never write it
            req.track_slot = slots.allocate()
        else:  # the cache had this state already: keep ours, and swap the roles
            req.state_slot, req.track_slot = slot, req.state_slot
            req.resume_slot = None
