"""What runs on the storage tier's threads (kernel/tiers/storage_tier.py), never on the loop:
the backend calls of a probe and of a fill, a call's outage check, and the digest of a
model's weights that storage keys carry; and `StateBytes`, a hybrid model's state slots
as storage reads and writes them (its loop-side calls say so)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from cache.host_pool import HostPool
from cache.host_state_pool import slot_from_bytes, slot_to_bytes
from cache.state_pool import StatePool
from cache.storage import StorageBackend
from cache.storage.base import outages_in_this_thread


def checked_call(fn: Callable[[], Any]) -> tuple[Any, bool]:
    """Run one backend call; (its result, whether it met no outage — a dead server, a
    failed write — as the backend counted it on this thread). Exceptions propagate."""
    before = outages_in_this_thread()
    result = fn()
    return result, outages_in_this_thread() == before


def probe(backend: StorageBackend, keys: list[str], state_keys: list[str], first: int, grid_pages: int) -> int:
    """How many of `keys` (pages `first`, `first + 1`, ...) to fetch: the stored prefix,
    or for hybrid models (`state_keys` given) the deepest page of it on the checkpoint
    grid whose state is stored too (0 if none)."""
    n = backend.exists_prefix(keys)
    if not state_keys:
        return n
    n -= (first + n) % grid_pages
    while n > 0 and not backend.exists_prefix([state_keys[n - 1]]):
        n -= grid_pages
    return max(n, 0)


class StateBytes:
    """How the storage tier reads and writes one state slot's bytes (hybrid models): here
    the local state pool's. Tensor parallelism's spans every rank's part of the slot
    (kernel/parallel/host_shards.py)."""

    def __init__(self, states: StatePool) -> None:
        self.states = states

    @property
    def layout(self) -> str:
        """The name of the bytes' layout in storage keys (cache/storage/keys.py `PageFormat`)."""
        return f"recurrent_state.{len(self.states.layers)}"

    @property
    def size(self) -> int:
        return self.states.bytes_per_slot

    def reader(self, slot: int) -> Callable[[], bytes]:
        """Called on the loop when a copy of the slot's node starts; the result, called on
        the copy worker while the node is locked, returns the slot's bytes."""
        tensors = self.states.tensors()
        return lambda: slot_to_bytes(tensors, slot)

    def write(self, slot: int, data: bytes) -> None:
        """Overwrite the slot from stored bytes (a reader thread; the slot is the fetch's
        own). ValueError on a length mismatch, before anything is written."""
        slot_from_bytes(self.states.tensors(), slot, data, self.size)

    def commit(self, slot: int) -> None:
        """On the loop once `write` returned, before the slot is read by anything."""


def fill(
    backend: StorageBackend, host_pool: HostPool, states: StateBytes | None, keys: list[str], host: list[int],
    state_key: str | None, slot: int | None,
) -> tuple[int, int]:
    """Get the pages (and, hybrid models, the state after the last) and copy the leading
    good pages into `host` (the state into `slot`); returns (pages filled, pages that came
    back but did not fit). Hybrid: all or nothing, since the state only fits after the
    last page."""
    payloads = backend.get_pages([*keys, state_key] if state_key is not None else keys)
    filled, bad = len(keys), 0
    for i, data in enumerate(payloads[: len(keys)]):
        if data is None:
            filled = i
            break
        try:
            host_pool.load_bytes(host[i], data)
        except ValueError:  # verified by its checksum, yet not a page of this format
            filled, bad = i, 1
            break
    if state_key is None or slot is None or states is None:
        return filled, bad
    state = payloads[-1]
    if filled < len(keys) or state is None:
        return 0, bad
    try:
        states.write(slot, state)
    except ValueError:
        return 0, 1
    return filled, 0


def weights_fingerprint(weights: Mapping[str, torch.Tensor]) -> str:
    """A short digest naming a model's weights, for storage keys: names, shapes, dtypes
    and up to 64 KiB from each end of every tensor (cheap, and two different checkpoints
    essentially never agree on all of it)."""
    h = hashlib.blake2b(digest_size=12)
    edge = 1 << 16
    for name in sorted(weights):
        t = weights[name]
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        raw = t.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
        h.update(raw[:edge].numpy().tobytes())
        h.update(raw[-edge:].numpy().tobytes())
    return h.hexdigest()
