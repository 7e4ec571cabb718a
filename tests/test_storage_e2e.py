"""The storage tier end to end: real `serve` processes, real clients, a real Redis.

- A server killed with SIGKILL leaves its pages in the `file` tier; a fresh server on
  the same directory serves the prompt's prefix from storage, with the same tokens and
  logprobs (official `openai` client).
- Two servers sharing one Redis: what A computed, B serves from storage, identically.
- SIGTERM drains: storage writes still queued when the signal comes (held back by the
  test's backend) land before exit.
- A backend that keeps failing switches itself off (/server_info, /metrics) and the
  admin websocket switches it back on; a bad `enable` value changes nothing.

Every process a test starts is killed at teardown, whatever happened (`procs`).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from openai import OpenAI

from cache.storage.file_backend import FileBackend
from tests.inprocess import serve_http
from tests.redis_server import redis_server
from tests.slow_storage import HOLD_ENV
from tests.test_http_fixtures import ROOT, ServerProcess, free_port

PAGE = 4
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "return_logprob": True}


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(50, 40000) for _ in range(n)]


PROMPT = tokens(11, 67)  # 16 whole pages of 4 tokens, then 3 more
TEXT = ("The lighthouse keeper counted ships every evening, wrote their names in a blue "
        "ledger, and wondered which harbours they were bound for, " * 3).strip()


class Served(ServerProcess):
    """`python -m plugins.cli serve --config <yaml>` (this checkout's code: cwd is the
    repository root) on a free port, optionally with extra environment."""

    def __init__(self, config: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "plugins.cli", "serve", "--config", str(config),
                "--set", f"server.port={self.port}"]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tierserve-e2e-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        try:
            self._wait_healthy()
        except BaseException:
            self.kill9()
            raise

    def kill9(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def generate(self, ids: list[int], **params: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"input_ids": ids, "sampling_params": {**GREEDY, **params}}
        resp = requests.post(f"{self.url}/generate", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    def storage(self) -> dict[str, Any]:
        st = self.info()["storage"]
        assert st is not None, "no storage tier"
        return dict(st)

    def wait_stored(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Storage stats once the server is idle, no host copy is in flight, some pages
        were written and none waits to be: what the finished requests wrote has landed."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.info()
            st, host, pool = info["storage"], info["host"], info["pool"]
            idle = pool["running"] == 0 and pool["waiting"] == 0
            if idle and host["host_pages"]["copying"] == 0 and st["written_pages"] > 0 and st["queued_bytes"] == 0:
                return dict(st)
            if time.monotonic() > deadline:
                raise AssertionError(f"storage writes did not land: {st} {host} {pool}")
            time.sleep(0.05)


@pytest.fixture
def procs() -> Iterator[list[Served]]:
    """Servers a test starts; any still running at teardown is killed (SIGKILL)."""
    started: list[Served] = []
    yield started
    for server in started:
        server.kill9()
        server.log.close()


def start(procs: list[Served], config: Path, env: dict[str, str] | None = None) -> Served:
    server = Served(config, env)
    procs.append(server)
    return server


def write_config(path: Path, model: str, **hicache: Any) -> Path:
    config = {
        "model": {"path": model, "num_threads": 1},
        "cache": {"prefix": "radix", "page_size": PAGE, "num_pages": 64},
        # A generous fetch budget: the machine is small and shared; a late fetch is a miss.
        "hicache": {"host_pages": 128, "storage_timeout_s": 5.0, **hicache},
        "scheduler": {"chunked_prefill_size": 32, "max_num_batched_tokens": 64, "max_running_requests": 8},
        "deterministic": True,
        "debug": {"check_invariants": True},
        "server": {"host": "127.0.0.1"},
        "logging": {"level": "info"},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def pages_on_disk(root: Path) -> int:
    """Page files under a `file` tier directory, counted without opening a backend over
    it (that would remove a live server's temp files: one process owns a directory)."""
    return sum(1 for p in root.glob("??/*") if not p.name.startswith("."))


def logprobs(out: dict[str, Any]) -> list[float]:
    return [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]


def completion(server: Served, prompt: str) -> Any:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    return client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=2)


def outputs(out: Any) -> tuple[Any, ...]:
    """What must not change with a cache hit: text, tokens, their logprobs, the top ones."""
    choice = out.choices[0]
    lp = choice.logprobs
    return choice.text, lp.tokens, lp.token_logprobs, lp.top_logprobs, choice.finish_reason


