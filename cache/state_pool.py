"""Fixed-size per-slot state of a hybrid model's linear/conv layers, and its slot allocator.

A slot holds, for every non-attention layer, the conv window (the last kernel-1 inputs
of the layer's causal conv) and, for Gated DeltaNet layers, the recurrent state. A slot
is valid for exactly one prefix length (invariant 2); copying a slot forks a prefix.
Pure tensors and a free list: no model code, no requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from cache.allocator import FreeList, PooledIds


class LayerStateShape(NamedTuple):
    """State of one linear/conv layer, per slot."""

    conv_dim: int  # channels of the causal conv
    conv_width: int  # kernel - 1: inputs carried from one step to the next
    recurrent: tuple[int, int, int] | None  # (heads, k_dim, v_dim) of a delta-rule state; None: conv only


# NOTE: the recurrent state is kept in float32 whatever the model dtype. It is a running
# sum over every token of the prefix (decayed, rank-one updates); rounding it to bf16 at
# each step compounds over thousands of tokens, and the reference kernels also keep it
# in float32. Conv windows hold layer inputs, already in the model dtype: kept in it.
RECURRENT_DTYPE = torch.float32


class StatePool(PooledIds):
    """conv[layer] is [num_slots, conv_dim, conv_width]; recurrent[layer] is
    [num_slots, heads, k_dim, v_dim] float32, or None for a conv-only layer.

    Layers are numbered among the linear/conv layers only. Slot 0 is reserved (the
    write target of padding rows, like page 0) and never allocated.
    """

    def __init__(
        self, layers: Sequence[LayerStateShape], num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if num_slots < 2:
            raise ValueError(f"a state pool needs at least 2 slots (slot 0 is reserved), got {num_slots}")
        self.layers = tuple(layers)
        self.num_slots = num_slots
        self.dtype = dtype
        # Zero-filled: slot 0 is read by padding rows and must hold finite values.
        self.conv = [
            torch.zeros((num_slots, s.conv_dim, s.conv_width), dtype=dtype, device=device)
            for s in self.layers
        ]
        self.recurrent: list[torch.Tensor | None] = [
            None
            if s.recurrent is None
            else torch.zeros((num_slots, *s.recurrent), dtype=RECURRENT_DTYPE, device=device)
            for s in self.layers
        ]
        self._ids = FreeList(num_slots, "state slot")

    @staticmethod
    def slot_bytes(layers: Sequence[LayerStateShape], dtype: torch.dtype) -> int:
        """Bytes one slot takes, to size a pool before building it."""
        conv_item = torch.empty((), dtype=dtype).element_size()
        rec_item = torch.empty((), dtype=RECURRENT_DTYPE).element_size()
        total = 0
        for s in layers:
            total += s.conv_dim * s.conv_width * conv_item
            if s.recurrent is not None:
                heads, k_dim, v_dim = s.recurrent
                total += heads * k_dim * v_dim * rec_item
        return total

    @property
    def bytes_per_slot(self) -> int:
        return self.slot_bytes(self.layers, self.dtype)

    def allocate(self) -> int | None:
        """A free slot (its contents are stale: the first step from it must start fresh
        or it must be written by `copy`/`zero`), or None when all are in use."""
        slots = self._ids.allocate(1)
        return slots[0] if slots else None

    def free(self, slot: int) -> None:
        """Give `slot` back; a reserved, free or out-of-range slot raises."""
        self._ids.free([slot])

    def copy(self, src: int, dst: int) -> None:
        """Make slot `dst` hold slot `src`'s state, all layers."""
        for t in self._tensors():
            t[dst].copy_(t[src])

    def zero(self, slot: int) -> None:
        """The state before position 0."""
        for t in self._tensors():
            t[slot].zero_()

    def recurrent_of(self, layer: int) -> torch.Tensor:
        t = self.recurrent[layer]
        if t is None:
            raise KeyError(f"state layer {layer} is conv-only; it has no recurrent state")
        return t

    def tensors(self) -> list[torch.Tensor]:
        """Every per-slot tensor in canonical order (layer by layer: conv, then recurrent
        if any), the order of a slot's bytes in storage (cache/host_state_pool.py)."""
        pairs = zip(self.conv, self.recurrent, strict=True)
        return [t for conv, rec in pairs for t in (conv, rec) if t is not None]

    def _tensors(self) -> list[torch.Tensor]:
        return self.conv + [t for t in self.recurrent if t is not None]
