"""How a hybrid model's request produces the state slots the prefix cache keeps
(registry kind `state_strategy`, YAML `cache.state_strategy`; implementations in
handlers/state_*.py).

A request of a hybrid model owns a live slot (`req.state_slot`) that every forward
writes, and may read its next chunk's starting state from a slot the cache lent it
(`req.resume_slot`, after a prefix hit or after donating a checkpoint). At a
*checkpoint* — the end of a step that lands on the checkpoint grid — the strategy
provides a slot holding exactly the state after `req.kv_len` tokens, which the cache
then owns (unless it already had one there: then it is a duplicate and stays ours).

NOTE: invariant 2. The slot a strategy hands over covers exactly the tokens the step
ended at; it is produced either by the forward itself (`checkpoint_dst`) or by a copy
queued before the next forward (`take_checkpoint` through `slots.copy_later`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from kernel.request import Request


class StateSlots(Protocol):
    """What a strategy may do with state slots (kernel/states/hybrid_state.py implements it)."""

    def allocate(self) -> int | None: ...
    def free(self, slot: int) -> None: ...
    def copy_later(self, src: int, dst: int) -> None: ...


class StateStrategy(ABC):
    """Contract: `admit` allocates all of the request's own slots or none; the other
    calls change only the request's slot fields and the slots they allocate or free.
    A strategy that cannot get a slot skips the checkpoint (None), never fails."""

    own_slots = 1  # slots a request holds for its whole life
    # Whether the forward also writes the checkpoints inside a prefill chunk (each into a
    # fresh slot, donated with no copy); a copying strategy can only copy the live state.
    tracks_inside_chunks = False

    def admit(self, req: Request, slots: StateSlots) -> bool:
        """Allocate the request's live slot (and whatever else it keeps)."""
        live = slots.allocate()
        if live is None:
            return False
        req.state_slot = live
        return True

    def checkpoint_dst(self, req: Request, slots: StateSlots) -> int:
        """The slot a checkpoint step writes its state to (default: the live slot)."""
        assert req.state_slot is not None
        return req.state_slot

    @abstractmethod
    def take_checkpoint(self, req: Request, written: int, slots: StateSlots) -> int | None:
        """After a checkpoint step that wrote `written`: the slot to offer the cache,
        holding the state after exactly req.kv_len tokens; None to skip this one."""

    def after_insert(self, req: Request, slot: int, donated: bool, slots: StateSlots) -> None:
        """The cache took `slot` (donated) or already had a state there (a duplicate,
        still ours). Afterwards the request reads its next chunk from the right slot."""
        if donated:
            return
        slots.free(slot)

    def release(self, req: Request, slots: StateSlots) -> None:
        """Free every slot the request owns (finish, abort, retraction, error)."""
        for slot in (req.state_slot, req.track_slot):
            if slot is not None:
                slots.free(slot)
        req.state_slot = req.track_slot = req.resume_slot = None
