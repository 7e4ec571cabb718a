"""Admin commands that need no per-connection state, and the encoding of pushed events.

Each command takes the engine and the client's message and returns the reply object
(the websocket adds nothing but sends it). Bad arguments raise ProtocolError, which the
caller turns into `{"type": "error", "message": ...}`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from cache.kv_events import KVEvent
from kernel import registry
from kernel.async_engine import AsyncEngine, PolicyError
from kernel.results.events import LifecycleEvent
from plugins.admin.summary import RANKINGS, limited

Message = dict[str, Any]
Command = Callable[[AsyncEngine, Message], Message]


class ProtocolError(ValueError):
    """A message the server understood as malformed; the socket stays open."""


MAX_LIMIT = 100_000


# The arguments of the commands that take some (also the JSON bodies of their plain
# HTTP routes), as /openapi.json documents them; `type` and `id` travel only on the socket.
@dataclass(frozen=True)
class SnapshotArgs:
    limit: int | None = field(default=None, metadata={"schema": {"minimum": 1, "maximum": MAX_LIMIT}})
    by: Literal["hits", "tokens"] = "hits"  # the keys of summary.RANKINGS; only with limit


@dataclass(frozen=True)
class SetPolicyArgs:
    kind: Literal["evict", "schedule"]  # kernel.async_engine.POLICY_KINDS
    name: str  # a registered name (`policies` lists them)


def snapshot(engine: AsyncEngine, msg: Message) -> Message:
    """Every node; with `limit`, the summarized form (plugins/admin/summary.py)."""
    limit, by = msg.get("limit"), msg.get("by", "hits")
    reply: Message = {"type": "snapshot", "page_size": engine.info.page_size}
    if limit is None:
        return {**reply, "nodes": engine.snapshot()}
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIMIT:
        raise ProtocolError(f"snapshot: 'limit' must be an integer from 1 to {MAX_LIMIT}, got {limit!r}")
    if by not in RANKINGS:
        raise ProtocolError(f"snapshot: 'by' must be one of {sorted(RANKINGS)}, got {by!r}")
    return {**reply, **limited(engine.snapshot(), limit, by)}


def stats(engine: AsyncEngine, msg: Message) -> Message:
    return {"type": "stats", **engine.stats()}  # the engine does the accounting


def flush(engine: AsyncEngine, msg: Message) -> Message:
    ok, reason = engine.flush_cache()
    return {"type": "flush", "ok": ok, "reason": reason}


def check(engine: AsyncEngine, msg: Message) -> Message:
    failure = engine.check()
    return {"type": "check", "ok": True} if failure is None else {"type": "check", "ok": False, "message": failure}


def set_policy(engine: AsyncEngine, msg: Message) -> Message:
    kind, name = msg.get("kind"), msg.get("name")
    if not isinstance(kind, str) or not isinstance(name, str):
        raise ProtocolError(f"set_policy: 'kind' and 'name' must be strings, got {kind!r} and {name!r}")
    try:  # the engine checks both against the registry and names the known ones
        engine.set_policy(kind, name)
    except PolicyError as exc:
        raise ProtocolError(f"set_policy: {exc}") from None
    return {"type": "set_policy", "ok": True, "kind": kind, "name": name}


def policies(engine: AsyncEngine, msg: Message) -> Message:
    """`{"type": "policies"}`: the names in use and the registered names `set_policy` takes."""
    current = engine.policies()
    return {"type": "policies", "current": current, "known": {kind: registry.names(kind) for kind in current}}


def storage(engine: AsyncEngine, msg: Message) -> Message:
    """`{"type": "storage", "enable": bool}`: switch the storage tier back on (after it was
    switched off for failing) or off; without `enable`, just its state."""
    enable = msg.get("enable")
    if enable is not None and not isinstance(enable, bool):
        raise ProtocolError(f"storage: 'enable' must be true or false, got {enable!r}")
    try:
        if enable is not None:
            engine.set_storage(enable)
    except PolicyError as exc:
        raise ProtocolError(f"storage: {exc}") from None
    tier = engine.storage
    return {"type": "storage", "ok": True, "enabled": tier.enabled if tier is not None else None}


COMMANDS: dict[str, Command] = {
    "snapshot": snapshot,
    "stats": stats,
    "flush": flush,
    "check": check,
    "set_policy": set_policy,
    "policies": policies,
    "storage": storage,
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
