"""Recurrent state of hybrid models as the scheduler sees it: which state slot each
request reads and writes per step, when a step is a checkpoint, and the slot
accounting. Tensors never appear here: copies are queued for the device thread, which
runs them before the next forward (gpu/forward_batch.py `state_copies`).

NOTE: invariants 1 and 2. With the prefix cache on, checkpoints sit on a grid of
`cache.state_track_interval` tokens (a multiple of the page size), every non-final
prefill chunk ends on it (kernel/scheduling/chunk_planner.py), and a checkpoint slot covers
exactly the tokens its step ended at; `req.checkpoint_len` is always on the grid.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cache.state_pool import StatePool
from kernel.request import Request
from kernel.states.state_strategy import StateStrategy

EvictStates = Callable[[int], object]


class HybridState:
    def __init__(
        self, pool: StatePool, strategy: StateStrategy, interval: int, checkpoints: bool,
        evict_states: EvictStates,
    ) -> None:
        self.pool = pool
        self.strategy = strategy
        self.interval = interval
        self.checkpoints = checkpoints  # the prefix cache keeps states (cache.prefix radix)
        self.evict_states = evict_states
        self.copies: list[tuple[int, int]] = []  # for the next forward, in order

    # ---- StateSlots, for the strategy ------------------------------------------
    def allocate(self) -> int | None:
        slot = self.pool.allocate()
        if slot is None:
            self.evict_states(1)  # cached states are only a cache: take one back
            slot = self.pool.allocate()
        return slot

    def free(self, slot: int) -> None:
        # A copy into a slot that is given back must not land after its next owner wrote it.
        self.copies = [c for c in self.copies if c[1] != slot]
        self.pool.free(slot)

    def copy_later(self, src: int, dst: int) -> None:
        self.copies.append((src, dst))

    def take_copies(self) -> tuple[tuple[int, int], ...]:
        copies, self.copies = tuple(self.copies), []
        return copies

    # ---- the request's life ------------------------------------------------------
    def can_admit(self) -> bool:
        """Enough free (or evictable) slots for one more request's own slots."""
        need = self.strategy.own_slots - self.pool.num_free
        if need > 0:
            self.evict_states(need)
        return self.pool.num_free >= self.strategy.own_slots

    def admit(self, req: Request) -> bool:
        req.checkpoint_len = 0
        return self.strategy.admit(req, self)

    def is_checkpoint(self, req: Request, end: int) -> bool:
        return self.checkpoints and end % self.interval == 0 and end > req.checkpoint_len

    def plan(self, req: Request, start: int, length: int) -> tuple[int, int, tuple[tuple[int, int], ...]]:
        """(src, dst, track) of the request's chunk [start, start + length): the slots it
        reads and writes, and (length, slot) for each checkpoint inside the chunk."""
        assert req.state_slot is not None
        src, dst = self._read_slot(req), req.state_slot
        end = start + length
        if self.is_checkpoint(req, end):
            dst = self.strategy.checkpoint_dst(req, self)
        req.step_dst = dst
        req.step_track = self._track_inside(req, start, end)
        return src, dst, tuple(req.step_track)

    @staticmethod
    def _read_slot(req: Request) -> int:
        """Where the request's next chunk reads its starting state."""
        slot = req.resume_slot if req.resume_slot is not None else req.state_slot
        assert slot is not None
        return slot

    def _track_inside(self, req: Request, start: int, end: int) -> list[tuple[int, int]]:
        """Slots for the grid points strictly inside a prefill chunk, for strategies whose
        forward writes checkpoints (no copy); as many as there are slots to spare."""
        if not self.checkpoints or not self.strategy.tracks_inside_chunks:
            return []
        first = max(start, req.checkpoint_len) // self.interval * self.interval + self.interval
        track = []
        for point in range(first, end, self.interval):
            slot = self.allocate()
            if slot is None:
                break
            track.append((point, slot))
        return track

    # ---- speculative decoding: verify steps -------------------------------------
    def spare_slots(self) -> int:
        """Free slots a verify step may take (never by evicting cached states)."""
        return self.pool.num_free

    def plan_verify(self, req: Request, start: int, length: int) -> tuple[int, int, tuple[tuple[int, int], ...]]:
        """(src, dst, track) of a verify chunk [start, start + length): every position's
        state goes to a fresh slot of its own (`req.verify_states`), so the request can
        resume from whichever position the verification ends at; its live slot is
        written by no one. NOTE: invariant 9."""
        assert req.state_slot is not None and not req.verify_states
        src = self._read_slot(req)
        for end in range(start + 1, start + length + 1):
            slot = self.pool.allocate()
            assert slot is not None, "spare_slots promised the verify step's slots"
            req.verify_states.append((end, slot))
        *track, (_, dst) = req.verify_states
        return src, dst, tuple(track)

    def plan_side(self, req: Request, nodes: int) -> tuple[int, ...]:
        """Slots for the states after a token tree's `nodes` side nodes, in node order
        (`req.verify_side`): each side branch is a chunk of its own from the request's
        read slot (kernel/speculative/tree.py), which it only reads."""
        assert not req.verify_side
        for _ in range(nodes):
            slot = self.pool.allocate()
            assert slot is not None, "spare_slots promised the side nodes' slots"
            req.verify_side.append(slot)
        return tuple(req.verify_side)

    def land_verify(self, req: Request, offer: Callable[[int, int], bool],
                    side: Sequence[tuple[int, int]] = ()) -> None:
        """A verify step landed (`req.kv_len` is where it ended): grid points up to there
        are offered to the cache (`offer(slot, length)` -> donated), the state at kv_len
        becomes the request's (its live slot, or read from the cache's copy next), and
        every other slot of the step is given back. `side`: (length, slot) of the side
        nodes the accepted path runs through (a token tree), in order: from the first on,
        the path's states are theirs, not the main chain's."""
        states, req.verify_states = req.verify_states, []
        spare, req.verify_side = req.verify_side, []
        if side:
            fork = side[0][0] - 1  # the path leaves the main chain after this length
            for _, slot in [s for s in states if s[0] > fork]:
                self.free(slot)
            states = [s for s in states if s[0] <= fork] + list(side)
        on_path = {slot for _, slot in side}
        for slot in spare:
            if slot not in on_path:
                self.free(slot)
        for end, slot in states:
            if end > req.kv_len:
                self.free(slot)  # a rejected draft's state: never cached, never read
                continue
            donated = self.is_checkpoint(req, end) and offer(slot, end)
            if donated:
                req.checkpoint_len = end
            if end < req.kv_len:
                if not donated:
                    self.free(slot)
            elif donated:
                req.resume_slot = slot  # the cache's now: read it next, never write it
            else:
                self._make_live(req, slot)

    def _make_live(self, req: Request, slot: int) -> None:
        """`slot` holds the request's newest state: it becomes the live slot."""
        old, req.state_slot, req.resume_slot = req.state_slot, slot, None
        if old is not None:
            self.free(old)

    def tracked(self, req: Request) -> list[tuple[int, int]]:
        """The step landed: the (length, slot) checkpoints it wrote inside the chunk, in
        order; the caller offers each to the cache and calls `after_tracked`."""
        track, req.step_track = req.step_track, []
        return track

    def after_tracked(self, req: Request, length: int, slot: int, donated: bool) -> None:
        req.checkpoint_len = length
        if not donated:  # the cache had it already: this copy is ours to give back
            self.free(slot)

    def after_step(self, req: Request) -> int | None:
        """The step landed (req.kv_len is its end): the checkpoint slot to offer the
        cache, or None. The request's next chunk reads from the right slot either way."""
        written, req.step_dst = req.step_dst, None
        assert written is not None
        if written == req.state_slot:
            req.resume_slot = None  # our live slot has the newest state
        if not self.is_checkpoint(req, req.kv_len):
            return None
        slot = self.strategy.take_checkpoint(req, written, self)
        if slot is not None:
            req.checkpoint_len = req.kv_len
        return slot

    def after_insert(self, req: Request, slot: int, donated: bool) -> None:
        self.strategy.after_insert(req, slot, donated, self)

    def release(self, req: Request) -> None:
        for _, slot in req.step_track + req.verify_states:  # a step that never landed (error, abort)
            self.free(slot)
        for slot in req.verify_side:
            self.free(slot)
        req.step_track, req.verify_states, req.verify_side = [], [], []
        self.strategy.release(req, self)
        req.checkpoint_len = 0
        req.step_dst = None

    def own_slots(self, reqs: list[Request]) -> list[int]:
        own = [s for r in reqs for s in (r.state_slot, r.track_slot) if s is not None]
        return own + [slot for r in reqs for _, slot in r.step_track + r.verify_states] + [
            slot for r in reqs for slot in r.verify_side]
