"""The real `tierserve serve` process on a free port, shared by the HTTP tests.

Test modules load this file with `pytest_plugins`, so the session server starts once for
all of them. Every test that uses `server` ends with a check that the pool is idle and
every page is free again: no HTTP path may leak a request.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import aiohttp
import orjson
import pytest
import requests

ROOT = Path(__file__).resolve().parent.parent
MAX_QUEUED = 20
# A greedy completion long enough (over a second on the tiny model) to outlast a burst of refusals.
GOOD = {"prompt": "A long story:", "max_tokens": 600, "temperature": 0, "ignore_eos": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`python -m plugins.cli serve` with the tiny chat model; stop() returns its exit code."""

    def __init__(self, model_folder: str, *overrides: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        sets = [
            f"model.path={model_folder}", "cache.num_pages=256", "cache.page_size=4",
            f"server.port={self.port}", "debug.check_invariants=true",
            # One intra-op thread: OpenMP barriers crawl when other processes share the cores.
            "model.num_threads=1", *overrides,
        ]
        args = [sys.executable, "-m", "plugins.cli", "serve"]
        for item in sets:
            args += ["--set", item]
        self.log = tempfile.NamedTemporaryFile("w+", prefix="tierserve-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_healthy()

    def _wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if requests.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except (requests.ConnectionError, requests.Timeout):  # not up yet, or busy starting
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not healthy after {timeout_s} s:\n{self.log_text()}")

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-4000:]

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.terminate()
        try:
            code = self.proc.wait(timeout=45)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.close()
        return code

    def info(self, headers: dict[str, str] | None = None) -> dict[str, Any]:
        resp = requests.get(f"{self.url}/server_info", headers=headers, timeout=5)
        resp.raise_for_status()
        return dict(resp.json())

    def wait_idle(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Server info once nothing runs or waits; fails if pages stay held."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.info()
            pool = info["pool"]
            idle = pool["running"] == 0 and pool["waiting"] == 0
            if idle and pool["free_pages"] + pool["cached_pages"] == pool["usable_pages"]:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle: {pool}")
            time.sleep(0.02)


@pytest.fixture(scope="session")
def http_server(tiny_chat_folder: str) -> Iterator[ServerProcess]:
    server = ServerProcess(tiny_chat_folder, f"server.max_queued_requests={MAX_QUEUED}")
    yield server
    code = server.stop()
    assert code == 0, f"server exit code {code}"


@pytest.fixture
def server(http_server: ServerProcess) -> Iterator[ServerProcess]:
    yield http_server
    http_server.wait_idle()


def post(server: ServerProcess, path: str, body: Any = None, **kw: Any) -> requests.Response:
    return requests.post(f"{server.url}{path}", json=body, timeout=30, **kw)


def assert_error(resp: requests.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """An OpenAI error object with `status`; returns its "error" dict."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = dict(body["error"])
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err



class InFlight:
    """A streamed completion that is generating while the test does something else.

    `async with InFlight(url) as good:` returns once the first chunk has arrived, so
    the server is running it; `good.finished` says whether its finish has arrived yet
    (the stream is read all along), `await good.text()` waits for the whole text.
    An error event in the stream or a status other than 200 fails `text()`.
    """

    def __init__(self, url: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> None:
        self.url = url
        self.body = {**(body or GOOD), "stream": True}
        self.headers = headers
        self.finished = False
        self._texts: list[str] = []
        self._first = asyncio.Event()

    async def __aenter__(self) -> Self:
        self._session = aiohttp.ClientSession(headers=self.headers)
        self._task = asyncio.ensure_future(self._read())
        first = asyncio.ensure_future(self._first.wait())
        await asyncio.wait({self._task, first}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        first.cancel()
        if self._task.done():
            self._task.result()  # raises what went wrong
            raise AssertionError("the good request finished before the test could use it")
        assert self._first.is_set(), "no first chunk within 30 s"
        return self

    async def _read(self) -> str:
        async with self._session.post(self.url, json=self.body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                event = orjson.loads(line[6:])
                assert "error" not in event, event
                for choice in event["choices"]:
                    self._texts.append(choice["text"])
                    self.finished = self.finished or choice["finish_reason"] is not None
                self._first.set()
        return "".join(self._texts)

    async def text(self) -> str:
        return await self._task

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()  # a no-op once text() has returned
        await asyncio.gather(self._task, return_exceptions=True)
        await self._session.close()
