"""Faults end to end through the server, under concurrent load (issue 14, item 3).

- A device step that raises (the model runner, planted once): the requests of that step
  get an error object, the others complete with the reference's tokens, the engine does
  not halt, nothing leaks, and the next requests are served.
- Redis killed mid-run and restarted: outputs stay identical to the reference all along,
  the tier switches itself off after `storage_fail_limit` failures, the admin socket
  switches it back on, and pages written after the restart are served from Redis.
- SIGTERM mid-load: every in-flight request completes within `server.drain_grace_s` and
  the process exits 0; with a grace too short for them, they are cut cleanly (an error
  event, then [DONE]) and it still exits 0.

kill -9 then restart with the file tier: tests/test_storage_e2e.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import pytest
import requests

from tests import leaks
from tests.held_steps import hold_a_step
from tests.inprocess import Client, serve_http
from tests.redis_server import redis_server
from tests.slow_storage import HOLD_ENV
from tests.test_storage_e2e import Background, Served, procs, start, tokens, wait_for, write_config  # noqa: F401 - fixture

GREEDY = {"temperature": 0, "ignore_eos": True}
SHARED = tokens(3, 24)  # six whole pages every prompt starts with


def prompt(seed: int) -> list[int]:
    return SHARED + tokens(100 + seed, 9)


async def generate(http: Client, ids: list[int], max_new_tokens: int = 12) -> tuple[int, dict[str, Any]]:
    body = {"input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens}}
    resp = await http.post("/generate", json=body)
    return resp.status, dict(await resp.json())


async def references(http: Client, seeds: range) -> dict[int, list[int]]:
    outs = {}
    for seed in seeds:
        status, out = await generate(http, prompt(seed))
        assert status == 200, out
        outs[seed] = out["output_ids"]
    return outs


def plant_device_fault(engine: Any, monkeypatch: pytest.MonkeyPatch, on_call: int = 3) -> list[int]:
    """The model runner raises once, on its `on_call`-th step (mid-generation). -> the
    request-table rows of the step that failed (filled when it fails)."""
    runner = engine.loop.runner
    real_run = runner.run
    calls = {"n": 0}
    faulted: list[int] = []

    def run_once_broken(batch: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == on_call:
            faulted.extend(batch.rows)
            raise RuntimeError("planted device fault")
        return real_run(batch)

    monkeypatch.setattr(runner, "run", run_once_broken)
    return faulted


# Four run at once: the other four wait, so they are in no step when it fails.
FAULT_OVERRIDES = {"cache.prefix": "radix", "deterministic": True, "scheduler.max_running_requests": 4}


async def test_a_failing_device_step_fails_only_its_requests(tiny_chat_folder: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    async with serve_http(tiny_chat_folder, FAULT_OVERRIDES) as (engine, http):
        expected = await references(http, range(8))
        faulted = plant_device_fault(engine, monkeypatch)
        results = await asyncio.gather(*(generate(http, prompt(s)) for s in range(8)))
        failed = [out for status, out in results if status != 200]
        served = [(s, out) for s, (status, out) in enumerate(results) if status == 200]
        # Exactly the requests of the failed step fail (at most the 4 running); the rest are served.
        assert 1 <= len(faulted) <= 4 and len(failed) == len(faulted), (faulted, results)
        assert len(served) == 8 - len(faulted), results
        assert all(status in (200, 500) for status, _ in results), results
        for out in failed:
            assert set(out) == {"error"} and "planted device fault" in out["error"]["message"], out
        for seed, out in served:
            assert out["output_ids"] == expected[seed], seed
        assert engine.halt_reason is None
        status, out = await generate(http, prompt(99))  # the next request is served
        assert status == 200 and out["output_ids"] == (await references(http, range(99, 100)))[99]


async def test_red_without_the_step_guard_the_engine_halts(tiny_chat_folder: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Revert-then-red: with `await_step`'s guard removed, the same fault halts the
    engine and every request fails, the waiting ones included."""
    from kernel.scheduling.step_loop import StepLoop

    async def unguarded(self: StepLoop, plan: Any, step: Any) -> Any:
        return await step

    monkeypatch.setattr(StepLoop, "await_step", unguarded)
    async with serve_http(tiny_chat_folder, FAULT_OVERRIDES) as (engine, http):
        leaks.excuse(engine)  # it halts on purpose: its state is the evidence
        plant_device_fault(engine, monkeypatch, on_call=2)
        results = await asyncio.gather(*(generate(http, prompt(s)) for s in range(8)))
        assert engine.halt_reason is not None and "planted device fault" in engine.halt_reason
        assert all(status == 503 for status, _ in results), results


