"""Admin routes and /metrics on the real server process."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.test_http_fixtures import ServerProcess, post

pytest_plugins = ["tests.test_http_fixtures"]


def counter(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise KeyError(name)


def test_metrics_move_with_requests(server: ServerProcess) -> None:
    before = requests.get(f"{server.url}/metrics", timeout=5).text
    resp = post(server, "/generate", {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 3}})
    assert resp.status_code == 200
    after = requests.get(f"{server.url}/metrics", timeout=5).text
    assert counter(after, "tierserve_prompt_tokens_total") - counter(before, "tierserve_prompt_tokens_total") == 4
    gen = "tierserve_generation_tokens_total"
    assert counter(after, gen) - counter(before, gen) == 3


def test_admin_socket_snapshot_and_stats(server: ServerProcess) -> None:
    async def talk() -> tuple[dict, dict]:
        async with aiohttp.ClientSession() as session, session.ws_connect(f"{server.url}/admin/ws") as ws:
            await ws.send_json({"type": "stats"})
            stats = await ws.receive_json(timeout=5)
            await ws.send_json({"type": "snapshot"})
            snap = await ws.receive_json(timeout=5)
            return stats, snap

    stats, snap = asyncio.run(talk())
    assert stats["type"] == "stats" and stats["pages"]["usable"] == 255
    assert snap["type"] == "snapshot" and isinstance(snap["nodes"], list)
    assert requests.get(f"{server.url}/admin/check", timeout=5).json()["ok"] is True


def test_twenty_streams_half_cut_off(server: ServerProcess) -> None:
    """10 streams dropped mid-way, 10 run to the end with the right text; then the
    admin stats show no page held outside the tree."""
    body = {"prompt": "Tell me a story", "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    expected = post(server, "/v1/completions", body).json()["choices"][0]["text"]

    async def stream(session: aiohttp.ClientSession, cut: bool) -> str | None:
        payload = {**body, "stream": True, "max_tokens": 400 if cut else 20}
        async with session.post(f"{server.url}/v1/completions", json=payload) as resp:
            text, chunks = [], 0
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    chunks += 1
                    text.append(orjson.loads(line[6:])["choices"][0]["text"])
                    if cut and chunks == 3:
                        resp.close()  # the client goes away mid-stream
                        return None
            return "".join(text)

    async def run_all() -> list[str | None]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(stream(session, cut=i % 2 == 0) for i in range(20)))

    results = asyncio.run(run_all())
    assert [r for r in results if r is not None] == [expected] * 10
    server.wait_idle(timeout_s=10)
    stats = requests.get(f"{server.url}/admin/stats", timeout=5).json()
    assert stats["pages"]["held"] == 0 and stats["requests"] == {"waiting": 0, "running": 0}
    assert stats["pages"]["free"] + stats["pages"]["cached"] == stats["pages"]["usable"]
