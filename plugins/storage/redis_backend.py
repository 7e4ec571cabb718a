"""`redis` storage backend: one Redis (or a cluster proxy) shared by many server processes
and machines — the step toward many replicas reusing one another's prefixes.

Pages are stored under `<prefix><key>` (the key is a fixed-length hex storage key, never
request text) in the `file` backend's page format (cache/storage/page_file.py: magic,
version, key, length, checksum), so a value that does not verify — truncated, corrupt,
or another key's — is a miss, deleted and counted, never served. `SET NX`: a key names
its content, so a present page is never rewritten. Capacity and eviction are the Redis
server's (`maxmemory` + `maxmemory-policy allkeys-lru`). A Redis that is down or slower
than `timeout_s` makes every page of the call a miss counted as `unavailable`; the
backend never raises for it.

`redis` is an optional dependency (`pip install 'tierserve[redis]'`): it is imported when a
backend is constructed, so discovering the storage handlers never needs it, and a missing
package fails the start-up with a message naming the extra.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cache.storage.base import StorageBackend, StorageCounters, StorageError
from cache.storage.keys import validate_key
from cache.storage.page_file import decode_page, encode_page
from kernel.registry import optional_module, register

if TYPE_CHECKING:
    import redis


@register("storage", "redis")
class RedisBackend(StorageBackend):
    cheap_stats = False  # pages/bytes come from a SCAN of the server
    def __init__(self, redis_url: str, prefix: str = "tierserve:kv:", timeout_s: float = 1.0) -> None:
        if not redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise StorageError(f"redis_url must be redis://, rediss:// or unix://, got {redis_url!r}")
        client = optional_module("redis", "hicache.storage: redis")
        self.prefix = prefix
        # A server that is down or slower than timeout_s: every page of the call is a miss.
        self._down: tuple[type[Exception], ...] = (client.ConnectionError, client.TimeoutError)
        # The client pool is thread-safe; counters are ours to lock.
        self._client: redis.Redis = client.Redis.from_url(
            redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._lock = threading.Lock()
        self._counters = StorageCounters()

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> RedisBackend:
        """`hicache.redis_url`; a call slower than `hicache.storage_timeout_s` counts as down."""
        return cls(str(options["redis_url"]), timeout_s=float(options["storage_timeout_s"]))

    def _name(self, key: str) -> str:
        return self.prefix + validate_key(key)

    def exists_prefix(self, keys: Sequence[str]) -> int:
        names = [self._name(k) for k in keys]
        if not names:
            return 0
        try:
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            present = pipe.execute()
        except self._down:
            self._fail("unavailable", 0)
            return 0
        count = 0
        for found in present:
            if not found:
                break
            count += 1
        return count

    def get_pages(self, keys: Sequence[str]) -> list[bytes | None]:
        names = [self._name(k) for k in keys]
        if not names:
            return []
        try:
            blobs: list[bytes | None] = self._client.mget(names)  # type: ignore[assignment]
        except self._down:
            self._miss_all("unavailable", len(names))
            return [None] * len(names)
        out: list[bytes | None] = []
        bad: list[str] = []
        for key, name, blob in zip(keys, names, blobs):
            payload, reason = (None, "missing") if blob is None else decode_page(key, blob)
            with self._lock:
                if payload is None:
                    self._counters.miss(reason or "corrupt")
                else:
                    self._counters.hits += 1
            if payload is None and blob is not None:
                bad.append(name)
            out.append(payload)
        if bad:
            self._delete_names(bad)
        return out

    def set_pages(self, items: Sequence[tuple[str, bytes]]) -> int:
        named = [(self._name(k), encode_page(k, payload)) for k, payload in items]
        if not named:
            return 0
        try:
            pipe = self._client.pipeline(transaction=False)
            for name, blob in named:
                pipe.set(name, blob, nx=True)
            pipe.execute()
        except self._down:
            self._fail("write_error", len(named))
            return 0
        return len(named)  # NX: a page already there counts as stored

    def delete(self, keys: Sequence[str]) -> int:
        return self._delete_names([self._name(k) for k in keys])

    def clear(self) -> None:
        try:
            names = list(self._client.scan_iter(match=self.prefix + "*", count=1000))
        except self._down:
            self._fail("unavailable", 1)
            return
        self._delete_names(names)

    def stats(self) -> dict[str, Any]:
        """Counters of this process; `pages`/`bytes` are what the server holds under the
        prefix (a SCAN: an admin action, not for every step). Each SCAN batch's sizes
        come in one pipelined round trip: `/server_info` and `/metrics` call this on the
        event loop."""
        pages = nbytes = 0
        try:
            cursor = 0
            while True:
                cursor, names = self._client.scan(cursor, match=self.prefix + "*", count=1000)
                if names:
                    pipe = self._client.pipeline(transaction=False)
                    for name in names:
                        pipe.strlen(name)
                    pages += len(names)
                    nbytes += sum(int(n) for n in pipe.execute())
                if not cursor:
                    break
        except self._down:
            pass
        with self._lock:
            return self._counters.snapshot(pages, nbytes)

    def close(self) -> None:
        self._client.close()

    def _delete_names(self, names: Sequence[Any]) -> int:
        if not names:
            return 0
        try:
            return int(self._client.delete(*names))
        except self._down:
            self._fail("unavailable", 0)
            return 0

    def _fail(self, reason: str, n: int) -> None:
        with self._lock:
            self._counters.fail(reason, max(n, 1))

    def _miss_all(self, reason: str, n: int) -> None:
        with self._lock:
            for _ in range(n):
                self._counters.miss(reason)
