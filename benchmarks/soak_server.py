"""A `tierserve serve` subprocess for the soak: written config, loopback port, RSS, idle wait."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from benchmarks.serving import wait_healthy

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SoakServer:
    """`python -m plugins.cli serve --config <yaml>` on 127.0.0.1 (this checkout's code)."""

    def __init__(self, config: dict[str, Any], folder: Path, name: str, env: dict[str, str] | None = None) -> None:
        """env: variables set for the server process beside this one's."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {**config, "server": {**config.get("server", {}), "host": "127.0.0.1", "port": self.port}}
        self.config_path = folder / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"tierserve-soak-{name}-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "plugins.cli", "serve", "--config", str(self.config_path)],
                                     cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    async def wait_healthy(self, session: aiohttp.ClientSession, timeout_s: float = 120.0) -> None:
        problem = await wait_healthy(session, self.url, self.proc.poll, timeout_s, 0.1)
        if problem is not None:
            raise RuntimeError(f"server {problem}:\n{self.log_tail()}")

    def rss_mib(self) -> float:
        """VmRSS of the server process, MiB (Linux /proc)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS in /proc status")

    async def get(self, session: aiohttp.ClientSession, path: str) -> dict[str, Any]:
        async with session.get(self.url + path) as resp:
            resp.raise_for_status()
            return dict(await resp.json())

    async def wait_settled(self, session: aiohttp.ClientSession, timeout_s: float = 60.0) -> dict[str, Any]:
        """Admin stats once nothing runs or waits and no host copy or storage write is pending."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = await self.get(session, "/admin/stats")
            host, storage = stats["host"], stats["storage"]
            copying = host is not None and host["host_pages"]["copying"] > 0
            queued = storage is not None and storage.get("queued_bytes", 0) > 0
            if stats["idle"] and not copying and not queued:
                return stats
            if time.monotonic() > deadline:
                return stats  # the caller reports what is still busy
            await asyncio.sleep(0.1)

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM and the exit status (-9 if it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            return -signal.SIGKILL
        finally:
            self.log.close()

    def log_tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]
