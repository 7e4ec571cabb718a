"""Admin routes and /metrics on the real server process."""

from __future__ import annotations

import asyncio

import aiohttp
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
