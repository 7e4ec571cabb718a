"""Request lifecycle events for observers (metrics, admin websocket, logs).

Publishing is synchronous and happens on the event loop, so subscribers must be cheap:
count, or put into a bounded queue and return. A subscriber that raises is logged and
kept away from the step loop's control flow (raised only in strict/debug runs).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import structlog

from cache.hub import Hub

log = structlog.get_logger("tierserve")


class LifecycleEvent(NamedTuple):
    kind: str  # queued | admitted | retracted | tokens | finished
    rid: str
    time: float  # time.monotonic()
    data: dict[str, Any]


class EventBus(Hub[LifecycleEvent]):
    """Request lifecycle events (see cache/hub.py for the delivery rules)."""

    def __init__(self, strict: bool = False) -> None:
        super().__init__("lifecycle", strict)

    def emit(self, kind: str, rid: str, **data: Any) -> None:
        self.publish(LifecycleEvent(kind, rid, time.monotonic(), data))


def log_lifecycle(event: LifecycleEvent) -> None:
    """One structured log line per lifecycle step of a request (the first token only,
    not every token: a line per token would drown the log)."""
    if event.kind == "tokens" and not event.data.get("first"):
        return
    kind = "first_token" if event.kind == "tokens" else event.kind
    log.info(f"request_{kind}", rid=event.rid, **{k: v for k, v in event.data.items() if k != "first"})