def assert_mid_run(engine: Any, load: asyncio.Future[Any]) -> None:
    running = engine.stats()["requests"]["running"]
    assert running > 0 and not load.done(), f"not mid-run: {running} requests running, load done: {load.done()}"


async def test_red_a_kill_after_the_run_is_caught(tiny_chat_folder: str) -> None:
    """What a fixed sleep before the kill gave on a fast machine: the load had finished."""
    async with serve_http(tiny_chat_folder, FAULT_OVERRIDES) as (engine, http):
        load = asyncio.ensure_future(generate(http, prompt(0)))
        await load
        with pytest.raises(AssertionError, match="not mid-run: 0 requests running, load done: True"):
            assert_mid_run(engine, load)


async def test_redis_killed_mid_run_and_restarted(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with redis_server() as redis:
        overrides = {"cache.prefix": "radix", "cache.num_pages": 64, "hicache.host_pages": 128,
                     "hicache.storage": "redis", "hicache.redis_url": redis.url, "hicache.storage_fail_limit": 2,
                     "hicache.storage_timeout_s": 0.5, "deterministic": True}
        async with serve_http(tiny_chat_folder, overrides) as (engine, http):
            expected = await references(http, range(30))
            storage = engine.storage
            assert storage is not None and storage.stats()["written_pages"] > 0

            async def load(seeds: range) -> None:
                for seed, (status, out) in zip(seeds, await asyncio.gather(*(generate(http, prompt(s))
                                                                             for s in seeds))):
                    assert status == 200 and out["output_ids"] == expected[seed], (seed, out)

            held, release = hold_a_step(engine, monkeypatch)
            first = asyncio.ensure_future(load(range(12)))
            assert await asyncio.to_thread(held.wait, 60), "the load never reached its third step"
            assert_mid_run(engine, first)
            redis.kill()  # mid-run: the load's third step is held until now
            release.set()
            await first
            await engine.settle_copies()  # writes to the dead Redis in flight fail (or time out) first
            assert engine.flush_cache()[0]  # from now on every prompt is new to the device and host
            for batch in (range(12, 18), range(18, 24), range(24, 30)):  # their writes fail
                await load(batch)
                await engine.settle_copies()
                deadline = time.monotonic() + 5
                while storage.stats()["queued_bytes"] and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                if not storage.enabled:
                    break
            st = storage.stats()
            assert not st["enabled"] and st["switched_off"] >= 1, st

            redis.start()  # same port, empty
            ws = await http.ws_connect("/admin/ws")
            await ws.send_json({"type": "storage", "enable": True})
            assert (await ws.receive_json(timeout=5))["enabled"] is True
            await ws.close()
            written = storage.stats()["written_pages"]
            # A prefix new to the tree: fresh write-through after the restart. (Pages whose
            # writes were missed while the tier was off are written later from their host
            # copies, as far as those survive: tests/test_storage_tier.py covers that.)
            after = tokens(777, 33)
            status, fresh = await generate(http, after)
            assert status == 200
            await engine.settle_copies()
            deadline = time.monotonic() + 15
            while (storage.stats()["written_pages"] <= written or storage.stats()["queued_bytes"]) \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert storage.stats()["written_pages"] > written, storage.stats()
            assert engine.flush_cache()[0]  # device and host empty: only Redis has the pages
            status, again = await generate(http, after)
            assert status == 200 and again["output_ids"] == fresh["output_ids"]
            assert again["meta_info"]["cached_tokens_by_tier"]["storage"] > 0, again["meta_info"]
            assert storage.stats()["enabled"]


LONG = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 150}


