"""One command for a cluster on one machine, laid out as it is deployed on many (issue 26):

    python -m plugins.cluster --replicas 2 --router sglang        # SGLang's gateway, cache_aware
    python -m plugins.cluster --replicas 2 --router vllm          # vLLM's router, kv_aware

It starts a `redis-server` (the storage tier every replica shares), `--replicas`
`tierserve serve` processes from `--config` (default config/cluster/replica.yaml), each
pinned to its share of this process's cores, with its own port and KV-event endpoint,
and the router in front (`sglang-router` or `vllm-router`, installed beside this
Python). It prints the router's URL and runs until Ctrl-C or SIGTERM, then stops them all.
A replica that dies is dropped by the router's health check; a prefix it computed is
a storage hit on the others.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "config" / "cluster" / "replica.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def core_shares(count: int) -> list[set[int]]:
    """This process's cores cut into `count` contiguous shares (a share may be shared when
    there are fewer cores than replicas)."""
    cores = sorted(os.sched_getaffinity(0))
    if count <= len(cores):
        size = len(cores) // count
        return [set(cores[i * size : (i + 1) * size]) for i in range(count)]
    return [{cores[i % len(cores)]} for i in range(count)]


@dataclass
class Replica:
    url: str
    kv_endpoint: str
    proc: subprocess.Popen[bytes]


@dataclass
class Cluster:
    redis_url: str
    replicas: list[Replica]
    router_url: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    folder: str = ""

    def stop(self) -> None:
        for proc in reversed(self.procs):  # the router first, Redis last
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def binary(name: str) -> str:
    found = Path(sys.executable).parent / name
    if found.exists():
        return str(found)
    which = shutil.which(name)
    if which is None:
        raise FileNotFoundError(f"{name} is not installed (pip install {name.replace('-server', '')}, "
                                "or apt-get install redis-server)")
    return which


def wait_ok(url: str, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except (OSError, urllib.error.URLError):  # not up yet (HTTPError: starting)
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout_s} s ({url})")


def start(replicas: int, router: str, config: Path = DEFAULT_CONFIG, overrides: tuple[str, ...] = (),
          router_args: tuple[str, ...] = (), log_dir: Path | None = None) -> Cluster:
    """Start Redis, the replicas and the router; ready when this returns."""
    folder = tempfile.mkdtemp(prefix="tierserve-cluster-")
    logs = log_dir or Path(folder)
    cluster = Cluster(redis_url="", replicas=[], router_url="", folder=folder)

    def spawn(args: list[str], name: str, **kw: Any) -> subprocess.Popen[bytes]:
        with open(logs / f"{name}.log", "wb") as out:  # the child has its own copy of the descriptor
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, **kw)
        cluster.procs.append(proc)
        return proc

    try:
        port = free_port()
        redis = spawn([binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                       "--appendonly", "no", "--dir", folder], "redis")
        cluster.redis_url = f"redis://127.0.0.1:{port}/0"
        _wait_port(port, redis)
        for i, cores in enumerate(core_shares(replicas)):
            port, kv = free_port(), f"tcp://127.0.0.1:{free_port()}"
            sets = [f"server.port={port}", f"hicache.redis_url={cluster.redis_url}", f"kv_events.endpoint={kv}",
                    f"model.num_threads={len(cores)}", *overrides]
            args = [sys.executable, "-m", "plugins.cli", "serve", "--config", str(config)]
            for item in sets:
                args += ["--set", item]
            proc = spawn(args, f"replica{i}", preexec_fn=lambda c=cores: os.sched_setaffinity(0, c))
            cluster.replicas.append(Replica(f"http://127.0.0.1:{port}", kv, proc))
        for i, r in enumerate(cluster.replicas):
            wait_ok(f"{r.url}/health", r.proc, f"replica {i}")
        with urllib.request.urlopen(f"{cluster.replicas[0].url}/server_info", timeout=5) as resp:
            info = orjson.loads(resp.read())
        port = free_port()
        urls = [r.url for r in cluster.replicas]
        if router == "sglang":
            args = [binary("sglang-router"), "launch", "--worker-urls", *urls, "--policy", "cache_aware"]
        else:
            sources = [a for r in cluster.replicas for a in ("--kv-event-source", f"{r.url}={r.kv_endpoint}")]
            args = [binary("vllm-router"), "--worker-urls", *urls, "--policy", "kv_aware", *sources,
                    "--kv-event-block-size", str(info["block_size"]), "--kv-event-model", info["served_model_name"]]
        proc = spawn([*args, "--host", "127.0.0.1", "--port", str(port), *router_args], "router")
        cluster.router_url = f"http://127.0.0.1:{port}"
        wait_ok(f"{cluster.router_url}/v1/models", proc, "the router")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server did not listen on {port}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--router", choices=("sglang", "vllm"), default="sglang")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="each replica's YAML")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="for every replica")
    p.add_argument("--logs", type=Path, default=Path("."), help="folder for each process's log")
    args = p.parse_args(argv)
    args.logs.mkdir(parents=True, exist_ok=True)
    cluster = start(args.replicas, args.router, args.config, tuple(args.set), log_dir=args.logs)
    print(f"router {cluster.router_url} -> " + ", ".join(r.url for r in cluster.replicas)
          + f"; storage {cluster.redis_url}; logs in {args.logs}", flush=True)
    stop = {"now": False}
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.update(now=True))
    while not stop["now"] and all(proc.poll() is None for proc in cluster.procs[-1:]):
        time.sleep(0.5)
    cluster.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
