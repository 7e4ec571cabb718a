"""Page and row accounting for every engine a test creates (invariant 3).

`track_engines()` wraps `AsyncEngine.__init__` and `AsyncEngine.shutdown` for the whole
session: every engine is recorded when it is built, and checked just before it shuts
down (on its own loop; an engine shut down mid-work gets the integrity check, which
adds up pages held by live requests too). conftest's autouse fixture also checks every engine
still alive after each test, and fails the test that left a leak behind (that test only:
an engine reported once is not checked again).

The check: the engine is idle; no page is held outside the prefix cache; free + cached
== usable; every request-table row is free; for hybrid models no state slot is held
and free + cached == usable; and the engine's own integrity check
passes (the tree is consistent and no page is both held and cached). Only an engine a
planted-bug test excused (`excuse`) is skipped: its state is the evidence the test
asserted on. An engine that halted for any other reason is reported, halt reason and all.

Session-scoped engines shut down after the last test's teardown: what their shutdown
check finds is reported by conftest's `pytest_sessionfinish` (`session_report`), which
fails the run.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from kernel.async_engine import AsyncEngine

IDLE_WAIT_S = 10.0

_live: weakref.WeakSet[AsyncEngine] = weakref.WeakSet()
_closed: weakref.WeakSet[AsyncEngine] = weakref.WeakSet()  # checked (at shutdown, or reported once)
_excused: weakref.WeakSet[AsyncEngine] = weakref.WeakSet()
failures: list[str] = []  # found at shutdown; reported by the next teardown


def excuse(engine: AsyncEngine) -> None:
    """A planted-bug test broke this engine on purpose (and asserted that it shows)."""
    _excused.add(engine)


def accounting_errors(engine: AsyncEngine) -> list[str]:
    """What is wrong with an idle engine's accounting (empty when nothing is)."""
    if engine in _excused:
        return []
    if engine.halt_reason is not None:  # no planted-bug test asked for this halt
        return [f"engine halted (not excused by a planted-bug test): {engine.halt_reason}"]
    if not engine.is_idle():
        return [f"engine still busy after the test: {engine.stats()['requests']}"]
    stats = engine.stats()
    pages, rows = stats["pages"], stats["rows"]
    errors = []
    if pages["held"] != 0:
        errors.append(f"{pages['held']} pages leaked (held by no live request, not cached): {pages}")
    if pages["free"] + pages["cached"] != pages["usable"]:
        errors.append(f"free + cached != usable: {pages}")
    if rows["free"] != rows["usable"] or rows["scratch_free"] != rows["scratch"]:
        errors.append(f"request rows leaked: {rows}")
    host = stats["host"]
    if host is not None:
        hp = host["host_pages"]
        if hp["copying"] or hp["free"] + hp["cached"] != hp["usable"]:
            errors.append(f"host pages leaked: {hp}")
    states = stats["states"]
    if states is not None and (states["held"] != 0 or states["free"] + states["cached"] != states["usable"]):
        errors.append(f"state slots leaked: {states}")
    problem = engine.check()
    if problem is not None:
        errors.append(f"integrity check: {problem}")
    return errors


def check_live_engines() -> list[str]:
    """Check every engine that is alive (built and not shut down) right now."""
    errors = []
    for engine in list(_live):
        if engine in _closed:
            continue
        deadline = time.monotonic() + IDLE_WAIT_S
        while not engine.is_idle() and engine.halt_reason is None and time.monotonic() < deadline:
            time.sleep(0.01)
        found = accounting_errors(engine)
        if found:  # reported by this teardown only: later tests did not break it
            _closed.add(engine)
        errors += [f"{engine.info.model_name}: {e}" for e in found]
    return errors


def session_report() -> list[str]:
    """At the end of the session: what the shutdown of engines closed after the last
    teardown found, and any engine never shut down (checked now). Clears the list."""
    errors = failures + check_live_engines()
    failures.clear()
    return errors


def track_engines() -> None:
    real_init: Callable[..., None] = AsyncEngine.__init__
    real_shutdown: Callable[[AsyncEngine], Awaitable[None]] = AsyncEngine.shutdown

    def init(self: AsyncEngine, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        _live.add(self)

    async def shutdown(self: AsyncEngine) -> None:
        if self not in _closed:
            await asyncio.sleep(0)  # let aborts issued just now reach the scheduler
            if self.is_idle() or self.halt_reason is not None or self in _excused:
                errors = accounting_errors(self)
            else:  # shut down mid-work on purpose: the accounting must still add up
                problem = self.check()
                errors = [] if problem is None else [f"integrity check mid-work: {problem}"]
            failures.extend(f"{self.info.model_name} at shutdown: {e}" for e in errors)
            _closed.add(self)
        await real_shutdown(self)

    AsyncEngine.__init__ = init  # type: ignore[method-assign]
    AsyncEngine.shutdown = shutdown  # type: ignore[method-assign]