def test_restart_after_kill9_serves_from_file_storage(tiny_chat_folder: str, tmp_path: Path,
                                                       procs: list[Served]) -> None:
    config = write_config(tmp_path / "serve.yaml", tiny_chat_folder, storage="file",
                          storage_dir=str(tmp_path / "kv"))
    first = start(procs, config)
    cold = completion(first, TEXT)
    assert cold.usage.prompt_tokens >= 8 * PAGE, cold.usage  # long enough for several pages
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    written = first.wait_stored()
    assert written["written_pages"] >= cold.usage.prompt_tokens // PAGE
    first.kill9()  # no drain, no flush: only what already landed survives
    assert first.proc.returncode == -signal.SIGKILL

    second = start(procs, config)
    assert second.storage()["backend_stats"]["pages"] >= written["written_pages"]  # rebuilt from disk
    warm = completion(second, TEXT)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached == (cold.usage.prompt_tokens - 1) // PAGE * PAGE, warm.usage  # every whole page but the last token's
    st = second.storage()
    assert st["hit_tokens"] == cached and st["read_pages"] > 0 and st["prefetch"]["completed"] == 1, st
    info = second.info()
    # Per tier: nothing came from device or host memory, all from storage.
    assert info["host"]["host_hit_tokens"] == 0 and info["cache"]["prefix_hit_tokens"] == 0, info
    assert outputs(warm) == outputs(cold)
    assert second.stop() == 0


def test_two_servers_share_one_redis(tiny_chat_folder: str, tmp_path: Path, procs: list[Served]) -> None:
    with redis_server() as redis:
        config = write_config(tmp_path / "serve.yaml", tiny_chat_folder, storage="redis", redis_url=redis.url)
        a = start(procs, config)
        b = start(procs, config)
        ref = a.generate(PROMPT)
        assert ref["meta_info"]["cached_tokens"] == 0
        a.wait_stored()
        # B sees what A wrote (redis stats are refreshed in the background: poll).
        deadline = time.monotonic() + 10
        while b.storage()["backend_stats"]["pages"] < 16 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert b.storage()["backend_stats"]["pages"] >= 16

        out = b.generate(PROMPT)
        tiers = out["meta_info"]["cached_tokens_by_tier"]
        assert tiers == {"device": 0, "host": 0, "storage": 64}, tiers
        assert out["output_ids"] == ref["output_ids"] and logprobs(out) == logprobs(ref)
        assert out["text"] == ref["text"]
        assert b.storage()["hit_tokens"] == 64
        assert a.stop() == 0 and b.stop() == 0


