"""A `subscribe`d connection's taps on the engine: request lifecycle and KV cache events.

The callbacks run synchronously inside the step loop and tree operations, so they only
hand the raw event objects to the connection's outbox; encoding happens in its writer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cache.kv_events import KVEvent
from kernel.async_engine import AsyncEngine
from kernel.results.events import LifecycleEvent


class EventFeed:
    def __init__(self, engine: AsyncEngine, put: Callable[[Any], None]) -> None:
        self._put = put
        self._unsubscribe = [engine.events.subscribe(self._on_request_event)]
        stop_kv = engine.subscribe_kv_events(self._on_kv_events)  # None: no prefix tree
        if stop_kv is not None:
            self._unsubscribe.append(stop_kv)

    def _on_request_event(self, event: LifecycleEvent) -> None:
        self._put(event)

    def _on_kv_events(self, events: list[KVEvent]) -> None:
        for event in events:
            self._put(event)

    def close(self) -> None:
        """Detach from the engine; idempotent."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe = []
