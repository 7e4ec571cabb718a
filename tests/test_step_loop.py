"""The step loop never dies silently: an exception outside the device step halts the
engine, fails every client promptly with the error, and refuses new work."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kernel.async_engine import AsyncEngine, EngineUnavailable
from kernel.scheduling.step_loop import StepLoop
from tests import leaks
from tests.conftest import TINY_OVERRIDES

PROMPT = list(range(100, 140))
PARAMS = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


async def make(folder: str) -> AsyncEngine:
    return await AsyncEngine.create(None, {"model.path": folder, **TINY_OVERRIDES})


def plant_on_call(obj: Any, name: str, call: int, exc: Exception, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `obj.name` raise `exc` on its `call`-th call (1-based)."""
    real = getattr(obj, name)
    calls = {"n": 0}

    def planted(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == call:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, planted)


async def assert_halts(engine: AsyncEngine, message: str) -> None:
    rids = [engine.add_request(PROMPT[: 20 + i], PARAMS) for i in range(3)]
    results = await asyncio.wait_for(
        asyncio.gather(*(engine.collect(r) for r in rids), return_exceptions=True), timeout=10
    )
    assert all(isinstance(r, Exception) and message in str(r) for r in results), results
    assert engine.halt_reason is not None and message in engine.halt_reason
    assert engine.stats()["halt_reason"] == engine.halt_reason
    with pytest.raises(EngineUnavailable, match="halted"):
        engine.add_request(PROMPT, PARAMS)


async def test_planner_exception_halts_and_fails_every_client(
    tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = await make(tiny_chat_folder)
    try:
        plant_on_call(engine.scheduler, "schedule", 3, RuntimeError("planted planner bug"), monkeypatch)
        await assert_halts(engine, "planted planner bug")
    finally:
        leaks.excuse(engine)
        await engine.shutdown()


async def test_exception_while_applying_a_step_halts(
    tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = await make(tiny_chat_folder)
    try:
        # e.g. the allocator catching a double free while a finished request is released
        plant_on_call(engine.scheduler, "apply", 2, RuntimeError("page 7 freed but not allocated"),
                      monkeypatch)
        await assert_halts(engine, "freed but not allocated")
    finally:
        leaks.excuse(engine)
        await engine.shutdown()


async def test_red_without_the_guard_clients_hang(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Revert-then-red: with the loop's guard removed, the same planted bug leaves every
    client waiting forever (here: past a 2 s deadline)."""
    monkeypatch.setattr(StepLoop, "run", lambda self: self._loop())
    engine = await make(tiny_chat_folder)
    try:
        plant_on_call(engine.scheduler, "schedule", 3, RuntimeError("planted planner bug"), monkeypatch)
        rid = engine.add_request(PROMPT, PARAMS)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.collect(rid), timeout=2)
        assert engine.halt_reason is None  # nobody noticed
    finally:
        leaks.excuse(engine)  # its loop died unseen: its state is evidence, not a leak
        await engine.shutdown()


async def test_cpu_emits_a_steps_text_before_the_next_forward(tiny_chat_folder: str) -> None:
    """On CPU the forward takes every core, so step N's output is emitted (and its streams
    get a turn) before step N+1 is submitted; with `text_first` off (the GPU order) the
    next step is submitted first and the text work runs beside it."""
    engine = await make(tiny_chat_folder)
    loop = engine.loop
    assert loop.text_first, "a CPU engine emits before it submits"
    events: list[str] = []
    land, submit, emit = loop.land, loop.submit, loop.output.emit

    async def spy_land(*args: Any) -> Any:
        events.append("land")
        return await land(*args)

    def spy_submit(plan: Any) -> Any:
        step = submit(plan)
        if step is not None:
            events.append("submit")
        return step

    def spy_emit(reqs: list[Any]) -> None:
        if reqs:
            events.append("emit")
        emit(reqs)

    loop.land, loop.submit, loop.output.emit = spy_land, spy_submit, spy_emit  # type: ignore[method-assign]
    try:
        orders = {}
        for text_first in (True, False):
            loop.text_first = text_first
            events.clear()
            await engine.collect(engine.add_request(PROMPT, PARAMS))
            # after each landed step with output and a next step: its emit and that submit, in order
            orders[text_first] = {tuple(events[i + 1:i + 3]) for i in range(len(events) - 2)
                                  if events[i] == "land" and "emit" in events[i + 1:i + 3]}
        assert orders[True] == {("emit", "submit")}, orders
        assert orders[False] == {("submit", "emit")}, orders
    finally:
        await engine.shutdown()
