"""KV events on ZMQ in vLLM's wire format, for KV-aware routers (`kv_events.publisher: zmq`).

What the prefix cache publishes (cache/kv_events.py: pages as blocks, chained hashes a
client recomputes from token ids) leaves the process as vLLM's publisher sends it:

- PUB socket (an XPUB) at `kv_events.endpoint`, multipart `[topic, seq, payload]`: `seq` an 8-byte
  big-endian count from 0 (a restart starts again at 0, visibly), `payload` a msgpack
  `KVEventBatch` as vLLM's msgspec structs encode it: the batch a positional array
  `[ts, [event, ...], data_parallel_rank]`, each event a map tagged under "type":
  `{"type": "BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium, lora_name}`, `{"type": "BlockRemoved", block_hashes, medium}`,
  `{"type": "AllBlocksCleared"}` (vllm-router 0.1.17 decodes exactly this; it rejects
  positional events: "KV event must be a tagged map").
- `medium` names the tier: "device" or "host" on `BlockStored`; on `BlockRemoved`, the
  copy that left ("device": still matchable from its host copy; "host": the device copy
  stays) or null when the block left the cache entirely.
- ROUTER socket at `kv_events.replay_endpoint` (optional): a request `[start seq]`
  (8 bytes, big-endian) is answered with `[topic, seq, payload]` for each kept batch from
  there on (the last `kv_events.buffer`), framed like the live ones, then
  `[topic, -1 (8 bytes, signed), b""]`. NOTE: the topic frame is what vllm-router reads
  (seq second from last, at least four frames with the delimiter); a reply without it
  is ignored there, and the router's index stays missing the batches of a gap (found
  with vllm-router 0.1.17: tests/test_routers_e2e.py plants the old framing).

- A new subscription (a router started, or restarted, after the replica: its SUB socket
  joins with nothing known) is answered on the PUB stream by a snapshot batch:
  `AllBlocksCleared`, then a `BlockStored` for every cached block (device, and "host" for
  a host copy), parents first, under the next seq like any batch. A router that joined
  late would otherwise know only blocks stored after it (vllm-router asks the replay
  socket only for a gap in seq, never on its own start). NOTE: every subscriber gets it;
  for one already following, clearing and storing the same blocks leaves its view as it was.
  A batch queued before the subscription may reach the new subscriber ahead of its snapshot
  (this socket thread sends it after ZMQ registered the subscription); the snapshot, taken
  later on the event loop, holds what that batch said, and its AllBlocksCleared supersedes it.

Hybrid trees' StateStored / StateRemoved have no place in vLLM's schema and are not sent.
The cache calls `publish` on the event loop; encoding happens there (cheap), the sockets
live on one thread of their own (ZMQ sockets are not thread-safe).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog

from cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kernel.config import KvEventsConfig
from kernel.registry import optional_module

log = structlog.get_logger("tierserve")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_MS = 10  # how long queued events may wait while the sockets are polled


def event_row(event: KVEvent) -> dict[str, Any] | None:
    """One event as vLLM's tagged map; None for events outside its schema."""
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": event.block_hashes, "parent_block_hash": event.parent_block_hash,
                "token_ids": event.token_ids, "block_size": event.block_size, "lora_id": event.lora_id,
                "medium": event.medium or "device", "lora_name": None}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    return None


