"""What a hybrid model's linear/conv layers need to know about a step: per request, in batch
order, how many tokens it brings, where it resumes and which state slots to read and write.

Built from plain values by the device-side batch builder (the loop never hands over
lists it may still mutate); the model only reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gpu.upload import to_device

# Per request: (end_len, slot) pairs, end_len an absolute token count inside the chunk.
Track = tuple[tuple[tuple[int, int], ...], ...]


@dataclass(frozen=True)
class HybridStep:
    """Per request of the step, in the same order as the flattened tokens.

    extend_lens: tokens of this step; prefix_lens: tokens already behind the state;
    src_slots: state slot to resume from (ignored where prefix_lens == 0: a fresh start
    from the zero state, so a stale slot can never leak into a new prompt); dst_slots:
    slot the state after the request's last token of this step is written to (may equal
    src; distinct requests need distinct dst slots, except the reserved slot 0 that
    padding rows write to).

    track: per request, (end_len, slot) pairs: the state after exactly end_len tokens
    (prefix_len < end_len < prefix_len + extend_len, increasing) is written to slot as
    well, in the same forward (checkpoints inside a prefill chunk). Empty: no request
    tracks anything. Tracked slots are distinct from each other, from every dst slot
    and from the reserved slot 0.

    Static shapes (gpu/graphs/): the graph runner builds the step over its registered
    buffers, one entry per request slot of the bucket; padding requests (slot 0, fresh)
    may bring 0 tokens, and `static_track` makes every track row be written.
    """

    extend_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    src_slots: torch.Tensor  # [R] int64
    dst_slots: torch.Tensor  # [R] int64
    fresh: torch.Tensor  # [R] bool: prefix_lens == 0
    track: Track = ()
    # Static shapes (graph runner): the registered track buffers, [M_max] slots and a
    # mask (live rows True, padding rows False, slot 0). Every row is written, as a
    # captured graph does; None: exactly the tracked points are written.
    static_track: tuple[torch.Tensor, torch.Tensor] | None = None
    # A verify bucket (gpu/graphs/runner.py): the lengths as a registered [R] buffer, each
    # at most `static_steps`; the state layers then run their static forms
    # (gpu/kernels/gated_delta.py `gated_delta_static`, short_conv.py `short_conv_static`),
    # which read no host length, and `static_track` holds one row per token: the slot for
    # the state after that token (mask False: not kept).
    static_lens: torch.Tensor | None = None
    static_steps: int = 0
    # Flattened track, in request order: (request index, tokens into its chunk).
    track_points: tuple[tuple[int, int], ...] = field(init=False)
    track_slots: torch.Tensor = field(init=False)  # [M] int64, same order (static: [M_max])

    def __post_init__(self) -> None:
        # Lengths and slot reuse are checked here, so a step constructed directly is held
        # to them too; the clash with dst slots is checked in `build`, which has them as
        # ints (reading the tensor back here would sync with the device every step).
        n = len(self.extend_lens)
        if self.track and len(self.track) != n:
            raise ValueError(f"track has {len(self.track)} entries for {n} requests")
        points: list[tuple[int, int]] = []
        slots: list[int] = []
        for r, pairs in enumerate(self.track):
            prefix, extend, last = self.prefix_lens[r], self.extend_lens[r], self.prefix_lens[r]
            for end, slot in pairs:
                if not prefix < end < prefix + extend:
                    raise ValueError(
                        f"request {r}: tracked length {end} is not inside its chunk "
                        f"({prefix}, {prefix + extend})"
                    )
                if end <= last:
                    raise ValueError(f"request {r}: tracked lengths must increase: {list(pairs)}")
                if slot < 1 or slot in slots:
                    raise ValueError(f"request {r}: tracked slot {slot} is reserved or tracked twice")
                last = end
                points.append((r, end - prefix))
                slots.append(slot)
        object.__setattr__(self, "track_points", tuple(points))
        if self.static_track is not None:
            object.__setattr__(self, "track_slots", self.static_track[0])
            return
        device = self.dst_slots.device
        object.__setattr__(self, "track_slots", to_device(slots, torch.int64, device))

    @classmethod
    def build(
        cls,
        extend_lens: Sequence[int],
        prefix_lens: Sequence[int],
        src_slots: Sequence[int],
        dst_slots: Sequence[int],
        device: torch.device,
        track: Sequence[Sequence[tuple[int, int]]] | None = None,
    ) -> HybridStep:
        """track: None (or empty) for no tracked states, else one sequence per request."""
        plain_track = cls.check(extend_lens, prefix_lens, src_slots, dst_slots, track)
        return cls(
            extend_lens=tuple(int(e) for e in extend_lens),
            prefix_lens=tuple(int(p) for p in prefix_lens),
            src_slots=to_device(list(src_slots), torch.int64, device),
            dst_slots=to_device(list(dst_slots), torch.int64, device),
            fresh=to_device([p == 0 for p in prefix_lens], torch.bool, device),
            track=plain_track,
        )

    @staticmethod
    def check(
        extend_lens: Sequence[int],
        prefix_lens: Sequence[int],
        src_slots: Sequence[int],
        dst_slots: Sequence[int],
        track: Sequence[Sequence[tuple[int, int]]] | None = None,
    ) -> Track:
        """The checks of `build` on plain values (also the graph runner's, on the live
        requests before padding); returns the track as plain ints."""
        n = len(extend_lens)
        if not (len(prefix_lens) == len(src_slots) == len(dst_slots) == n):
            raise ValueError(
                "extend_lens, prefix_lens, src_slots and dst_slots must have one entry per request"
            )
        if any(e < 1 for e in extend_lens) or any(p < 0 for p in prefix_lens):
            raise ValueError(f"bad lengths: extend {list(extend_lens)}, prefix {list(prefix_lens)}")
        real_dst = [s for s in dst_slots if s != 0]
        if len(set(real_dst)) != len(real_dst):
            raise ValueError(f"two requests of one step write the same state slot: {list(dst_slots)}")
        plain_track: Track = ()
        if track:
            plain_track = tuple(tuple((int(e), int(s)) for e, s in pairs) for pairs in track)
            # A tracked slot that is also a dst slot would be overwritten by one of the two
            # writes, which one depending on the layer's code.
            clash = {s for pairs in plain_track for _, s in pairs} & {int(d) for d in dst_slots}
            if clash:
                raise ValueError(f"tracked slots {sorted(clash)} are also dst slots")
        return plain_track

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def load(self, pool_tensor: torch.Tensor) -> torch.Tensor:
        """Each request's starting state [R, ...] from a pool tensor [num_slots, ...]."""
        states = pool_tensor.index_select(0, self.src_slots)
        return states.masked_fill(self.fresh.view(-1, *([1] * (states.dim() - 1))), 0)

    def store(self, pool_tensor: torch.Tensor, states: torch.Tensor) -> None:
        """Write each request's final state [R, ...] to its dst slot."""
        pool_tensor.index_copy_(0, self.dst_slots, states.to(pool_tensor.dtype))

    def store_tracked(self, pool_tensor: torch.Tensor, states: torch.Tensor) -> None:
        """Write the tracked states [M, ...] (in `track_points` order) to their slots.

        Static shapes: every row of the track buffers is written, as a captured graph
        writes them; a masked-off row writes its slot's own state back (padding rows:
        the reserved slot 0), a live row its tracked state."""
        if self.static_track is not None:
            slots, mask = self.static_track
            full = states.new_zeros((slots.shape[0], *states.shape[1:]))
            full[: states.shape[0]] = states
            keep = pool_tensor.index_select(0, slots)
            picked = torch.where(mask.view(-1, *([1] * (full.dim() - 1))), full.to(keep.dtype), keep)
            pool_tensor.index_copy_(0, slots, picked)
        elif self.track_points:
            pool_tensor.index_copy_(0, self.track_slots, states.to(pool_tensor.dtype))

    @property
    def writes_tracked(self) -> bool:
        """Whether the state layers must call `store_tracked` (always with static shapes)."""
        return bool(self.track_points) or self.static_track is not None
