"""KV events on ZMQ (plugins/kv_events_zmq.py), read the way a vLLM subscriber reads them:
msgspec structs declared as vLLM declares its KVEventBatch (the batch array-like, each
event a map tagged by its type name under "type"), a SUB socket on the topic, a DEALER on
the replay socket."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq

from cache.kv_events import AllBlocksCleared as CacheAllBlocksCleared
from cache.kv_events import BlockRemoved as CacheBlockRemoved
from cache.kv_events import page_hashes
from kernel import Engine
from kernel.config import KvEventsConfig
from plugins.kv_events_zmq import END_SEQ, ZmqKvPublisher, start_kv_events
from tests.conftest import TINY_OVERRIDES
from tests.test_http_fixtures import free_port


class BlockStored(msgspec.Struct, omit_defaults=True, tag=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, omit_defaults=True, tag=True):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
PAGE = TINY_OVERRIDES["cache.page_size"]


def close_all(publisher: Any, sub: Any, ctx: Any, engine: Engine) -> None:
    publisher.close()
    sub.close(linger=0)
    ctx.term()
    engine.shutdown()


def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def receive(sub: Any, until: float) -> list[tuple[bytes, int, KVEventBatch]]:
    got = []
    while time.monotonic() < until and sub.poll(100):
        topic, seq, payload = sub.recv_multipart()
        got.append((topic, int.from_bytes(seq, "big"), DECODER.decode(payload)))
    return got


def test_published_batches_decode_as_vllm_reads_them(tiny_chat_folder: str) -> None:
    pub_at, replay_at = endpoints()
    config = KvEventsConfig(publisher="zmq", endpoint=pub_at, replay_endpoint=replay_at, topic="kv@w1")
    engine = Engine(None, {"model.path": tiny_chat_folder, **TINY_OVERRIDES, "cache.prefix": "radix"})
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub_at)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@w1")
    publisher = start_kv_events(config, engine.engine.subscribe_kv_events)
    assert publisher is not None
    try:
        time.sleep(0.3)  # a SUB socket misses what is sent before it has joined
        prompt = list(range(100, 123))
        engine.generate(prompt, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert engine.flush_cache()
        got = receive(sub, time.monotonic() + 5)
        assert [g[0] for g in got] == [b"kv@w1"] * len(got) and len(got) >= 2
        assert [g[1] for g in got] == list(range(len(got)))  # from 0, no gaps
        stored = [e for _, _, b in got for e in b.events if isinstance(e, BlockStored)]
        hashes = [h for e in stored for h in e.block_hashes]
        tokens = [t for e in stored for t in e.token_ids]
        expected = page_hashes(prompt, PAGE)  # the prompt's whole pages at least
        assert hashes[: len(expected)] == expected, (hashes, expected)
        assert tokens[: len(expected) * PAGE] == prompt[: len(expected) * PAGE]
        assert all(e.block_size == PAGE and e.medium == "device" for e in stored)
        assert stored[0].parent_block_hash is None
        assert isinstance(got[-1][2].events[-1], AllBlocksCleared)

        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay_at)
        dealer.send_multipart((b"", (1).to_bytes(8, "big")))  # everything from seq 1 on
        replayed = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            _, topic, seq, payload = dealer.recv_multipart()
            assert topic == b"kv@w1"  # framed like a live batch
            if seq == END_SEQ:
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        assert [s for s, _ in replayed] == [g[1] for g in got[1:]]
        assert [b.events for _, b in replayed] == [g[2].events for g in got[1:]]
        dealer.close(linger=0)
    finally:
        close_all(publisher, sub, ctx, engine)


def test_off_taken_endpoint_and_no_prefix_cache(tiny_chat_folder: str) -> None:
    assert start_kv_events(KvEventsConfig(), lambda cb: None) is None
    taken, _ = endpoints()
    first = ZmqKvPublisher(KvEventsConfig(publisher="zmq", endpoint=taken))
    try:
        with pytest.raises(zmq.ZMQError):
            ZmqKvPublisher(KvEventsConfig(publisher="zmq", endpoint=taken))
    finally:
        first.close()
    free, _ = endpoints()
    with pytest.raises(ValueError, match="prefix cache"):
        start_kv_events(KvEventsConfig(publisher="zmq", endpoint=free), lambda cb: None)


def test_red_positional_events_do_not_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: events encoded positionally (array-like), the first version's mistake; vLLM's
    decoder (and vllm-router's: "KV event must be a tagged map") rejects the batch."""
    import plugins.kv_events_zmq as mod
    from cache.kv_events import BlockStored as Stored

    event = Stored(block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(8)), block_size=4)
    good = msgspec.msgpack.encode([1.0, [mod.event_row(event)], None])
    assert DECODER.decode(good).events[0].block_hashes == [11, 12]

    real = mod.event_row

    def positional(e: Any) -> list[Any]:
        return list((real(e) or {}).values())

    monkeypatch.setattr(mod, "event_row", positional)
    bad = msgspec.msgpack.encode([1.0, [mod.event_row(event)], None])
    with pytest.raises(msgspec.ValidationError):
        DECODER.decode(bad)


