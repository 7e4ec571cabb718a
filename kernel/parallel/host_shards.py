"""The host tier under tensor parallelism: every rank copies its own shard of a page
between its device pool and its host pages, under the page ids rank 0 chose.

Rank 0's host tier decides every copy (kernel/tiers/host_tier.py) and posts the same copy
to the workers (`RankCopies.post`) as a message its device thread sends, so a worker runs
it in order with the steps: a step planned after a copy finds the copy done on every rank,
and a host page freed and given to another copy is written only after the copies before
it read it. A worker marks each copy done in a shared counter; rank 0's copy job waits
for every worker's mark (`RankCopies.wait`) before its future resolves.

The workers' host pages are shared memory (memfd) that rank 0 maps too, so the storage
tier reads and writes a page as every rank's shard of it in rank order
(`ShardedHostPool`): one storage object per page, written and read whole, so a page never
comes back with one rank's shard missing or stale. NOTE: that needs every rank on one
machine (tensor parallelism across the GPUs or NUMA nodes of one host). On CUDA the
workers' shared host pages are not pinned: their transfers are synchronous.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cache.host_pool import HostPool, Layout, load_back, offload
from cache.host_state_pool import slot_from_bytes, slot_to_bytes
from cache.kv_pool import KVPool
from cache.state_pool import StatePool
from kernel.tiers.storage_io import StateBytes

POLL_S = 0.0002  # how often a waiting copy looks at the workers' counters


@dataclass(frozen=True)
class HostShare:
    """What a worker needs to map its host pages and its done counter (sent in `Setup`)."""

    num_pages: int
    layout: str
    paths: tuple[str, ...]  # rank r's host pages: paths[r - 1]
    done_path: str  # int64 per rank: the last copy ticket the rank finished
    state_paths: tuple[str, ...] = ()  # hybrid models with storage: rank r's state mirror
    state_shape: tuple[int, int] = (0, 0)  # the mirror: [state slots, bytes of a rank's part of a slot]


class SharedMemory:
    """Anonymous shared memory (a memfd): other processes of this user map it by `path`
    while this process holds it open (see `share_host_pool` for when it closes)."""

    def __init__(self, nbytes: int, name: str) -> None:
        self.fd: int | None = os.memfd_create(name)
        os.ftruncate(self.fd, max(nbytes, 1))
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def map_shared(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over shared memory at `path` (writes are seen by every process mapping it;
    the mapping outlives the file descriptor)."""
    return torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype).view(shape)


class ShardedHostPool(HostPool):
    """Rank 0's host pool under tensor parallelism: page ids, free list and rank 0's shard
    as any `HostPool`, plus `shards`, the worker ranks' host pages (shared memory) under
    the same ids. `page_bytes` / `load_bytes` (the storage tier's view) are a page of
    every rank, rank order; `offload` / `load_back` move rank 0's shard only."""

    shards: list[HostPool]

    @property
    def bytes_per_page(self) -> int:
        return self.own_page_bytes * (1 + len(self.shards))

    def page_bytes(self, page: int) -> bytes:
        return b"".join([super().page_bytes(page), *(shard.page_bytes(page) for shard in self.shards)])

    def load_bytes(self, page: int, data: bytes | bytearray | memoryview) -> None:
        if len(data) != self.bytes_per_page:
            raise ValueError(f"a host page of {1 + len(self.shards)} ranks needs {self.bytes_per_page} bytes, "
                             f"got {len(data)}")
        view, step = memoryview(data), self.own_page_bytes
        super().load_bytes(page, view[:step])
        for i, shard in enumerate(self.shards, start=1):
            shard.load_bytes(page, view[i * step : (i + 1) * step])


@dataclass(frozen=True)
class SharedHost:
    """Rank 0's host pool for every rank, what the workers map (`share`, sent in `Setup`),
    the workers' done counters and, hybrid models with storage, their state mirrors."""

    pool: ShardedHostPool
    share: HostShare
    memory: tuple[SharedMemory, ...]
    done: torch.Tensor
    state_mirrors: tuple[torch.Tensor, ...]

    def close(self) -> None:
        """Once every worker mapped its memory: the mappings keep it; nothing is left to
        clean up if a process dies."""
        for m in self.memory:
            m.close()


def share_host_pool(kv_pool: KVPool, num_pages: int, layout: Layout, size: int,
                    states: StatePool | None = None) -> SharedHost:
    """Rank 0's host pool for `size` ranks: every rank's shard has rank 0's shape (KV heads
    split evenly or replicated). `states`: a hybrid model's state pool, when storage needs
    every rank's part of a state slot (`RankStateBytes`)."""
    pool = ShardedHostPool.like(kv_pool, num_pages, layout)
    shape, dtype = tuple(pool.data.shape), pool.data.dtype
    nbytes = pool.data.numel() * pool.data.element_size()
    memory = [SharedMemory(nbytes, f"tierserve-host-rank{rank}") for rank in range(1, size)]
    pool.shards = [HostPool.like(kv_pool, num_pages, layout, data=map_shared(m.path, shape, dtype)) for m in memory]
    done_memory = SharedMemory(8 * size, "tierserve-host-copies")
    done = map_shared(done_memory.path, (size,), torch.int64)
    done.zero_()
    state_shape = (states.num_slots, states.bytes_per_slot) if states is not None else (0, 0)
    state_memory = [SharedMemory(state_shape[0] * state_shape[1], f"tierserve-states-rank{rank}")
                    for rank in range(1, size)] if states is not None else []
    mirrors = tuple(map_shared(m.path, state_shape, torch.uint8) for m in state_memory)
    share = HostShare(num_pages, layout, tuple(m.path for m in memory), done_memory.path,
                      tuple(m.path for m in state_memory), state_shape)
    return SharedHost(pool, share, (*memory, done_memory, *state_memory), done, mirrors)


