"""The `redis` storage backend against a real redis-server (installed by the test script
if missing): round trips, prefix probes, bad values never served, a dead Redis is a miss
(never an exception), and two clients — two server processes — share one tier."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from cache.storage.keys import PageFormat, page_keys
from kernel import registry
from plugins.storage.redis_backend import RedisBackend
from tests.redis_server import RedisServer, redis_server

FORMAT = PageFormat("tiny", "layer_first", "float32", 4, 2, 2, 8)


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with redis_server() as srv:
        yield srv


@pytest.fixture
def backend(server: RedisServer) -> Iterator[RedisBackend]:
    b = RedisBackend(server.url, prefix="test:")
    b.clear()
    yield b
    b.close()


def keys(n: int, seed: int = 0) -> list[str]:
    return page_keys([seed * 1000 + i for i in range(4 * n)], FORMAT)


def test_registered_and_round_trips(backend: RedisBackend) -> None:
    assert registry.lookup("storage", "redis") is RedisBackend
    ks = keys(4)
    pages = [bytes([i]) * (100 + i) for i in range(4)]
    assert backend.set_pages(list(zip(ks, pages))) == 4
    assert backend.get_pages(ks) == pages
    assert backend.exists_prefix(ks) == 4
    stats = backend.stats()
    assert stats["pages"] == 4 and stats["hits"] == 4 and stats["misses"] == 0


def test_exists_prefix_stops_at_the_first_gap(backend: RedisBackend) -> None:
    ks = keys(5, seed=1)
    backend.set_pages([(k, b"x") for i, k in enumerate(ks) if i != 2])
    assert backend.exists_prefix(ks) == 2
    assert backend.get_pages(ks)[2] is None and backend.stats()["failures"]["missing"] == 1


def test_bad_values_are_misses_deleted_and_counted(backend: RedisBackend, server: RedisServer) -> None:
    import redis

    ks = keys(3, seed=2)
    backend.set_pages([(k, b"payload" * 10) for k in ks])
    raw = redis.Redis.from_url(server.url)
    blob = raw.get("test:" + ks[0])
    assert blob is not None
    raw.set("test:" + ks[0], blob[:-3])  # truncated
    flipped = bytearray(blob)
    flipped[-1] ^= 1
    raw.set("test:" + ks[1], bytes(flipped))  # corrupt
    other = keys(1, seed=9)[0]
    backend.set_pages([(other, b"another prefix's page")])
    raw.set("test:" + ks[2], raw.get("test:" + other) or b"")  # a valid page of another key
    got = backend.get_pages(ks)
    assert got == [None, None, None]
    failures = backend.stats()["failures"]
    assert failures["truncated"] == 1 and failures["corrupt"] == 2
    assert raw.exists(*("test:" + k for k in ks)) == 0  # deleted, never served again
    raw.close()


def test_red_without_verification_a_corrupt_value_is_served(
    backend: RedisBackend, server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    import plugins.storage.redis_backend as mod

    k = keys(1, seed=3)[0]
    backend.set_pages([(k, b"good bytes")])
    raw = redis.Redis.from_url(server.url)
    blob = raw.get("test:" + k)
    assert blob is not None
    raw.set("test:" + k, blob[:-1] + bytes([blob[-1] ^ 1]))
    monkeypatch.setattr(mod, "decode_page", lambda key, data: (data[48:], None))  # planted: no checks
    assert backend.get_pages([k]) != [None]
    raw.close()


def test_two_processes_share_one_tier(server: RedisServer) -> None:
    writer, reader = RedisBackend(server.url, prefix="shared:"), RedisBackend(server.url, prefix="shared:")
    try:
        ks = keys(3, seed=4)
        writer.set_pages([(k, k.encode()) for k in ks])
        assert reader.exists_prefix(ks) == 3
        assert reader.get_pages(ks) == [k.encode() for k in ks]
    finally:
        writer.clear()
        writer.close()
        reader.close()


def test_a_dead_redis_is_a_miss_never_an_exception() -> None:
    with redis_server() as srv:
        backend = RedisBackend(srv.url, prefix="dead:", timeout_s=0.5)
        ks = keys(2, seed=5)
        backend.set_pages([(k, b"x") for k in ks])
        srv.kill()
        assert backend.get_pages(ks) == [None, None]
        assert backend.exists_prefix(ks) == 0
        assert backend.set_pages([(ks[0], b"y")]) == 0
        failures = backend.stats()["failures"]
        assert failures["unavailable"] >= 2 and failures["write_error"] == 1
        backend.close()


def test_stats_counts_pages_in_few_round_trips(
    backend: RedisBackend, server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`/server_info` and every `/metrics` scrape call `stats()` on the event loop, so its
    SCAN must not cost a round trip per page (it did: one STRLEN each, seconds of a
    blocked loop for a few ten thousand pages)."""
    import redis

    n = 3000
    raw = redis.Redis.from_url(server.url)
    pipe = raw.pipeline(transaction=False)
    for i in range(n):
        pipe.set(f"test:{i:040x}", b"v" * (10 + i % 7))
    pipe.execute()
    raw.set("other:key", b"not ours")
    sends = 0
    real = redis.connection.Connection.send_packed_command

    def counted(self: Any, *args: Any, **kw: Any) -> None:
        nonlocal sends
        sends += 1
        real(self, *args, **kw)

    monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counted)
    stats = backend.stats()
    assert stats["pages"] == n and stats["bytes"] == sum(10 + i % 7 for i in range(n))
    assert sends <= 4 * (n // 1000 + 2), sends  # a SCAN and a pipeline per batch, not n calls
    raw.delete("other:key")
