"""Hybrid states in storage as a second server sees them, with the `file` backend and with
a real Redis (tests/redis_server.py). Deterministic mode.

A first engine computes PROMPT (its pages and its state after 32 tokens go to storage)
and shuts down; the stored state blob may then be damaged in place — a flipped bit, or
cut short; a second, fresh engine on the same storage runs PROMPT:
- intact (Redis): it resumes from the stored state, a storage hit of 32 tokens;
- damaged: the backend's check finds it (counted by reason: `corrupt`, `truncated`), the
  fetch is dropped whole (`empty`: its pages are useless without the state after them)
  and PROMPT is recomputed, never served from the bad state.
Either way tokens and logprobs are `==` the first engine's cold run.

Revert-then-red, caught by the bit-exact guard: the fill keeps its pages when the state
after them did not come back (the fetch's fresh slot is served as their state), and a
state stored one checkpoint early (Redis).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cache.kv_events import page_hashes
from cache.storage import keys_for_hashes
from kernel import Engine
from tests import leaks
from tests.conftest import HYBRID_OVERRIDES
from tests.redis_server import RedisServer, redis_server
from tests.test_bit_exact_hybrid import assert_bit_exact
from tests.test_host_tier_hybrid import run, tiers
from tests.test_storage_tier_hybrid import plant_state_one_checkpoint_early
from tests.test_tier_combos_hybrid import GREEDY, HIT, PROMPT, make_tiered

PAGE = int(HYBRID_OVERRIDES["cache.page_size"])  # type: ignore[call-overload]
REDIS_PREFIX = "tierserve:kv:"  # the backend's default


@dataclass
class Store:
    """A storage backend's raw bytes, past the backend: where a test damages a blob."""

    settings: dict[str, Any]  # engine overrides that select it
    get: Callable[[str], bytes]
    put: Callable[[str, bytes], None]


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[RedisServer]:
    with redis_server() as srv:
        yield srv


def open_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Store:
    if kind == "file":
        def path(key: str) -> Path:  # the file backend's layout
            return tmp_path / key[:2] / key

        def write(key: str, blob: bytes) -> None:
            path(key).write_bytes(blob)

        return Store({"hicache.storage": "file"}, lambda k: path(k).read_bytes(), write)
    import redis

    srv: RedisServer = request.getfixturevalue("redis_srv")
    raw = redis.Redis.from_url(srv.url)
    raw.flushall()  # every test starts from an empty Redis
    request.addfinalizer(raw.close)

    def get(key: str) -> bytes:
        blob = raw.get(REDIS_PREFIX + key)
        assert isinstance(blob, bytes), f"no value under {key}"
        return blob

    def put(key: str, blob: bytes) -> None:
        raw.set(REDIS_PREFIX + key, blob)

    return Store({"hicache.storage": "redis", "hicache.redis_url": srv.url}, get, put)


DAMAGES: dict[str, Callable[[bytes], bytes]] = {
    "corrupt": lambda blob: blob[:-1] + bytes([blob[-1] ^ 0x10]),  # a bit of the recurrent state
    "truncated": lambda blob: blob[:-7],
}


def state_key(engine: Engine) -> str:
    """The storage key of PROMPT's state after HIT tokens."""
    storage = engine.engine.storage
    assert storage is not None and storage.state_fmt is not None
    return keys_for_hashes([page_hashes(PROMPT, PAGE)[HIT // PAGE - 1]], storage.state_fmt)[0]


def second_server(folder: str, store: Store, tmp_path: Path, damage: str | None, planted: bool = False) -> None:
    first = make_tiered(folder, tmp_path, **store.settings)
    try:
        ref = run(first, PROMPT, GREEDY)
        assert ref["meta_info"]["cached_tokens"] == 0
        key = state_key(first)
        assert first.flush_cache()  # host copies and storage writes settled
    finally:
        first.shutdown()
    if damage is not None:
        store.put(key, DAMAGES[damage](store.get(key)))
    second = make_tiered(folder, tmp_path, **store.settings)
    try:
        warm = run(second, PROMPT, GREEDY)
        assert_bit_exact(warm, ref)
        storage = second.engine.storage
        assert storage is not None
        backend, counters = storage.backend.stats(), storage.counters
        if damage is None:
            assert tiers(warm) == {"device": 0, "host": 0, "storage": HIT}, tiers(warm)
            assert backend["hits"] == HIT // PAGE + 1, backend  # the pages, then the state
            return
        assert warm["meta_info"]["cached_tokens"] == 0, f"a {damage} state was served: {tiers(warm)}"
        assert backend["failures"][damage] == 1, backend["failures"]
        assert counters.prefetch["issued"] == counters.prefetch["empty"] == 1, counters.prefetch
        assert counters.read_pages == 0
    finally:
        if planted:
            leaks.excuse(second.engine)
        second.shutdown()


@pytest.mark.parametrize(("kind", "damage"), [
    ("file", "corrupt"), ("file", "truncated"), ("redis", None), ("redis", "corrupt"), ("redis", "truncated"),
])
def test_a_second_server_reads_hybrid_states(
    hybrid_folders: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest, kind: str, damage: str | None
) -> None:
    second_server(hybrid_folders["qwen3_5_text"], open_store(kind, tmp_path, request), tmp_path, damage)


# ---- revert-then-red ------------------------------------------------------------
def plant_fill_keeps_pages_without_their_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fill's all-or-nothing rule dropped: when the state after the pages did not
    come back, the pages are kept anyway, with the fetch's slot (never written) as their state."""
    import kernel.tiers.storage_tier as storage_mod

    real = storage_mod.fill

    def pages_kept(backend: Any, host_pool: Any, states: Any, keys: list[str], host: list[int],
                   key: str | None, slot: int | None) -> tuple[int, int]:
        filled, bad = real(backend, host_pool, states, keys, host, key, slot)
        if filled == 0 and key is not None:
            return real(backend, host_pool, states, keys, host, None, None)  # planted
        return filled, bad

    monkeypatch.setattr(storage_mod, "fill", pages_kept)


PLANTS: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], str, str | None]] = {
    "file-corrupt-fill_keeps_pages": (plant_fill_keeps_pages_without_their_state, "file", "corrupt"),
    "redis-truncated-fill_keeps_pages": (plant_fill_keeps_pages_without_their_state, "redis", "truncated"),
    "redis-state_one_checkpoint_early": (plant_state_one_checkpoint_early, "redis", None),
}


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_red_a_bad_state_served(
    hybrid_folders: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch, name: str,
) -> None:
    plant, kind, damage = PLANTS[name]
    store = open_store(kind, tmp_path, request)
    plant(monkeypatch)
    with pytest.raises(AssertionError, match="^bit-exact guard"):
        second_server(hybrid_folders["qwen3_5_text"], store, tmp_path, damage, planted=True)
