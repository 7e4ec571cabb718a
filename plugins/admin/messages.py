"""Admin commands that need no per-connection state, and the encoding of pushed events.

Each command takes the engine and the client's message and returns the reply object
(the websocket adds nothing but sends it). Bad arguments raise ProtocolError, which the
caller turns into `{"type": "error", "message": ...}`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from cache.kv_events import KVEvent
from cache.prefix_cache import RadixPrefixCache
from cache.radix_tree import RadixTree
from kernel import registry
from kernel.async_engine import AsyncEngine
from kernel.events import LifecycleEvent

Message = dict[str, Any]
Command = Callable[[AsyncEngine, Message], Message]

POLICY_KINDS = ("evict", "schedule")


class ProtocolError(ValueError):
    """A message the server understood as malformed; the socket stays open."""


def radix_tree(engine: AsyncEngine) -> RadixTree | None:
    """The engine's prefix tree, or None when `cache.prefix` is `none`."""
    cache = engine.scheduler.cache
    return cache.tree if isinstance(cache, RadixPrefixCache) else None


def snapshot(engine: AsyncEngine, msg: Message) -> Message:
    tree = radix_tree(engine)
    nodes = tree.snapshot() if tree is not None else []
    return {"type": "snapshot", "page_size": engine.config.cache.page_size, "nodes": nodes}


def stats(engine: AsyncEngine, msg: Message) -> Message:
    sched = engine.scheduler
    alloc = sched.allocator
    cache = engine.cache_stats()
    return {
        "type": "stats",
        "pages": {
            "usable": alloc.num_usable,
            "free": alloc.num_free,
            "cached": cache["cached_pages"],
            "evictable": cache["evictable_pages"],
            # Pages requests own outright (not shared through the tree).
            "held": alloc.num_usable - alloc.num_free - cache["cached_pages"],
        },
        "requests": {"waiting": len(sched.waiting), "running": len(sched.running)},
        "idle": engine.is_idle(),
        "counters": dict(engine.counters),
        "cache": cache,
        "num_retractions": sched.num_retractions,
        "policies": current_policies(engine),
    }


def flush(engine: AsyncEngine, msg: Message) -> Message:
    ok, reason = engine.flush_cache()
    return {"type": "flush", "ok": ok, "reason": reason}


def check(engine: AsyncEngine, msg: Message) -> Message:
    try:
        engine.scheduler.check_integrity()
    except AssertionError as exc:  # IntegrityError and TreeIntegrityError both are
        return {"type": "check", "ok": False, "message": str(exc)}
    return {"type": "check", "ok": True}


def set_policy(engine: AsyncEngine, msg: Message) -> Message:
    kind, name = msg.get("kind"), msg.get("name")
    if kind not in POLICY_KINDS:
        raise ProtocolError(f"set_policy: 'kind' must be one of {list(POLICY_KINDS)}, got {kind!r}")
    known = registry.names(kind)
    # Registered names only: a dotted `pkg.module:Class` path would let a socket
    # message import arbitrary code into the server.
    if name not in known:
        raise ProtocolError(f"set_policy: unknown {kind} policy {name!r}; known: {known}")
    if kind == "evict":
        install_evict_policy(engine, name)
    else:
        fallback = engine.config.scheduler.lpm_fallback_queue
        engine.scheduler.policy = registry.lookup("schedule", name)(lpm_fallback_queue=fallback)
    return {"type": "set_policy", "ok": True, "kind": kind, "name": name}


def install_evict_policy(engine: AsyncEngine, name: str) -> None:
    tree = radix_tree(engine)
    if tree is None:
        raise ProtocolError("set_policy: no prefix cache (cache.prefix is none), nothing to evict")
    tree.set_policy(registry.lookup("evict", name)())


def current_policies(engine: AsyncEngine) -> dict[str, str | None]:
    tree = radix_tree(engine)
    return {
        "schedule": registered_name("schedule", engine.scheduler.policy),
        "evict": registered_name("evict", tree.policy) if tree is not None else None,
    }


def registered_name(kind: str, handler: object) -> str | None:
    """The registry name of a handler instance (the config keeps the launch-time one)."""
    for name in registry.names(kind):
        if type(handler) is registry.lookup(kind, name):
            return name
    return type(handler).__qualname__


COMMANDS: dict[str, Command] = {
    "snapshot": snapshot,
    "stats": stats,
    "flush": flush,
    "check": check,
    "set_policy": set_policy,
}


def kv_event_message(event: KVEvent) -> Message:
    """`{"type": "kv_event", "event": <class name>, **fields}`."""
    fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
    return {"type": "kv_event", "event": type(event).__name__, **fields}


def request_event_message(event: LifecycleEvent) -> Message:
    """`{"type": "request_event", "kind", "rid", "time", **data}`."""
    return {"type": "request_event", "kind": event.kind, "rid": event.rid, "time": event.time, **event.data}


def encode_event(event: KVEvent | LifecycleEvent) -> Message:
    if isinstance(event, LifecycleEvent):
        return request_event_message(event)
    return kv_event_message(event)


def encode_outgoing(item: Message | KVEvent | LifecycleEvent) -> Message:
    """What a connection's writer sends: replies as they are, raw events encoded."""
    return item if isinstance(item, dict) else encode_event(item)
