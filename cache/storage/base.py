"""The storage tier's interface: pages of bytes by key, below the host pool.

A backend stores opaque page payloads under storage keys (`cache.storage.keys`: fixed
length hex, one key names a whole prefix). It never knows tokens or requests.

Contract shared by every backend:
- **Synchronous and thread-safe.** The engine calls backends from an executor (file or
  network I/O never runs on the event loop), possibly from several worker threads at
  once; a backend serializes what it must itself. Slowness is the caller's concern: it
  wraps calls in timeouts and treats a late page as missing.
- **A bad page is a miss, never an exception.** Missing, truncated or corrupt pages come
  back as None and are counted by reason; a failed write writes fewer pages and leaves
  nothing torn behind. A page that does not verify is recomputed, never served.
- **A malformed key raises ValueError** (a caller's bug, not a storage fault), before
  anything is read or written.
- **Configuration errors raise StorageError** at construction (bad directory, bad size).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

# Why a page was not served, or not kept. `missing`: not stored (or vanished);
# `truncated`: shorter than its header says; `corrupt`: bad magic/version/key/checksum;
# `write_error`: a write failed (ENOSPC, EIO, a page larger than the whole budget);
# `evicted`: dropped to stay within the size budget; `unavailable`: the backend could not
# be reached at all (a networked store that is down or too slow).
FAILURE_REASONS: tuple[str, ...] = ("missing", "truncated", "corrupt", "write_error", "evicted", "unavailable")


# Reasons that say the backend is not working (rather than that one page is bad).
OUTAGE_REASONS: tuple[str, ...] = ("write_error", "unavailable")

_this_thread = threading.local()


def outages_in_this_thread() -> int:
    """How many outage failures (OUTAGE_REASONS) StorageCounters counted on the calling
    thread so far: compare before and after one backend call to know whether *that* call
    met an outage, whatever other threads' calls met meanwhile."""
    return int(getattr(_this_thread, "outages", 0))


class StorageError(RuntimeError):
    """A backend cannot be set up as configured (not a directory, not writable, bad size)."""


@dataclass(slots=True)
class StorageCounters:
    """Cumulative counters behind `stats()`; not locked: the owning backend holds its lock.

    `hits`/`misses` count pages asked for by `get_pages`; every miss also counts one
    failure reason (`missing`, `truncated` or `corrupt`). Counters survive `clear()`:
    they are monotonic, as metrics expect.
    """

    hits: int = 0
    misses: int = 0
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_REASONS, 0))

    def fail(self, reason: str, n: int = 1) -> None:
        if reason not in self.failures:
            raise ValueError(f"unknown failure reason {reason!r}; known: {list(FAILURE_REASONS)}")
        self.failures[reason] += n
        if reason in OUTAGE_REASONS:
            _this_thread.outages = outages_in_this_thread() + n

    def miss(self, reason: str) -> None:
        self.misses += 1
        self.fail(reason)

    def snapshot(self, pages: int, nbytes: int) -> dict[str, Any]:
        """The `stats()` dict: a copy, safe to hand to another thread."""
        return {
            "pages": pages,
            "bytes": nbytes,
            "hits": self.hits,
            "misses": self.misses,
            "failures": dict(self.failures),
        }


class StorageBackend(ABC):
    """Pages of bytes by storage key. See the module docstring for the shared contract."""

    # Whether `stats()` is cheap enough to call on the event loop for every metrics
    # scrape (an in-memory index); False (a server round trip) makes the engine refresh
    # it in the background instead.
    cheap_stats: ClassVar[bool] = True

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> StorageBackend:
        """Build from the engine's `hicache` settings (a plain dict of every field); each
        backend reads the ones it needs. The default takes none. Raises StorageError."""
        return cls()

    @abstractmethod
    def exists_prefix(self, keys: Sequence[str]) -> int:
        """How many leading `keys` are stored: a prefix length in pages, stopping at the
        first missing key (later keys are not looked at).

        Changes nothing: no recency update, no hit/miss counts (a probe before a fetch
        must not skew LRU or hit rates). A cheap index check: a page counted here can
        still fail verification in `get_pages`.
        """

    @abstractmethod
    def get_pages(self, keys: Sequence[str]) -> list[bytes | None]:
        """The payload of each key, in order; None for a missing, truncated or corrupt page.

        Changes: each served page becomes most recently used; a page that fails
        verification is deleted; hits, misses and failure reasons are counted. Never
        raises for a bad page (ValueError only for a malformed key).
        """

    @abstractmethod
    def set_pages(self, items: Sequence[tuple[str, bytes]]) -> int:
        """Store `(key, payload)` pairs; returns how many are stored when it returns.

        Changes: new pages are written whole or not at all (a full disk or write error
        writes fewer, counts `write_error`, and never leaves a torn page under a key);
        a key already present only becomes most recently used (a key names its content,
        so it is not rewritten); least recently used pages may be evicted to stay within
        the backend's size budget.
        """

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> int:
        """Remove these pages if present; returns how many were removed. Counts nothing."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every page this backend stores. Counters keep counting (monotonic)."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """A snapshot: `pages`, `bytes` (stored, headers included), `hits`, `misses` and
        `failures` (a dict by reason, every key of FAILURE_REASONS present). Changes nothing."""

    def close(self) -> None:
        """Release resources (connections, handles). The default has none to release."""
