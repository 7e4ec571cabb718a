"""Submission (all-or-none admission, abort, close) and drain, in process on the tiny model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kernel.async_engine import AsyncEngine
from kernel.config import load_config
from kernel.sampling_params import SamplingParams
from plugins.http.errors import APIError
from plugins.http.server import build_app, drain
from plugins.http.state import ServerState
from plugins.http.submission import submit

LONG = SamplingParams(max_new_tokens=900, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=4, temperature=0.0)


@pytest.fixture
async def engine(tiny_chat_folder: str) -> AsyncIterator[AsyncEngine]:
    eng = await AsyncEngine.create(None, {
        "model.path": tiny_chat_folder, "cache.num_pages": 256, "cache.page_size": 4,
        "debug.check_invariants": True, "cache.prefix": "none",  # counts every page as free when idle
    })
    yield eng
    await eng.shutdown()


async def assert_idle(engine: AsyncEngine) -> None:
    for _ in range(500):
        if engine.is_idle():
            break
        await asyncio.sleep(0.01)
    pages = engine.stats()["pages"]
    assert engine.is_idle() and pages["free"] == pages["usable"]


async def test_events_deliver_every_choice(engine: AsyncEngine) -> None:
    sub = await submit(engine, [("Hi", SHORT), ("Hi", SHORT)], {}, max_queued=8)
    finished = [chunk.completion_tokens async for _, chunk in sub.events() if chunk.finished]
    await sub.close()
    assert finished == [4, 4]
    await assert_idle(engine)


async def test_refused_request_rolls_back_the_batch(engine: AsyncEngine) -> None:
    with pytest.raises(APIError) as err:
        await submit(engine, [("Hi", SHORT), ([1] * 2046, SHORT)], {"max_new_tokens": "max_tokens"}, 8)
    assert err.value.status == 400 and "max_tokens" in err.value.message
    assert engine.stats()["requests"] == {"waiting": 0, "running": 0}
    assert engine.stats()["counters"]["generation_tokens"] == 0
    await assert_idle(engine)


async def test_queue_limit_counts_the_whole_batch(engine: AsyncEngine) -> None:
    with pytest.raises(APIError) as err:
        await submit(engine, [("Hi", SHORT)] * 3, {}, max_queued=2)
    assert err.value.status == 429 and err.value.headers == {"Retry-After": "1"}
    assert engine.stats()["requests"]["waiting"] == 0


async def test_close_right_after_submit_aborts(engine: AsyncEngine) -> None:
    """Closing before the pumps ever ran must still abort (their first step is awaited)."""
    sub = await submit(engine, [("Hi", LONG)] * 2, {}, max_queued=8)
    await sub.close()
    await assert_idle(engine)
    assert engine.stats()["counters"]["generation_tokens"] < 900


async def test_drain_aborts_what_outlives_the_grace(engine: AsyncEngine) -> None:
    state = ServerState(engine.config, engine=engine)

    async def handler() -> int:
        async with state.generation([("Hi", LONG)], {}) as sub:
            return sum([1 async for _ in sub.events()])

    task = asyncio.ensure_future(handler())
    await asyncio.sleep(0.05)
    await drain(state, grace_s=0.1)
    with pytest.raises(APIError) as err:
        await task
    assert err.value.status == 503 and not state.live
    await assert_idle(engine)


async def test_health_and_routes_say_503_while_the_model_loads() -> None:
    app = build_app(ServerState(load_config(None)))  # no engine yet: still starting
    async with TestClient(TestServer(app)) as http:
        health = await http.get("/health")
        assert health.status == 503 and await health.json() == {"status": "starting"}
        models = await http.get("/v1/models")
        assert models.status == 503 and (await models.json())["error"]["code"] == "starting"
