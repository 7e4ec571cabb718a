"""A synchronous publish/subscribe hub: the one used for KV events (cache/kv_events.py)
and request lifecycle events (kernel/results/events.py).

NOTE: a failing subscriber is logged and, by default, never raised into the publisher:
the operation that published has already completed, and an exception would make its
caller believe it failed (e.g. free pages the tree now owns). With `strict=True`
(debug runs: `debug.check_invariants`) the error is raised after every subscriber has
been called, so a broken observer — or an assertion inside a test's subscriber — is
loud instead of a log line. Subscribers must be cheap (count, or push into a bounded
queue): they run inside the publishing operation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import structlog

log = structlog.get_logger("tierserve")

T = TypeVar("T")


class Hub(Generic[T]):
    def __init__(self, name: str, strict: bool = False) -> None:
        self.name = name
        self.strict = strict
        self._subscribers: list[Callable[[T], None]] = []

    @property
    def active(self) -> bool:
        """Whether anyone listens: publishers skip building events when not."""
        return bool(self._subscribers)

    def subscribe(self, callback: Callable[[T], None]) -> Callable[[], None]:
        """Add `callback`; returns a function that removes it (idempotent)."""
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

        return unsubscribe

    def publish(self, item: T) -> None:
        failure: Exception | None = None
        for callback in list(self._subscribers):
            try:
                callback(item)
            except Exception as exc:
                log.exception("event_subscriber_failed", hub=self.name, subscriber=repr(callback))
                failure = failure or exc
        if failure is not None and self.strict:
            raise failure
