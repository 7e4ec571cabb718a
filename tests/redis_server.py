"""A real `redis-server` for the tests, on a free loopback port, installed if missing.

Debian's package is installed with apt-get when the binary is absent and we are root
(CI machines are fresh); elsewhere the tests that need it skip with the reason.
Persistence is off (`--save "" --appendonly no`): every server starts empty.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def ensure_redis_server() -> str:
    """The redis-server binary, installing Debian's package if needed; skips if impossible."""
    found = shutil.which("redis-server")
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("redis-server is not installed and cannot be installed here (not root / no apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "redis-server"]
    if subprocess.run(install, env=env, capture_output=True, check=False).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=False)
        done = subprocess.run(install, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"could not install redis-server: {done.stderr[-300:]}")
    found = shutil.which("redis-server")
    if not found:
        pytest.skip("redis-server still missing after apt-get install")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tempfile.mkdtemp(prefix="tierserve-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not listen on {self.port}")

    def kill(self) -> None:
        """Stop it hard (kill -9): the tests of a dead Redis."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


@contextmanager
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(ensure_redis_server())
    server.start()
    try:
        yield server
    finally:
        server.kill()
        shutil.rmtree(server.dir, ignore_errors=True)
