"""The one-command cluster (plugins/cluster.py): two replicas sharing a real redis-server
as their storage tier behind SGLang's real gateway. A replica that dies is dropped by the
router's health check and the next request goes to the other one, where the prefix the
dead replica computed is a storage hit. Tiny model, small pools; real processes."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
import requests

from plugins.cluster import start
from tests.redis_server import ensure_redis_server

TINY = ("cache.page_size=4", "cache.num_pages=256", "hicache.host_ratio=2", "deterministic=true",
        "debug.check_invariants=true")
FAST_HEALTH = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1",
               "--health-check-timeout-secs", "1")


def generate(url: str, ids: list[int]) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    resp = requests.post(f"{url}/generate", json=body, timeout=60)
    resp.raise_for_status()
    return dict(resp.json())


def lookups(url: str) -> int:
    """Prompt tokens the replica looked up in its prefix cache so far: which one served."""
    return int(requests.get(f"{url}/server_info", timeout=5).json()["cache"]["prefix_query_tokens"])


def wait_stored(url: str, pages: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if requests.get(f"{url}/server_info", timeout=5).json()["storage"]["written_pages"] >= pages:
            return
        time.sleep(0.1)
    raise AssertionError(f"{url} wrote fewer than {pages} pages to storage")


def test_a_dead_replicas_prefix_is_a_storage_hit_on_the_other(tiny_chat_folder: str) -> None:
    ensure_redis_server()
    cluster = start(2, "sglang", overrides=(f"model.path={tiny_chat_folder}", *TINY), router_args=FAST_HEALTH)
    try:
        prefix = list(range(200, 264))  # 16 pages
        urls = [r.url for r in cluster.replicas]
        before = [lookups(u) for u in urls]
        first = generate(cluster.router_url, prefix)
        moved = [i for i, u in enumerate(urls) if lookups(u) > before[i]]
        assert len(moved) == 1, moved
        dead, alive = moved[0], 1 - moved[0]
        wait_stored(cluster.replicas[dead].url, 16)
        cluster.replicas[dead].proc.send_signal(signal.SIGKILL)
        cluster.replicas[dead].proc.wait(timeout=10)
        time.sleep(4)  # the gateway's health check drops it
        before_alive = lookups(urls[alive])
        again = generate(cluster.router_url, prefix)
        assert lookups(urls[alive]) > before_alive  # served by the survivor
        tiers = again["meta_info"]["cached_tokens_by_tier"]
        assert tiers["storage"] >= 60, tiers  # what the dead replica computed came from Redis
        assert again["output_ids"] == first["output_ids"]  # deterministic: the dead replica's tokens
    finally:
        cluster.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["drains", "dies"])
def test_a_replica_stopping_under_a_stream(tiny_chat_folder: str, sig: signal.Signals) -> None:
    """A stream in flight through the gateway when its replica stops. SIGTERM: the replica
    drains (its /health answers 503, the stream ends normally) and exits 0. SIGKILL: the
    stream fails (it ends without its finish; no hang). Either way the gateway's health
    check drops the replica and every later request is answered by the other one."""
    import threading

    ensure_redis_server()
    cluster = start(2, "sglang", overrides=(f"model.path={tiny_chat_folder}", *TINY, "server.drain_grace_s=30"),
                    router_args=FAST_HEALTH)
    try:
        urls = [r.url for r in cluster.replicas]
        before = [lookups(u) for u in urls]
        result: dict[str, Any] = {"lines": []}
        model = requests.get(f"{urls[0]}/server_info", timeout=5).json()["served_model_name"]

        def stream() -> None:  # a long streamed completion through the gateway
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": 600, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            try:
                with requests.post(f"{cluster.router_url}/v1/completions", json=body, stream=True, timeout=120) as resp:
                    result["status"] = resp.status_code
                    for line in resp.iter_lines():
                        if line:
                            result["lines"].append(line)
            except requests.RequestException as exc:  # the connection broke: a failure the client sees
                result["error"] = repr(exc)

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 20
        busy: list[int] = []
        while not busy and time.monotonic() < deadline:
            busy = [i for i, u in enumerate(urls) if lookups(u) > before[i]]
            time.sleep(0.05)
        assert busy, "the stream reached no replica"
        stopping = cluster.replicas[busy[0]]
        stopping.proc.send_signal(sig)
        reader.join(timeout=120)
        assert not reader.is_alive(), "the stream hung"
        finished = bool(result["lines"]) and result["lines"][-1] == b"data: [DONE]" and \
            b'"finish_reason":"length"' in b"".join(result["lines"]).replace(b" ", b"")
        if sig == signal.SIGTERM:
            assert finished and stopping.proc.wait(timeout=60) == 0, result
        else:
            assert not finished, result["lines"][-3:]
        time.sleep(3)  # the health check has seen it go
        for i in range(6):
            out = generate(cluster.router_url, [300 + i, 301, 302, 303, 304])
            assert out["output_ids"], out
    finally:
        cluster.stop()
