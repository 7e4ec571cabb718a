"""Two tierserve replicas behind the routers people run: SGLang's `sglang-router` and vLLM's
`vllm-router` (both from PyPI, real processes). The routers register the replicas under
the served model (from /model_info and /server_info), every request sent through them
with the official OpenAI client is answered, and each answer equals what one replica
gives alone (deterministic mode: the replica and the batch do not change tokens). SGLang's
router also reads the replicas' load (/get_load) and flushes their caches (/flush_cache).
vLLM's router follows the replicas' KV events (kv_aware), fills a gap in them from the
replay socket, and follows a block from the device to the host tier.
"""

from __future__ import annotations

import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from tests.test_http_fixtures import ServerProcess, free_port

BIN = Path(sys.executable).parent
ROUTERS = {
    "sglang": lambda port, workers: [str(BIN / "sglang-router"), "launch", "--worker-urls", *workers,
                                     "--policy", "cache_aware", "--port", str(port), "--host", "127.0.0.1"],
    "vllm": lambda port, workers: [str(BIN / "vllm-router"), "--worker-urls", *workers, "--policy", "cache_aware",
                                   "--port", str(port), "--host", "127.0.0.1"],
}
PROMPTS = [f"Request {i}: the lighthouse keeper wrote in the log that" for i in range(8)]


@pytest.fixture(scope="module")
def replicas(tiny_chat_folder: str) -> Iterator[list[ServerProcess]]:
    """Each publishing its KV events on a ZMQ endpoint of its own (`kv_endpoint`)."""
    servers = []
    for _ in range(2):
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        server = ServerProcess(tiny_chat_folder, "deterministic=true", "cache.prefix=radix",
                               "kv_events.publisher=zmq", f"kv_events.endpoint={endpoint}")
        server.kv_endpoint = endpoint  # type: ignore[attr-defined]
        servers.append(server)
    yield servers
    for s in servers:
        s.stop()