def stream_generate(url: str, seed: int) -> tuple[int, Any]:
    """A streamed /generate: (its status, its last event or error)."""
    body = {"input_ids": prompt(seed), "sampling_params": LONG, "stream": True}
    with requests.post(f"{url}/generate", json=body, stream=True, timeout=120) as resp:
        events = [orjson.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith(b"data: {")]
        return resp.status_code, events[-1] if events else None


def start_load(server: Served, seeds: range, ready: Callable[[], bool] | None = None) -> list[Background]:
    """Streamed requests, returned once `ready()` (default: every one of them has reached
    the engine: it waits, runs or has finished; one still on its way when a drain starts
    is rightly refused with 503, so a drain test must not signal before they all arrived)."""
    workers = [Background(partial(stream_generate, server.url, s)) for s in seeds]
    wait_for("the load running", ready or (lambda: arrived(server, workers) == len(seeds)))
    return workers


def arrived(server: Served, workers: list[Background]) -> int:
    """Requests of the load waiting or running in the engine, plus those already answered."""
    pool = server.info()["pool"]
    return int(pool["running"] + pool["waiting"]) + sum(not w.is_alive() for w in workers)


def joined(workers: list[Background]) -> list[tuple[int, Any]]:
    """Every worker's answer; a worker's own failure is raised as itself."""
    return [w.result() for w in workers]


def test_sigterm_mid_load_drains_every_request(tiny_chat_folder: str, tmp_path: Path,
                                               procs: list[Served]) -> None:  # noqa: F811
    config = write_config(tmp_path / "serve.yaml", tiny_chat_folder, storage="file", storage_dir=str(tmp_path / "kv"))
    server = start(procs, config)
    workers = start_load(server, range(6))
    server.terminate()
    answers = joined(workers)
    # server.drain_grace_s is 30 by default: had the drain cut a request, it would lack tokens.
    assert server.proc.wait(timeout=45) == 0
    for status, last in answers:
        assert status == 200 and last["meta_info"]["completion_tokens"] == 150, last


def test_sigterm_with_a_short_grace_cuts_requests_cleanly(tiny_chat_folder: str, tmp_path: Path,
                                                          procs: list[Served]) -> None:  # noqa: F811
    """The load's first decoding step is held (tests/held_steps.py) from before the signal
    until the 0.2 s grace has run out: no request can finish inside it."""
    hold = tmp_path / "hold"
    hold.mkdir()
    config = write_config(tmp_path / "serve.yaml", tiny_chat_folder)
    text = config.read_text().replace("host: 127.0.0.1", "host: 127.0.0.1\n  drain_grace_s: 0.2")
    text = text.replace("deterministic: true", "deterministic: false")
    config.write_text(text.replace("num_threads: 1", "num_threads: 1\n  attention: tests.held_steps:HeldTorchAttention"))
    server = start(procs, config, env={HOLD_ENV: str(hold)})
    (hold / "steps").touch()
    try:
        workers = start_load(server, range(6), (hold / "step-held").exists)
        server.terminate()
        wait_for("the grace running out", lambda: "drain_timeout" in server.log_text())
    finally:
        (hold / "steps").unlink()
    answers = joined(workers)  # every client got an answer: none hung
    assert server.proc.wait(timeout=30) == 0
    cut = [last for status, last in answers if status == 200 and "error" in (last or {})]
    assert cut, answers  # those that had streamed a token were still generating when the grace ran out ...
    for last in cut:  # ... and ended with an error event naming the shutdown
        assert last["error"]["code"] in ("shutdown", "draining"), last
    for status, last in answers:  # none could finish; the others were cut before their first token
        assert last in cut or status == 503, (status, last)