def published(tiny_chat_folder: str, overrides: dict[str, Any], drive: Any) -> tuple[list[KVEventBatch], Any]:
    """Run `drive(engine)` on a tiny engine with `overrides` while a SUB socket follows its
    published events -> (the batches received, what `drive` returned at idle)."""
    pub_at, _ = endpoints()
    engine = Engine(None, {"model.path": tiny_chat_folder, **TINY_OVERRIDES, "cache.prefix": "radix", **overrides})
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub_at)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    publisher = start_kv_events(KvEventsConfig(publisher="zmq", endpoint=pub_at), engine.engine.subscribe_kv_events)
    assert publisher is not None
    try:
        time.sleep(0.3)  # a SUB socket misses what is sent before it has joined
        result = drive(engine)
        batches = [b for _, _, b in receive(sub, time.monotonic() + 3)]
    finally:
        close_all(publisher, sub, ctx, engine)
    return batches, result


def follow(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch | None = None,
           plant: Any = None) -> tuple[set[int], int, list[str]]:
    """A consumer's view of the device tree after a workload that evicts: the blocks its
    events say are on the device, the device pages /admin/snapshot counts at idle, and what
    the consumer found wrong on the way (a parent it never saw stored)."""
    import plugins.kv_events_zmq as mod

    if plant is not None and monkeypatch is not None:
        monkeypatch.setattr(mod, "event_row", plant(mod.event_row))

    def drive(engine: Engine) -> int:
        for i in range(12):  # shared heads, distinct tails: inserts, hits and evictions
            prompt = [1000 + i % 3] * 8 + list(range(2000 + 50 * i, 2032 + 50 * i))
            engine.generate(prompt, {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        return sum(n["num_pages"] for n in engine.engine.snapshot())

    batches, device_pages = published(tiny_chat_folder, {"cache.num_pages": 48}, drive)
    live: set[int] = set()
    problems = []
    for batch in batches:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if ev.parent_block_hash is not None and ev.parent_block_hash not in live:
                    problems.append(f"parent {ev.parent_block_hash} of {ev.block_hashes[0]} is not cached")
                live.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                live.difference_update(ev.block_hashes)
            else:
                live.clear()
    return live, device_pages, problems


def test_a_consumers_view_equals_the_tree(tiny_chat_folder: str) -> None:
    live, device_pages, problems = follow(tiny_chat_folder)
    assert problems == [] and len(live) == device_pages > 0


def test_red_a_skipped_removal(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def skip_removals(real: Any) -> Any:
        return lambda e: None if isinstance(e, CacheBlockRemoved) else real(e)

    live, device_pages, _ = follow(tiny_chat_folder, monkeypatch, skip_removals)
    assert len(live) > device_pages  # the consumer still believes in evicted blocks


def test_red_a_wrong_parent_hash(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def off_by_one(real: Any) -> Any:
        def row(e: Any) -> Any:
            out = real(e)
            if out is not None and out.get("parent_block_hash") is not None:
                out["parent_block_hash"] += 1
            return out
        return row

    _, _, problems = follow(tiny_chat_folder, monkeypatch, off_by_one)
    assert problems  # a parent the consumer never saw stored


def test_tiers_name_their_medium(tiny_chat_folder: str) -> None:
    """With a host tier and a device pool too small for the workload: host copies are
    published as `BlockStored(medium="host")` and device evictions of blocks that stay
    matchable from host as `BlockRemoved(medium="device")`."""

    def drive(engine: Engine) -> None:
        for i in range(10):
            engine.generate(list(range(3000 + 60 * i, 3040 + 60 * i)), {"max_new_tokens": 4, "temperature": 0})

    batches, _ = published(tiny_chat_folder, {"cache.num_pages": 48, "hicache.host_pages": 256}, drive)
    events = [e for b in batches for e in b.events]
    media = {(type(e).__name__, e.medium) for e in events if not isinstance(e, AllBlocksCleared)}
    assert ("BlockStored", "device") in media and ("BlockStored", "host") in media, media
    assert ("BlockRemoved", "device") in media, media


def late_view(tiny_chat_folder: str) -> tuple[list[KVEventBatch], set[int], set[int], tuple[set[int], set[int]]]:
    """A tiered engine caches prompts (device pages, host copies) while its publisher runs
    with no subscriber; then a SUB socket joins. -> (the batches it got, the device and
    host blocks they say are cached, the tree's own (device, host) blocks at idle)."""
    from tests.test_host_tier import TIERED, settle

    pub_at, _ = endpoints()
    engine = Engine(None, {"model.path": tiny_chat_folder, **TINY_OVERRIDES, **TIERED})
    ae = engine.engine

    async def start() -> Any:  # on the engine's loop, as the server starts it
        return start_kv_events(KvEventsConfig(publisher="zmq", endpoint=pub_at), ae.subscribe_kv_events,
                               ae.kv_snapshot_events)

    publisher = engine._call(start())
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        for i in range(6):
            engine.generate([300 + i] * 6 + list(range(400 + 40 * i, 430 + 40 * i)),
                            {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
            settle(engine)
        tree = ae.scheduler.prefix.cache
        truth = ({h for n in tree.nodes() if n.pages for h in n.hashes},
                 {h for n in tree.nodes() if n.host_pages is not None for h in n.hashes})
        sub.connect(pub_at)
        sub.setsockopt(zmq.SUBSCRIBE, b"")  # joins now: everything before it was sent to no one
        batches = [b for _, _, b in receive(sub, time.monotonic() + 3)]
    finally:
        close_all(publisher, sub, ctx, engine)
    device: set[int] = set()
    host: set[int] = set()
    cleared = False
    for batch in batches:
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                device.clear()
                host.clear()
                cleared = True
            elif isinstance(ev, BlockStored):
                # NOTE: a batch the cache queued before the subscription may still be on its way
                # (the socket thread sends it after the subscriber joined): ahead of the snapshot,
                # whose AllBlocksCleared supersedes it. Parents come first from the snapshot on.
                assert not cleared or ev.parent_block_hash is None or ev.parent_block_hash in device | host, \
                    "a child before its parent"
                (host if ev.medium == "host" else device).update(ev.block_hashes)
    return batches, device, host, truth


def assert_late_view(tiny_chat_folder: str) -> None:
    """The guard: a late subscriber's view of the cache is the tree's."""
    _, device, host, (tree_device, tree_host) = late_view(tiny_chat_folder)
    assert tree_device and tree_host, "the workload left no device block or no host copy"
    assert (device, host) == (tree_device, tree_host), "late-subscriber guard: its view is not the tree"


def test_a_late_subscriber_gets_the_cache_as_a_snapshot(tiny_chat_folder: str) -> None:
    """A router started (or restarted) after the replica: its SUB socket's subscription is
    answered with AllBlocksCleared and every cached block, device and host copies alike."""
    assert_late_view(tiny_chat_folder)


def test_red_no_snapshot_for_a_late_subscriber(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the subscription is not answered (an empty snapshot): the late subscriber
    knows none of the cached blocks, and the guard goes red."""
    from cache.radix_tree import RadixTree

    monkeypatch.setattr(RadixTree, "snapshot_events", lambda self: [])
    with pytest.raises(AssertionError, match="late-subscriber guard"):
        assert_late_view(tiny_chat_folder)


def test_a_restarted_replica_resends_its_cache_to_a_following_router() -> None:
    """A replica restarts at the same endpoint: the follower's SUB socket reconnects and
    subscribes again (ZMQ does that by itself), and the new incarnation answers with its
    own cache (AllBlocksCleared first): the follower drops what the old one had."""
    from cache.kv_events import BlockStored as Stored

    pub_at, _ = endpoints()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RECONNECT_IVL, 50)
    sub.connect(pub_at)
    sub.setsockopt(zmq.SUBSCRIBE, b"")

    def incarnation(blocks: list[int]) -> ZmqKvPublisher:
        holder: list[ZmqKvPublisher] = []

        def answer() -> None:  # what start_kv_events does through the event loop
            holder[0].publish([CacheAllBlocksCleared(),
                               *(Stored([b], None, list(range(PAGE)), PAGE) for b in blocks)])

        holder.append(ZmqKvPublisher(KvEventsConfig(publisher="zmq", endpoint=pub_at), answer))
        return holder[0]

    first = incarnation([11, 12])
    try:
        got = receive(sub, time.monotonic() + 2)
    finally:
        first.close()
    second = incarnation([21])
    try:
        again = receive(sub, time.monotonic() + 3)
    finally:
        second.close()
        sub.close(linger=0)
        ctx.term()
    assert [e.block_hashes for _, _, b in got for e in b.events if isinstance(e, BlockStored)] == [[11], [12]]
    assert again and again[0][1] == 0, "the new incarnation's seq starts again at 0"
    events = again[0][2].events
    assert isinstance(events[0], AllBlocksCleared) and [e.block_hashes for e in events[1:]] == [[21]]
