"""Request lifecycle events for observers (metrics, admin websocket, logs).

Publishing is synchronous and happens on the event loop, so subscribers must be cheap:
count, or put into a bounded queue and return. A subscriber that raises is logged and
kept away from the step loop's control flow.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import structlog

log = structlog.get_logger("tierserve")


class LifecycleEvent(NamedTuple):
    kind: str  # queued | admitted | retracted | tokens | finished
    rid: str
    time: float  # time.monotonic()
    data: dict[str, Any]


Subscriber = Callable[[LifecycleEvent], None]


class EventBus:
    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []

    @property
    def active(self) -> bool:
        """Whether anyone listens: callers skip building events when not."""
        return bool(self._subscribers)

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback) if callback in self._subscribers else None

    def publish(self, kind: str, rid: str, **data: Any) -> None:
        event = LifecycleEvent(kind, rid, time.monotonic(), data)
        for callback in list(self._subscribers):
            try:
                callback(event)
            except Exception:
                log.exception("event_subscriber_failed", kind=kind)


def log_lifecycle(event: LifecycleEvent) -> None:
    """One structured log line per lifecycle step of a request (the first token only,
    not every token: a line per token would drown the log)."""
    if event.kind == "tokens" and not event.data.get("first"):
        return
    kind = "first_token" if event.kind == "tokens" else event.kind
    log.info(f"request_{kind}", rid=event.rid, **{k: v for k, v in event.data.items() if k != "first"})
