"""What a hybrid model's linear/conv layers need to know about a step: per request, in batch
order, how many tokens it brings, where it resumes and which state slots to read and write.

Built from plain values by the device-side batch builder (the loop never hands over
lists it may still mutate); the model only reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HybridStep:
    """Per request of the step, in the same order as the flattened tokens.

    extend_lens: tokens of this step; prefix_lens: tokens already behind the state;
    src_slots: state slot to resume from (ignored where prefix_lens == 0: a fresh start
    from the zero state, so a stale slot can never leak into a new prompt); dst_slots:
    slot the state after the request's last token of this step is written to (may equal
    src; distinct requests need distinct dst slots, except the reserved slot 0 that
    padding rows write to).
    """

    extend_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    src_slots: torch.Tensor  # [R] int64
    dst_slots: torch.Tensor  # [R] int64
    fresh: torch.Tensor  # [R] bool: prefix_lens == 0

    @classmethod
    def build(
        cls,
        extend_lens: Sequence[int],
        prefix_lens: Sequence[int],
        src_slots: Sequence[int],
        dst_slots: Sequence[int],
        device: torch.device,
    ) -> HybridStep:
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
        return cls(
            extend_lens=tuple(int(e) for e in extend_lens),
            prefix_lens=tuple(int(p) for p in prefix_lens),
            src_slots=torch.tensor(list(src_slots), dtype=torch.int64, device=device),
            dst_slots=torch.tensor(list(dst_slots), dtype=torch.int64, device=device),
            fresh=torch.tensor([p == 0 for p in prefix_lens], dtype=torch.bool, device=device),
        )

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