class Background(threading.Thread):
    """A call run in a thread; `result()` joins it and returns what it returned, or
    raises what it raised (an assertion in the thread surfaces as itself)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self._fn = fn
        self._out: Any = None
        self._error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self._out = self._fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test by result()
            self._error = exc

    def result(self, timeout_s: float = 120.0) -> Any:
        self.join(timeout_s)
        assert not self.is_alive(), "the call in the background never returned"
        if self._error is not None:
            raise self._error
        return self._out


def test_red_an_assertion_in_a_background_call_surfaces_as_itself() -> None:
    def fails() -> None:
        raise AssertionError("planted: the background request got a 500")

    with pytest.raises(AssertionError, match="planted: the background request got a 500"):
        Background(fails).result()


def wait_for(what: str, ready: Callable[[], bool], limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not ready():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def test_sigterm_drain_flushes_queued_storage_writes(tiny_chat_folder: str, tmp_path: Path,
                                                     procs: list[Served]) -> None:
    """Writes are held (tests/slow_storage.py) until the drain has begun, so when SIGTERM
    comes, one request has finished with its pages' writes queued; another is held on its
    storage probe, so it is in flight. The drain lets the second finish, then flushes
    every write before the process exits 0."""
    kv, hold = tmp_path / "kv", tmp_path / "hold"
    hold.mkdir()
    (hold / "writes").touch()
    config = write_config(tmp_path / "serve.yaml", tiny_chat_folder, storage="tests.slow_storage:HeldFileBackend",
                          storage_dir=str(kv), storage_flush_timeout_s=30, storage_timeout_s=120)
    server = start(procs, config, env={HOLD_ENV: str(hold)})
    ref = server.generate(PROMPT)
    info = server.info()
    st, host = info["storage"], info["host"]
    # The request is done, none of its pages is on disk: their writes are queued (or
    # their host copies, which queue them, are still in flight).
    assert st["queued_bytes"] > 0 or host["host_pages"]["copying"] > 0, (st, host)
    assert pages_on_disk(kv) == 0

    (hold / "reads").touch()
    prompt_b = tokens(12, 67)
    second = Background(lambda: server.generate(prompt_b, max_new_tokens=100))
    try:
        wait_for("the second request's storage probe", (hold / "read-held").exists)
        server.terminate()
        wait_for("the drain", lambda: "draining" in server.log_text())
    finally:
        (hold / "reads").unlink()
        (hold / "writes").unlink()
    out_b = second.result()
    assert server.proc.wait(timeout=45) == 0
    log = server.log_text()
    assert "storage_flushed" in log and "complete=True" in log, log
    assert "in_flight=1" in log, log  # the signal came while the second request was held
    assert out_b["meta_info"]["completion_tokens"] == 100  # ... and the drain let it finish
    # Both prompts' pages landed (16 whole pages each, more for their outputs).
    assert FileBackend(kv, 1 << 30).stats()["pages"] >= 32

    # A restarted server (plain `file` backend over the same directory) serves both from there.
    plain = write_config(tmp_path / "plain.yaml", tiny_chat_folder, storage="file", storage_dir=str(kv))
    again = start(procs, plain)
    for prompt, before, params in ((PROMPT, ref, {}), (prompt_b, out_b, {"max_new_tokens": 100})):
        out = again.generate(prompt, **params)
        assert out["meta_info"]["cached_tokens_by_tier"]["storage"] == 64, out["meta_info"]
        assert out["output_ids"] == before["output_ids"] and logprobs(out) == logprobs(before)
    assert again.stop() == 0


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def test_failing_backend_switches_off_and_admin_switches_it_on(tiny_chat_folder: str) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    overrides = {"cache.prefix": "radix", "cache.num_pages": 64, "hicache.host_pages": 128,
                 "hicache.storage": "redis", "hicache.redis_url": dead, "hicache.storage_fail_limit": 2,
                 "hicache.storage_timeout_s": 0.5, "deterministic": True}

    async with serve_http(tiny_chat_folder, overrides) as (_engine, client):
        async def info() -> dict[str, Any]:
            resp = await client.get("/server_info")
            assert resp.status == 200
            return dict((await resp.json())["storage"])

        async def enabled_metric() -> float:
            resp = await client.get("/metrics")
            assert resp.status == 200
            return _metric(await resp.text(), "tierserve_storage_enabled")

        async def generate(seed: int) -> dict[str, Any]:
            resp = await client.post("/generate", json={"input_ids": tokens(seed, 30), "sampling_params": GREEDY})
            assert resp.status == 200, await resp.text()
            return dict(await resp.json())

        assert (await info())["enabled"] and await enabled_metric() == 1
        for seed in range(3):
            out = await generate(seed)
            assert out["meta_info"]["cached_tokens"] == 0
        deadline = time.monotonic() + 10
        while (await info())["enabled"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        st = await info()
        assert not st["enabled"] and st["switched_off"] == 1, st
        assert await enabled_metric() == 0

        ws = await client.ws_connect("/admin/ws")
        try:
            for bad in ("yes", 1, "true"):
                await ws.send_json({"type": "storage", "enable": bad, "id": 7})
                reply = await ws.receive_json(timeout=5)
                assert reply["type"] == "error" and "enable" in reply["message"], reply
                assert not (await info())["enabled"]  # nothing changed
            await ws.send_json({"type": "storage", "id": 8})
            reply = await ws.receive_json(timeout=5)
            assert reply == {"type": "storage", "ok": True, "enabled": False, "id": 8}, reply

            await ws.send_json({"type": "storage", "enable": True, "id": 9})
            reply = await ws.receive_json(timeout=5)
            assert reply == {"type": "storage", "ok": True, "enabled": True, "id": 9}, reply
            assert (await info())["enabled"] and await enabled_metric() == 1

            await ws.send_json({"type": "storage", "enable": 0})
            reply = await ws.receive_json(timeout=5)
            assert reply["type"] == "error", reply
            assert (await info())["enabled"]  # still on
        finally:
            await ws.close()

        # Still dead: it switches itself off again, and requests are served all along.
        for seed in range(3, 6):
            await generate(seed)
        deadline = time.monotonic() + 10
        while (await info())["enabled"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        st = await info()
        assert not st["enabled"] and st["switched_off"] == 2, st