class RankCopies:
    """Rank 0's side (kernel/tiers/host_tier.py `RankCopies`): `post` hands the copy to the
    device thread to send in order with the steps; `wait` watches the workers' counters."""

    def __init__(self, done: torch.Tensor, alive: Callable[[], None], stopped: Callable[[], bool],
                 send: Callable[[object], None], send_later: Callable[[Callable[[], None]], None],
                 timeout_s: float) -> None:
        self.done = done
        self.alive = alive  # raises if a worker is gone
        self.stopped = stopped
        self.send = send  # to every worker; called on the device thread only
        self.send_later = send_later  # the device thread's `post`
        self.timeout_s = timeout_s
        self.tickets = itertools.count(1)

    def post(self, kind: str, src: list[int], dst: list[int]) -> int:
        return self._post(kind, tuple(src), tuple(dst))

    def post_state(self, kind: str, slot: int) -> int:
        """"save_state": each worker copies its part of state slot `slot` to its mirror;
        "load_state": from its mirror into the slot."""
        return self._post(kind, slot)

    def _post(self, kind: str, *args: object) -> int:
        ticket = next(self.tickets)
        message = ("copy", kind, *args, ticket)
        self.send_later(lambda: self.send(message))
        return ticket

    def wait(self, ticket: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while int(self.done[1:].min()) < ticket:
            self.alive()
            if self.stopped():
                raise RuntimeError(f"tensor-parallel workers stopped before host copy {ticket} finished")
            if time.monotonic() > deadline:
                raise TimeoutError(f"host copy {ticket} not finished by every rank in {self.timeout_s} s")
            time.sleep(POLL_S)


class RankStateBytes(StateBytes):
    """A state slot for storage as every rank's part of it, rank order. The workers' parts
    go through their state mirrors (shared memory, one row per slot): a read posts
    "save_state" when the node's copy starts and reads the mirrors once it is done; a
    write fills the mirrors and `commit` posts "load_state", which the workers run before
    any step that reads the slot. NOTE: the mirrors cost every worker a host copy of its
    state pool."""

    def __init__(self, states: StatePool, mirrors: tuple[torch.Tensor, ...], ranks: RankCopies) -> None:
        super().__init__(states)
        self.mirrors = mirrors
        self.ranks = ranks

    @property
    def layout(self) -> str:
        return f"{super().layout}.tp{1 + len(self.mirrors)}"

    @property
    def size(self) -> int:
        return self.states.bytes_per_slot * (1 + len(self.mirrors))

    def reader(self, slot: int) -> Callable[[], bytes]:
        own = super().reader(slot)
        ticket = self.ranks.post_state("save_state", slot)

        def read() -> bytes:
            self.ranks.wait(ticket)
            return b"".join([own(), *(m[slot].numpy().tobytes() for m in self.mirrors)])

        return read

    def write(self, slot: int, data: bytes) -> None:
        if len(data) != self.size:
            raise ValueError(f"a state slot of {1 + len(self.mirrors)} ranks needs {self.size} bytes, got {len(data)}")
        view, step = memoryview(data), self.states.bytes_per_slot
        slot_from_bytes(self.states.tensors(), slot, view[:step], step)
        for i, mirror in enumerate(self.mirrors, start=1):
            mirror[slot].copy_(torch.frombuffer(bytearray(view[i * step : (i + 1) * step]), dtype=torch.uint8))

    def commit(self, slot: int) -> None:
        self.ranks.post_state("load_state", slot)


class WorkerCopies:
    """A worker's side: run rank 0's copy on this rank's pools, then mark it done."""

    def __init__(self, kv_pool: KVPool, states: StatePool | None, share: HostShare, rank: int, size: int) -> None:
        self.kv_pool = kv_pool
        self.states = states
        self.rank = rank
        layout: Layout = "page_first" if share.layout == "page_first" else "layer_first"
        _, heads, head_dim = kv_pool.k[0].shape
        shape = HostPool.shape_of(len(kv_pool.k), share.num_pages, kv_pool.page_size, heads, head_dim, layout)
        self.host = HostPool.like(kv_pool, share.num_pages, layout,
                                  data=map_shared(share.paths[rank - 1], shape, kv_pool.k[0].dtype))
        self.done = map_shared(share.done_path, (size,), torch.int64)
        self.mirror = map_shared(share.state_paths[rank - 1], share.state_shape, torch.uint8) if share.state_paths else None

    def run(self, kind: str, *args: Any) -> None:
        *payload, ticket = args
        if kind == "offload":
            offload(self.kv_pool, payload[0], self.host, payload[1])
        elif kind == "load":
            load_back(self.host, payload[0], self.kv_pool, payload[1])
        else:
            self._state(kind, payload[0])
        self.done[self.rank] = ticket

    def _state(self, kind: str, slot: int) -> None:
        assert self.states is not None and self.mirror is not None, f"{kind} on a rank without state mirrors"
        tensors = self.states.tensors()
        if kind == "save_state":
            self.mirror[slot].copy_(torch.frombuffer(bytearray(slot_to_bytes(tensors, slot)), dtype=torch.uint8))
        else:
            slot_from_bytes(tensors, slot, self.mirror[slot].numpy().tobytes(), self.states.bytes_per_slot)
