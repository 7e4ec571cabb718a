"""KV cache events: which pages entered or left the prefix cache, named by chained hashes.

The schema is the one vLLM and SGLang publish (`BlockStored`, `BlockRemoved`,
`AllBlocksCleared`), so a KV-aware router written for them can follow this engine too.
A "block" there is a page here.

Page hashes (stable across processes and Python versions, so a client recomputes them
from the tokens alone):

    page_hash(parent, tokens) = u64_le(blake2b(u64_le(parent) + i64_le(t) for t in tokens,
                                                digest_size=8))

`parent` is the hash of the previous page of the same prompt; for the first page it is
the namespace seed: 0 without a namespace, else
`u64_le(blake2b(b"tierserve.namespace\\0" + namespace.encode("utf-8"), digest_size=8))`.
Hashes are unsigned 64-bit ints. Because each hash folds in its parent, one hash names a
whole prefix, which is also why storage tiers use it as a key. Events carry
`parent_block_hash=None` for a prompt's first page, even inside a namespace: a consumer
that needs namespaces must know them (there is no field for one in the shared schema).

Hybrid trees (attention + linear-attention/SSM layers) add two events of their own,
outside the shared schema, because a cached prefix is only resumable where a state slot
exists: `StateStored(block_hash, num_tokens)` when a node gains a state slot and
`StateRemoved(block_hash)` when it loses one (`evict_states`, or its leaf is evicted).
`block_hash` is the chained hash of the node's last page, so it names the exact prefix
the state covers; `num_tokens` is that prefix's length. In one event batch a
`StateStored` follows the `BlockStored` of its page and a `StateRemoved` precedes the
`BlockRemoved` of its page. `AllBlocksCleared` also clears every state. A router for a
dense model can ignore both; a hash with blocks but no state is a tombstone.

Tiered trees (a host copy per node, cache/radix_host.py) fill in `medium`, which names
the copy an event is about: `medium=None` is the device copy (a `BlockStored` when pages
enter the cache, or come back to the device by `restore` / an `insert` over host-only
nodes) or, on `BlockRemoved`, the block leaving the cache entirely (no copy left: a
removed node, a host-only leaf dropped by `evict_host`, a device-only node's host-only
descendants removed with it). `BlockStored(medium="host")` is a host copy landing:
of device pages (`mark_host`; a device copy exists), or of pages new to the cache that a
storage fetch filled (`insert_host`: a host-only leaf, no device copy, its parent cached
on either tier or the root). `BlockRemoved(medium="device")` is a device eviction
of a block that stays matchable from its host copy; `BlockRemoved(medium="host")` a host
copy evicted while the device copy stays. A `BlockRemoved` then need not be a chain tail:
a device-evicted block may keep host-only children. Trees without a host tier only
publish `medium=None`, as before.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cache.hub import Hub

NAMESPACE_PREFIX = b"tierserve.namespace\x00"


@dataclass(slots=True)
class BlockStored:
    """New pages entered the cache: one hash per page, tokens of all of them in order."""

    block_hashes: list[int]
    parent_block_hash: int | None  # hash of the page before the first new one; None at the root
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None  # kept for schema compatibility; LoRA is not supported
    medium: str | None = None  # vLLM's storage medium; None until tiers publish their own


@dataclass(slots=True)
class BlockRemoved:
    """Pages left the cache (evicted). Always chain tails: only leaves are evicted."""

    block_hashes: list[int] = field(default_factory=list)
    medium: str | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    """The cache was emptied (reset)."""


@dataclass(slots=True)
class StateStored:
    """Hybrid trees: the prefix named by `block_hash` (`num_tokens` long) became resumable."""

    block_hash: int
    num_tokens: int


@dataclass(slots=True)
class StateRemoved:
    """Hybrid trees: the prefix named by `block_hash` is no longer resumable (a tombstone,
    or gone if a `BlockRemoved` of the same hash follows)."""

    block_hash: int


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | StateStored | StateRemoved


def namespace_seed(namespace: str | None) -> int:
    """The parent hash of a prompt's first page."""
    if namespace is None:
        return 0
    digest = hashlib.blake2b(NAMESPACE_PREFIX + namespace.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def page_hash(parent: int, tokens: Sequence[int]) -> int:
    """Hash of one page given its parent's hash (see the module docstring)."""
    data = parent.to_bytes(8, "little") + struct.pack(f"<{len(tokens)}q", *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def chain_hashes(parent: int, tokens: Sequence[int], page_size: int) -> list[int]:
    """Hashes of the whole pages of `tokens`, chained from `parent`."""
    hashes: list[int] = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = page_hash(parent, tokens[start : start + page_size])
        hashes.append(parent)
    return hashes


def page_hashes(tokens: Sequence[int], page_size: int, namespace: str | None = None) -> list[int]:
    """Hashes of the whole pages of a prompt, as the tree reports them in events."""
    return chain_hashes(namespace_seed(namespace), tokens, page_size)


Subscriber = Callable[[list[KVEvent]], None]


class EventHub(Hub[list[KVEvent]]):
    """The tree's KV events: one list of events per cache operation (see cache/hub.py)."""

    def __init__(self, strict: bool = False) -> None:
        super().__init__("kv_events", strict)

    def emit(self, build: Callable[[], list[KVEvent]]) -> None:
        """Build the events only if someone listens, then deliver them."""
        if self.active:
            self.publish(build())