class ZmqKvPublisher:
    """Started once the engine runs; `close()` stops the thread and closes the sockets.
    `on_subscribe` is called on the socket thread when a subscriber joins (start_kv_events
    has it publish a snapshot from the event loop)."""

    def __init__(self, config: KvEventsConfig, on_subscribe: Callable[[], None] | None = None) -> None:
        self.zmq = optional_module("zmq", "kv_events.publisher: zmq")
        self.msgpack = optional_module("msgspec", "kv_events.publisher: zmq").msgpack.Encoder()
        self.config = config
        self.on_subscribe = on_subscribe
        self.seq = 0
        self._out: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="tierserve-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:  # the endpoint could not be bound: a start-up error
            raise self._error

    def publish(self, events: list[KVEvent]) -> None:
        rows = [r for r in (event_row(e) for e in events) if r is not None]
        if rows:
            self._out.put(self.msgpack.encode([time.time(), rows, None]))

    def close(self) -> None:
        self._out.put(None)
        self._thread.join(timeout=5)

    def _main(self) -> None:
        ctx = self.zmq.Context()
        pub = replay = None
        try:
            pub = ctx.socket(self.zmq.XPUB)
            pub.setsockopt(self.zmq.XPUB_VERBOSE, 1)  # every subscription, not only a topic's first
            pub.bind(self.config.endpoint)
            if self.config.replay_endpoint:
                replay = ctx.socket(self.zmq.ROUTER)
                replay.bind(self.config.replay_endpoint)
        except Exception as exc:  # noqa: BLE001 - reported to the constructor
            self._error = exc
        self._ready.set()
        if self._error is None:
            self._serve(pub, replay)
        for sock in (pub, replay):
            if sock is not None:
                sock.close(linger=0)
        ctx.term()

    def _serve(self, pub: Any, replay: Any) -> None:
        topic = self.config.topic.encode("utf-8")
        kept: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer)
        poller = self.zmq.Poller()
        poller.register(pub, self.zmq.POLLIN)
        if replay is not None:
            poller.register(replay, self.zmq.POLLIN)
        while True:
            try:
                payload = self._out.get_nowait()
            except queue.Empty:
                payload = b""
            if payload is None:
                return
            if payload:
                seq = self.seq.to_bytes(8, "big")
                self._send(pub, (topic, seq, payload))
                kept.append((self.seq, payload))
                self.seq += 1
                continue
            ready = dict(poller.poll(POLL_MS))
            if pub in ready:
                self._joined(pub)
            if replay is not None and replay in ready:
                self._answer(replay, kept)

    def _send(self, pub: Any, frames: tuple[bytes, bytes, bytes]) -> None:
        pub.send_multipart(frames)

    def _joined(self, pub: Any) -> None:
        """A (un)subscription message: byte 1 then the topic prefix on joining, 0 on leaving."""
        message = pub.recv()
        if message[:1] == b"\x01" and self.on_subscribe is not None:
            self.on_subscribe()

    def _answer(self, replay: Any, kept: deque[tuple[int, bytes]]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            log.warning("kv_events_replay_bad_request", frames=len(frames))
            return
        client, empty, start = frames
        topic = self.config.topic.encode("utf-8")
        first = int.from_bytes(start, "big")
        for seq, payload in list(kept):
            if seq >= first:
                replay.send_multipart((client, empty, topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, empty, topic, END_SEQ, b""))


def start_kv_events(config: KvEventsConfig, subscribe: Any,
                    snapshot: Callable[[], list[KVEvent]] | None = None) -> ZmqKvPublisher | None:
    """The publisher `config` asks for, following the cache through `subscribe`
    (`AsyncEngine.subscribe_kv_events`), answering each new subscriber with `snapshot()`
    (`AsyncEngine.kv_snapshot_events`) taken on the running event loop; None when off.
    Raises when the endpoint cannot be bound or there is no prefix cache to follow (a
    start-up error, exit 1)."""
    if config.publisher == "none":
        return None
    on_subscribe = None
    if snapshot is not None:
        loop = asyncio.get_running_loop()

        def on_subscribe() -> None:  # the socket thread: the cache is read on the loop
            loop.call_soon_threadsafe(lambda: publisher.publish(snapshot()))

    publisher = ZmqKvPublisher(config, on_subscribe)
    if subscribe(publisher.publish) is None:
        publisher.close()
        raise ValueError("kv_events.publisher: zmq needs a prefix cache (cache.prefix: radix)")
    log.info("kv_events_publishing", endpoint=config.endpoint, replay=config.replay_endpoint, topic=config.topic)
    return publisher
