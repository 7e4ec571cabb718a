"""A halted engine (`engine.halt_reason` set: its step loop has stopped for good) as the
HTTP side reports it: /health 503 with the reason, every generation route 503 at once,
/server_info and the admin stats show it, /metrics `tierserve_engine_healthy` drops to 0,
and requests in flight end with the reason instead of waiting for tokens that never come.

The kernel sets `halt_reason` itself when its loop dies; here the test sets it on a live
in-process engine, which is what the HTTP side sees either way.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests import leaks
from tests.inprocess import Client, serve_http

REASON = "integrity check failed: planted by the test"
USER = [{"role": "user", "content": "hi"}]
MAX_TOKENS = 600
LONG = {"prompt": "Go on", "max_tokens": MAX_TOKENS, "ignore_eos": True}
# Every generation route, streamed and not.
ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "stream": True}),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}}),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}, "stream": True}),
]


async def healthy_gauge(http: Client) -> float:
    text = await (await http.get("/metrics")).text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tierserve_engine_healthy":
                return float(sample.value)
    raise KeyError("tierserve_engine_healthy")


def assert_halted(status: int, body: dict[str, Any]) -> None:
    assert status == 503, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == "engine_halted" and REASON in body["error"]["message"], body
    assert body["error"]["type"] == "service_unavailable_error"


async def test_health_info_admin_and_metrics_report_the_halt(tiny_chat_folder: str) -> None:
    async with serve_http(tiny_chat_folder) as (engine, http):
        health = await http.get("/health")
        assert health.status == 200 and await health.json() == {"status": "ok"}
        assert (await (await http.get("/server_info")).json())["halt_reason"] is None
        assert await healthy_gauge(http) == 1

        engine.halt_reason = REASON

        leaks.excuse(engine)  # halted on purpose: its state is the evidence
        health = await http.get("/health")
        assert_halted(health.status, await health.json())
        info = await http.get("/server_info")  # still answers: that is where an operator looks
        assert info.status == 200 and (await info.json())["halt_reason"] == REASON
        stats = await (await http.get("/admin/stats")).json()
        assert stats["halt_reason"] == REASON
        assert await healthy_gauge(http) == 0


async def test_new_requests_on_every_generation_route_get_503_at_once(tiny_chat_folder: str) -> None:
    async with serve_http(tiny_chat_folder) as (engine, http):
        engine.halt_reason = REASON
        leaks.excuse(engine)  # halted on purpose: its state is the evidence
        for path, body in ROUTES:
            # wait_for: a request queued on a dead loop would hang instead.
            resp = await asyncio.wait_for(http.post(path, json=body), 5)
            assert_halted(resp.status, await resp.json())
        client = openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as refused:
            await client.completions.create(model=engine.info.model_name, prompt="x", max_tokens=2)
        assert refused.value.status_code == 503 and refused.value.code == "engine_halted"
        assert REASON in refused.value.message
        await client.close()
        stats = engine.stats()
        assert stats["counters"]["prompt_tokens"] == 0 and stats["requests"] == {"waiting": 0, "running": 0}


async def test_requests_in_flight_end_with_the_reason(tiny_chat_folder: str) -> None:
    """A halt in mid-generation ends a stream with an in-band error event and a
    non-streamed request with a 503, and both give their pages back."""
    async with serve_http(tiny_chat_folder) as (engine, http):
        whole = asyncio.ensure_future(http.post("/v1/completions", json=LONG))
        stream = await http.post("/v1/completions", json={**LONG, "stream": True})
        assert stream.status == 200
        first = await stream.content.readline()
        assert first.startswith(b"data: {")
        while engine.stats()["requests"]["running"] < 2:
            await asyncio.sleep(0.01)
        engine.halt_reason = REASON
        leaks.excuse(engine)  # halted on purpose: its state is the evidence
        resp = await asyncio.wait_for(whole, 5)
        assert_halted(resp.status, await resp.json())
        rest = [line async for line in stream.content if line.startswith(b"data: ")]
        assert rest[-1] == b"data: [DONE]\n"
        error = orjson.loads(rest[-2][6:])
        assert error["error"]["code"] == "engine_halted" and REASON in error["error"]["message"]
        assert len(rest) < MAX_TOKENS  # cut short, not run to the end
        for _ in range(500):  # the aborts free the pages within a step or two
            if engine.is_idle():
                break
            await asyncio.sleep(0.01)
        pages = engine.stats()["pages"]
        assert engine.is_idle() and pages["free"] == pages["usable"]


async def test_a_real_halt_ends_requests_in_flight(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel halting by itself (a planted planner bug mid-generation): the streamed
    and the non-streamed request both end promptly with the reason, /health says why."""
    async with serve_http(tiny_chat_folder) as (engine, http):
        whole = asyncio.ensure_future(http.post("/v1/completions", json=LONG))
        stream = await http.post("/v1/completions", json={**LONG, "stream": True})
        assert (await stream.content.readline()).startswith(b"data: {")
        while engine.stats()["requests"]["running"] < 2:
            await asyncio.sleep(0.01)

        def broken_planner() -> Any:
            raise RuntimeError("planted planner bug")

        monkeypatch.setattr(engine.scheduler, "schedule", broken_planner)
        leaks.excuse(engine)  # it halts on purpose: its state is the evidence
        resp = await asyncio.wait_for(whole, 5)
        body = await resp.json()
        assert resp.status == 503 and "planted planner bug" in body["error"]["message"], body
        rest = [line async for line in stream.content if line.startswith(b"data: ")]
        error = orjson.loads(rest[-2][6:])
        assert "planted planner bug" in error["error"]["message"] and rest[-1] == b"data: [DONE]\n"
        health = await http.get("/health")
        assert health.status == 503 and "planted planner bug" in (await health.json())["error"]["message"]