class Router:
    def __init__(self, kind: str, workers: list[str], extra: tuple[str, ...] = ()) -> None:
        if not (BIN / f"{kind}-router").exists():
            pytest.fail(f"{kind}-router is not installed (make test installs it: tierserve[test])")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{kind}-router-", suffix=".log")  # noqa: SIM115
        self.proc = subprocess.Popen([*ROUTERS[kind](self.port, workers), *extra], stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def wait_models(self, timeout_s: float = 60.0) -> list[str]:
        """The model ids the router lists once it serves."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                resp = requests.get(f"{self.url}/v1/models", timeout=2)
                if resp.status_code == 200 and resp.json().get("data"):
                    return [m["id"] for m in resp.json()["data"]]
            except (requests.ConnectionError, requests.Timeout):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"router not serving after {timeout_s} s:\n{self.log_text()}")

    def log_text(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-4000:]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def completions(base_url: str, model: str) -> list[str]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60)
    return [client.completions.create(model=model, prompt=p, max_tokens=12, temperature=0).choices[0].text
            for p in PROMPTS]


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_two_replicas_behind_a_router(replicas: list[ServerProcess], kind: str) -> None:
    model = replicas[0].info()["served_model_name"]
    alone = completions(replicas[0].url, model)
    router = Router(kind, [r.url for r in replicas])
    try:
        models = router.wait_models()
        assert model in models, (models, router.log_text())
        assert completions(router.url, model) == alone
        for r in replicas:
            r.wait_idle()  # nothing held on either replica once idle
        if kind == "sglang":  # the gateway's own views of its workers
            loads = requests.get(f"{router.url}/get_loads", timeout=10).json()
            assert sorted(w["worker"] for w in loads["workers"]) == sorted(r.url for r in replicas)
            assert all(w["load"] >= 0 for w in loads["workers"]), loads  # /get_load parsed
            flushed = requests.post(f"{router.url}/flush_cache", timeout=10).json()
            assert flushed.get("workers_flushed") == 2, flushed
            assert all(r.info()["pool"]["cached_pages"] == 0 for r in replicas)
    finally:
        router.stop()


def test_vllm_router_kv_aware_follows_the_kv_events(replicas: list[ServerProcess]) -> None:
    """vLLM's router subscribed to both replicas' ZMQ KV events (`--policy kv_aware`): a
    prompt one replica has cached is routed to that replica, whichever it is."""
    info = replicas[0].info()
    model, page = info["served_model_name"], info["block_size"]
    sources = [arg for r in replicas for arg in ("--kv-event-source", f"{r.url}={r.kv_endpoint}")]  # type: ignore[attr-defined]
    router = Router("vllm", [r.url for r in replicas],
                    ("--policy", "kv_aware", *sources, "--kv-event-block-size", str(page), "--kv-event-model", model))
    try:
        router.wait_models()
        time.sleep(1.0)  # the router's SUB sockets join before the first events
        rng = random.Random(3)
        for trial in range(4):
            warm = replicas[trial % 2]
            ids = [rng.randint(100, 40000) for _ in range(120)]
            body = {"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0}
            requests.post(f"{warm.url}/v1/completions", json=body, timeout=60).raise_for_status()
            time.sleep(0.3)  # the events reach the router
            routed = requests.post(f"{router.url}/v1/completions", json={**body, "prompt": ids + [7, 8]}, timeout=60)
            routed.raise_for_status()
            cached = routed.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 100, (trial, cached, router.log_text())  # it ran where the prefix was
    finally:
        router.stop()


def test_vllm_router_started_late_learns_the_cache(replicas: list[ServerProcess]) -> None:
    """A kv_aware router started (as after a restart) when both replicas already hold
    prompts: its subscriptions are answered with each replica's cache as a snapshot
    (plugins/kv_events_zmq.py), so a follow-up of each prompt runs where its prefix is —
    the replica's own device hit, not the router's log, says so. Without the snapshot the
    router knows none of them (tests/test_kv_events_zmq.py plants that)."""
    info = replicas[0].info()
    model, page = info["served_model_name"], info["block_size"]
    rng = random.Random(11)
    prompts = [[rng.randint(100, 40000) for _ in range(120)] for _ in range(6)]
    holders = [1, 1, 0, 1, 0, 0]  # not what round-robin (or any fixed alternation) would pick
    for ids, holder in zip(prompts, holders):  # before the router exists: no subscriber sees these events
        body = {"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0}
        requests.post(f"{replicas[holder].url}/v1/completions", json=body, timeout=60).raise_for_status()
    sources = [arg for r in replicas for arg in ("--kv-event-source", f"{r.url}={r.kv_endpoint}")]  # type: ignore[attr-defined]
    router = Router("vllm", [r.url for r in replicas],
                    ("--policy", "kv_aware", *sources, "--kv-event-block-size", str(page), "--kv-event-model", model))
    try:
        router.wait_models()
        time.sleep(1.5)  # the SUB sockets join; the snapshots arrive
        for i, (ids, holder) in enumerate(zip(prompts, holders)):
            body = {"model": model, "prompt": ids + [7, 8], "max_tokens": 2, "temperature": 0}
            before = replicas[holder].info()["cache"]["prefix_hit_tokens"]
            routed = requests.post(f"{router.url}/v1/completions", json=body, timeout=60)
            routed.raise_for_status()
            cached = routed.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            hit = replicas[holder].info()["cache"]["prefix_hit_tokens"] - before
            assert cached >= 100 and hit >= 100, (i, cached, hit, router.log_text())
    finally:
        router.stop()


def routed_to_holder(router: Router, replicas: list[ServerProcess], model: str, holder: int, trials: int,
                     place: Any, seed: int) -> int:
    """How many of `trials` prompts the router sent to replica `holder`, each prompt's
    blocks first made known to the router by `place(ids)` (no replica computed them)."""
    rng = random.Random(seed)
    page = replicas[0].info()["block_size"]
    hits = 0
    for _ in range(trials):
        ids = [rng.randint(100, 40000) for _ in range(8 * page)]
        place(ids, page, rng)
        time.sleep(0.8)  # the events reach the router
        before = [r.info()["cache"]["prefix_query_tokens"] for r in replicas]
        body = {"model": model, "prompt": ids + [7, 8], "max_tokens": 1, "temperature": 0}
        requests.post(f"{router.url}/v1/completions", json=body, timeout=60).raise_for_status()
        after = [r.info()["cache"]["prefix_query_tokens"] for r in replicas]
        hits += after[holder] > before[holder]
    return hits


class InProcessSource:
    """KV-event publishers in the test process, registered as the replicas' event sources
    (replica 0's with its replay socket), so a test can publish events no replica computed
    and plant drops; `hidden[0]` True drops what replica 0's PUB socket sends meanwhile
    (kept for replay). `rival(ids, page)`: replica 1 claims the prompt's first two pages,
    so a router that knows nothing of replica 0's blocks deterministically picks replica 1
    (with no blocks known anywhere its choice is its own, and differed between runs)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from kernel.config import KvEventsConfig
        from plugins import kv_events_zmq as kz

        self.hidden = [False]
        hidden = self.hidden
        self.pub_at, self.replay_at = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        send = kz.ZmqKvPublisher._send

        def drop_while_hidden(p: Any, pub: Any, frames: Any) -> None:  # replica 0's PUB socket only
            if not (hidden[0] and p.config.endpoint == self.pub_at):
                send(p, pub, frames)

        monkeypatch.setattr(kz.ZmqKvPublisher, "_send", drop_while_hidden)
        self.rival_at = f"tcp://127.0.0.1:{free_port()}"
        self.rival_publisher = kz.ZmqKvPublisher(KvEventsConfig(publisher="zmq", endpoint=self.rival_at))
        self.publisher = kz.ZmqKvPublisher(KvEventsConfig(publisher="zmq", endpoint=self.pub_at,
                                                          replay_endpoint=self.replay_at))

    def rival(self, ids: list[int], page: int, rng: random.Random) -> None:
        from cache.kv_events import BlockStored

        self.rival_publisher.publish([BlockStored([rng.randint(1, 2**62) for _ in range(2)], None, ids[: 2 * page],
                                                  page, medium="device")])

    def router(self, replicas: list[ServerProcess]) -> Router:
        model, page = replicas[0].info()["served_model_name"], replicas[0].info()["block_size"]
        return Router("vllm", [r.url for r in replicas], (
            "--policy", "kv_aware", "--kv-event-block-size", str(page), "--kv-event-model", model,
            "--kv-event-source", f"{replicas[0].url}={self.pub_at}",
            "--kv-event-replay-source", f"{replicas[0].url}={self.replay_at}",
            "--kv-event-source", f"{replicas[1].url}={self.rival_at}"))

    def close(self) -> None:
        self.publisher.close()
        self.rival_publisher.close()

    def routed_to_replica0(self, replicas: list[ServerProcess], place: Any, seed: int) -> int:
        """Behind a fresh kv_aware router: of 4 prompts placed by `place`, how many went to
        replica 0; the router and the publishers are stopped after."""
        router = self.router(replicas)
        try:
            router.wait_models()
            time.sleep(1.0)  # the SUB sockets join
            return routed_to_holder(router, replicas, replicas[0].info()["served_model_name"], 0, 4, place, seed)
        finally:
            router.stop()
            self.close()


@pytest.mark.parametrize("framing", ["topic, seq, payload", "planted: seq, payload"])
def test_vllm_router_fills_a_gap_from_the_replay_socket(replicas: list[ServerProcess], framing: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch the router's SUB socket never saw (dropped on the PUB side: a gap in seq) is
    fetched from the replay socket when the next batch arrives, and the router routes by
    it. The publisher runs here, as replica 0's event source, so the drop can be planted;
    its blocks are ones no replica computed, so only the replayed batch can send the
    prompt to replica 0 (replica 1 claims the first two pages: without the replay the
    router picks it). Planted: vLLM's older
    reply framing without the topic frame, which vllm-router 0.1.17 ignores -> red."""
    from cache.kv_events import BlockStored
    from plugins import kv_events_zmq as kz

    if framing.startswith("planted"):
        def three_frames(self: Any, replay: Any, kept: Any) -> None:
            client, empty, start = replay.recv_multipart()
            for seq, payload in list(kept):
                if seq >= int.from_bytes(start, "big"):
                    replay.send_multipart((client, empty, seq.to_bytes(8, "big"), payload))
            replay.send_multipart((client, empty, kz.END_SEQ, b""))

        monkeypatch.setattr(kz.ZmqKvPublisher, "_answer", three_frames)
    source = InProcessSource(monkeypatch)
    publisher, hidden = source.publisher, source.hidden
    page = replicas[0].info()["block_size"]

    def filler(rng: random.Random) -> BlockStored:
        return BlockStored([rng.randint(1, 2**62)], None, [rng.randint(100, 40000) for _ in range(page)], page)

    def place(ids: list[int], size: int, rng: random.Random) -> None:
        source.rival(ids, size, rng)
        publisher.publish([filler(rng)])  # seen live: the router's last seq
        time.sleep(0.3)
        hidden[0] = True
        publisher.publish([BlockStored([rng.randint(1, 2**62) for _ in range(8)], None, ids, size)])
        time.sleep(0.3)
        hidden[0] = False
        publisher.publish([filler(rng)])  # seq jumps by 2: the router asks the replay socket

    hits = source.routed_to_replica0(replicas, place, seed=11)
    if framing.startswith("planted"):
        assert hits == 0, f"the router used a replay it should have ignored ({hits} of 4)"
    else:
        assert hits == 4, f"{hits} of 4 prompts went to the replica whose replayed blocks hold them"


@pytest.mark.parametrize("events", ["device removed, host stored", "planted: device removed only"])
def test_vllm_router_follows_a_block_to_the_host_tier(replicas: list[ServerProcess], events: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """What a replica with a host tier publishes when a page leaves the device but stays
    in host memory (tests/test_kv_events_zmq.py `test_tiers_name_their_medium`):
    `BlockStored(medium="host")` and `BlockRemoved(medium="device")`. The router keeps the
    replica as the block's holder (its host credit, `--kv-penalty-host`) and sends the
    prompt there. Planted: the host copy not published — the router forgets the block."""
    from cache.kv_events import BlockRemoved, BlockStored

    source = InProcessSource(monkeypatch)

    def place(ids: list[int], size: int, rng: random.Random) -> None:
        source.rival(ids, size, rng)
        hashes = [rng.randint(1, 2**62) for _ in range(len(ids) // size)]
        source.publisher.publish([BlockStored(hashes, None, ids, size, medium="device")])
        offloaded: list[Any] = [BlockStored(hashes, None, ids, size, medium="host")]
        if events.startswith("planted"):
            offloaded = []
        source.publisher.publish([*offloaded, BlockRemoved(hashes, medium="device")])

    hits = source.routed_to_replica0(replicas, place, seed=12)
    if events.startswith("planted"):
        assert hits == 0, f"the router kept a block no tier holds ({hits} of 4)"
    else:
        assert hits == 4, f"{hits} of 4 prompts went to the replica holding them in host memory"
