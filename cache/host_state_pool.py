"""The host tier's area for hybrid-model state slots: host copies of `StatePool` slots,
their canonical bytes for the storage tier, and the copies to and from the device pool.

Same scheme as `host_pool` (free list with slot 0 reserved, pinned memory on CUDA,
non-blocking transfers per run of consecutive host slots on the caller's stream), over
the state pool's per-layer tensors instead of K/V pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cache.allocator import FreeList, PooledIds
from cache.host_pool import (
    check_ids,
    pin_default,
    runs,
    stream_ctx,
    tensor_bytes,
    tensor_from_bytes,
)
from cache.state_pool import RECURRENT_DTYPE, LayerStateShape, StatePool


class HostStatePool(PooledIds):
    """Host copies of `StatePool` slots (hybrid models): `conv[layer]` is
    `[slots, conv_dim, conv_width]` in the model dtype, `recurrent[layer]` is
    `[slots, heads, k_dim, v_dim]` float32 or None. Slot 0 is reserved. A slot's canonical
    bytes are, layer by layer, its conv window then its recurrent state (if any), C order."""

    def __init__(
        self, layers: Sequence[LayerStateShape], num_slots: int, dtype: torch.dtype, pin_memory: bool | None = None
    ) -> None:
        self.layers = tuple(layers)
        self.num_slots = num_slots
        self.dtype = dtype
        self.pinned = pin_default(pin_memory)
        self._ids = FreeList(num_slots, "state slot")
        pin = self.pinned
        self.conv = [torch.empty((num_slots, s.conv_dim, s.conv_width), dtype=dtype, pin_memory=pin) for s in layers]
        self.recurrent: list[torch.Tensor | None] = [
            None if s.recurrent is None else torch.empty((num_slots, *s.recurrent), dtype=RECURRENT_DTYPE, pin_memory=pin)
            for s in self.layers
        ]

    @classmethod
    def like(cls, state_pool: StatePool, num_slots: int, pin_memory: bool | None = None) -> HostStatePool:
        return cls(state_pool.layers, num_slots, state_pool.dtype, pin_memory)

    @property
    def bytes_per_slot(self) -> int:
        return StatePool.slot_bytes(self.layers, self.dtype)

    def allocate(self, n: int) -> list[int] | None:
        """`n` free host slots (stale contents), or None and nothing taken."""
        return self._ids.allocate(n)

    def free(self, slots: Sequence[int]) -> None:
        """Return slots; one not allocated raises and nothing changes."""
        self._ids.free(slots)

    def tensors(self) -> list[torch.Tensor]:
        """Every per-slot tensor, in canonical order."""
        pairs = zip(self.conv, self.recurrent, strict=True)
        return [t for conv, rec in pairs for t in (conv, rec) if t is not None]

    def state_bytes(self, slot: int) -> bytes:
        """The slot's bytes in canonical order. Reads only."""
        self._check_slot(slot)
        return slot_to_bytes(self.tensors(), slot)

    def load_state_bytes(self, slot: int, data: bytes | bytearray | memoryview) -> None:
        """Overwrite one slot from `state_bytes` output; a length mismatch raises first."""
        self._check_slot(slot)
        slot_from_bytes(self.tensors(), slot, data, self.bytes_per_slot)

    def _check_slot(self, slot: int) -> None:
        if not 0 < slot < self.num_slots:
            raise IndexError(f"host state slot {slot} is reserved or out of range [1, {self.num_slots})")


def slot_to_bytes(tensors: Sequence[torch.Tensor], slot: int) -> bytes:
    """One slot of per-slot `tensors` (canonical order: `StatePool.tensors()`, on the
    device, or `HostStatePool.tensors()`) as bytes: what the storage tier keeps for a state."""
    return b"".join(tensor_bytes(t[slot]) for t in tensors)


def slot_from_bytes(tensors: Sequence[torch.Tensor], slot: int, data: bytes | bytearray | memoryview, size: int) -> None:
    """Overwrite one slot from `slot_to_bytes` output; ValueError on a length mismatch,
    before anything is written."""
    raw = tensor_from_bytes(data, size, "a state slot")
    offset = 0
    for t in tensors:
        n = t[slot].nbytes
        # clone: a segment may start off the alignment its dtype's view needs.
        t[slot].copy_(raw[offset : offset + n].clone().view(t.dtype).view(t[slot].shape))
        offset += n


def _state_pairs(
    pool: StatePool, slots: Sequence[int], host: HostStatePool, host_slots: Sequence[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if len(slots) != len(host_slots):
        raise ValueError(f"{len(slots)} device slots but {len(host_slots)} host slots")
    if (pool.layers, pool.dtype) != (host.layers, host.dtype):
        raise ValueError("device and host state slots differ in layer shapes or dtype")
    check_ids(slots, pool.num_slots, "device state slots")
    check_ids(host_slots, host.num_slots, "host state slots")
    device_tensors = pool.conv + [t for t in pool.recurrent if t is not None]
    host_tensors = host.conv + [t for t in host.recurrent if t is not None]
    return list(zip(device_tensors, host_tensors, strict=True))


def offload_states(
    pool: StatePool,
    slots: Sequence[int],
    host: HostStatePool,
    host_slots: Sequence[int],
    stream: torch.cuda.Stream | None = None,
) -> int:
    """Copy device state slots to host slots, pairwise, all layers; returns bytes. Writes
    only `host_slots`; with a `stream`, valid once it finishes (as `offload`)."""
    pairs = _state_pairs(pool, slots, host, host_slots)
    with stream_ctx(stream):
        idx = torch.tensor(list(slots), dtype=torch.long, device=pool.conv[0].device)
        for dev_t, host_t in pairs:
            gathered = dev_t.index_select(0, idx)
            for i, j, first in runs(host_slots):
                host_t[first : first + j - i].copy_(gathered[i:j], non_blocking=stream is not None)
    return len(slots) * host.bytes_per_slot


def load_states_back(
    host: HostStatePool,
    host_slots: Sequence[int],
    pool: StatePool,
    slots: Sequence[int],
    stream: torch.cuda.Stream | None = None,
) -> int:
    """Copy host slots into device state slots, pairwise, all layers; returns bytes.
    Writes only `slots`; with a `stream`, the reader waits for it (as `load_back`)."""
    pairs = _state_pairs(pool, slots, host, host_slots)
    with stream_ctx(stream):
        device = pool.conv[0].device
        idx = torch.tensor(list(slots), dtype=torch.long, device=device)
        for dev_t, host_t in pairs:
            stage = torch.empty((len(slots), *host_t.shape[1:]), dtype=host_t.dtype, device=device)
            for i, j, first in runs(host_slots):
                stage[i:j].copy_(host_t[first : first + j - i], non_blocking=stream is not None)
            dev_t.index_copy_(0, idx, stage)
    return len(slots) * host.bytes_per_slot
