"""The storage tier in the engine (dense models): host copies are written to a storage
backend too, and a prompt whose prefix is in storage but not in the tree is fetched into
host pages and loaded back — bit-identical to a cold run in deterministic mode, counted
as storage hits. Every storage fault (missing, truncated, corrupt, slow page, full disk,
a dead server) only makes the tier serve less: the output stays identical and counters
say what happened; a backend that keeps failing is switched off and back on by hand."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cache.host_pool import HostPool
from kernel import Engine
from kernel.tiers.storage_tier import Fetch, StorageTier
from tests import leaks
from tests.conftest import SMOLLM, TINY_OVERRIDES
from tests.slow_storage import Hold
from tests.test_host_tier import GREEDY, TIERED, logprobs, tokens


def make(folder: str, storage_dir: Path, **extra: Any) -> Engine:
    return Engine(None, {"model.path": folder, **TINY_OVERRIDES, **TIERED, "hicache.storage": "file",
                         "hicache.storage_dir": str(storage_dir), **extra})


def tier(engine: Engine) -> Any:
    storage = engine.engine.storage
    assert storage is not None
    return storage


def settle(engine: Engine) -> None:
    """Copies and storage writes in flight land (flush_cache settles them first)."""
    assert engine.flush_cache()


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["output_ids"] == b["output_ids"] and logprobs(a) == logprobs(b)


PROMPT = tokens(1, 60) + tokens(2, 7)


def cold_then_storage_hit(engine: Engine, prompt: list[int] = PROMPT) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the cold run, which writes the prompt's pages through to storage; the same prompt
    after the tree was emptied, so whatever it reuses comes from storage)."""
    ref = engine.generate(prompt, GREEDY)
    settle(engine)
    warm = engine.generate(prompt, GREEDY)
    return ref, warm  # type: ignore[return-value]


def test_storage_hit_is_bit_exact_and_counted(tiny_chat_folder: str, tmp_path: Path) -> None:
    engine = make(tiny_chat_folder, tmp_path)
    try:
        ref, warm = cold_then_storage_hit(engine)
        tiers = warm["meta_info"]["cached_tokens_by_tier"]
        assert ref["meta_info"]["cached_tokens"] == 0
        assert tiers["storage"] == 64 and tiers["device"] == tiers["host"] == 0, tiers
        assert warm["meta_info"]["cached_tokens"] == 64
        assert same(warm, ref)
        stats = engine.engine.stats()["storage"]
        assert stats["written_pages"] >= 16 and stats["read_pages"] == 16 and stats["hit_tokens"] == 64
        assert stats["prefetch"]["completed"] == 1 and stats["backend_stats"]["pages"] >= 16
    finally:
        engine.shutdown()


def test_decode_hit_from_storage(tiny_chat_folder: str, tmp_path: Path) -> None:
    """The second turn reuses tokens the first turn generated, from storage only."""
    engine = make(tiny_chat_folder, tmp_path)
    try:
        first = tokens(3, 30)
        turn1 = engine.generate(first, {**GREEDY, "max_new_tokens": 24})
        turn2 = first + turn1["output_ids"] + tokens(4, 5)  # type: ignore[operator]
        settle(engine)
        warm = engine.generate(turn2, GREEDY)
        tiers = warm["meta_info"]["cached_tokens_by_tier"]  # type: ignore[index]
        assert tiers["storage"] > len(first) and tiers["device"] == 0, tiers
        tier(engine).backend.clear()
        settle(engine)
        cold = engine.generate(turn2, GREEDY)
        assert cold["meta_info"]["cached_tokens"] == 0  # type: ignore[index]
        assert same(warm, cold)  # type: ignore[arg-type]
    finally:
        engine.shutdown()


def test_red_pages_written_under_the_wrong_keys(
    tiny_chat_folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kernel.tiers.storage_tier as storage_mod

    real = storage_mod.StorageTier.write

    def swapped(self: Any, node: Any, items: list[tuple[str, bytes]]) -> None:
        keys, payloads = zip(*items, strict=True)
        # planted: each page's bytes under the key before its own (the first page's are
        # lost). NOTE: not a permutation: tests/test_host_tier.py `one_page_early`.
        real(self, node, list(zip(keys, [*payloads[1:], payloads[-1]], strict=True)))

    monkeypatch.setattr(storage_mod.StorageTier, "write", swapped)
    engine = make(tiny_chat_folder, tmp_path)
    try:
        ref, warm = cold_then_storage_hit(engine)
        assert warm["meta_info"]["cached_tokens_by_tier"]["storage"] > 0
        assert not same(warm, ref)  # the bit-exact compare goes red
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()


class QueuedCopies:
    """The copy worker's CUDA stream, emulated on CPU: a copy queued on it (by `offload`,
    `load_back`) runs only when the stream is synchronized, as a non-blocking transfer to
    or from pinned memory lands only once the stream got to it."""

    def __init__(self) -> None:
        self.queued: list[Callable[[], int]] = []

    def synchronize(self) -> None:
        while self.queued:
            self.queued.pop(0)()


def queue_tier_copies(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Give the host tier's copy worker a `QueuedCopies` stream: its copies land late."""
    import kernel.tiers.host_tier as tier_mod

    stream = QueuedCopies()
    for name in ("offload", "load_back"):
        real = getattr(tier_mod, name)

        def queued(src: Any, src_ids: list[int], dst: Any, dst_ids: list[int], s: Any, real: Any = real) -> int:
            assert s is stream
            stream.queued.append(lambda: real(src, src_ids, dst, dst_ids))
            host_pool = src if isinstance(src, HostPool) else dst
            return len(src_ids) * host_pool.bytes_per_page

        monkeypatch.setattr(tier_mod, name, queued)
    host = engine.engine.host
    assert host is not None
    host.worker.stream = stream  # before any job: only the worker thread reads it then


def test_storage_reads_a_host_copy_once_it_landed(
    tiny_chat_folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA a host copy is only queued when `offload` returns; the storage write that
    reads its host pages must wait for the copy stream (without that wait, storage kept
    whatever the host pages held before: a stale hit, caught by the bit-exact compare)."""
    engine = make(tiny_chat_folder, tmp_path)
    queue_tier_copies(engine, monkeypatch)
    try:
        ref, warm = cold_then_storage_hit(engine)
        assert warm["meta_info"]["cached_tokens_by_tier"]["storage"] == 64
        assert same(warm, ref)
    finally:
        engine.shutdown()


def page_files(root: Path) -> list[Path]:
    """Every stored page file."""
    return [p for p in root.glob("??/*") if not p.name.startswith(".")]


def prompt_page_file(engine: Engine, root: Path, index: int) -> Path:
    """The file of the prompt's page `index` (named by its storage key)."""
    from cache.storage import page_keys

    key = page_keys(PROMPT, tier(engine).fmt)[index]
    return root / key[:2] / key


def damage_and_rerun(engine: Engine, root: Path, damage: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    ref = engine.generate(PROMPT, GREEDY)
    settle(engine)
    assert len(page_files(root)) >= 16
    damage(prompt_page_file(engine, root, 8))  # the ninth page (and so all after it) is unusable
    warm = engine.generate(PROMPT, GREEDY)
    return ref, warm  # type: ignore[return-value]


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


@pytest.mark.parametrize(("damage", "reason"), [(Path.unlink, "missing"), (truncate, "truncated"),
                                                (flip_a_byte, "corrupt")])
def test_a_bad_page_is_recomputed(tiny_chat_folder: str, tmp_path: Path, damage: Any, reason: str) -> None:
    engine = make(tiny_chat_folder, tmp_path)
    try:
        ref, warm = damage_and_rerun(engine, tmp_path, damage)
        assert warm["meta_info"]["cached_tokens_by_tier"]["storage"] == 8 * 4  # the pages before it
        assert same(warm, ref)
        assert tier(engine).stats()["backend_stats"]["failures"][reason] == 1
    finally:
        engine.shutdown()


def slow_read_is_not_waited_for(engine: Engine, hold: Hold, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prompt's pages are in storage, but their read is held until the test lets it
    go: the request must time out (`storage_timeout_s`) and compute while it is held."""
    backend = tier(engine).backend
    ref = engine.generate(PROMPT, GREEDY)
    settle(engine)
    monkeypatch.setattr(backend, "get_pages", hold.wrap(backend.get_pages))
    warm = engine.generate(PROMPT, GREEDY)
    assert hold.returned == 0, "the request waited for the held storage read"
    assert warm["meta_info"]["cached_tokens"] == 0
    assert same(warm, ref)  # type: ignore[arg-type]
    assert tier(engine).counters.prefetch["timed_out"] == 1
    hold.release()
    settle(engine)  # the late read still lands in the tree, for later requests
    assert tier(engine).counters.prefetch["completed"] + tier(engine).counters.prefetch["revoked"] == 1


def test_a_slow_storage_read_times_out_and_computes(
    tiny_chat_folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make(tiny_chat_folder, tmp_path, **{"hicache.storage_timeout_s": 0.2})
    try:
        slow_read_is_not_waited_for(engine, Hold(), monkeypatch)
    finally:
        engine.shutdown()


def test_red_a_fetch_waited_for_past_its_deadline(
    tiny_chat_folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bug: admission waits for a fetch in flight whatever its deadline. The read is
    held for 1 s (then let through by the hold itself): the request waits for it."""
    real_wait = StorageTier.wait

    def waits_for_the_read(self: StorageTier, req: Any, *args: Any) -> bool:
        return isinstance(req.storage_fetch, Fetch) or real_wait(self, req, *args)

    monkeypatch.setattr(StorageTier, "wait", waits_for_the_read)
    engine = make(tiny_chat_folder, tmp_path, **{"hicache.storage_timeout_s": 0.2})
    try:
        with pytest.raises(AssertionError, match="the request waited for the held storage read"):
            slow_read_is_not_waited_for(engine, Hold(limit_s=1.0), monkeypatch)
    finally:
        engine.shutdown()


def test_a_full_disk_writes_nothing_and_changes_no_output(
    tiny_chat_folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cache.storage.file_backend as file_mod

    def no_space(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(file_mod, "write_file", no_space)
    engine = make(tiny_chat_folder, tmp_path, **{"hicache.storage_fail_limit": 1000})
    try:
        ref, warm = cold_then_storage_hit(engine)
        assert warm["meta_info"]["cached_tokens"] == 0 and same(warm, ref)
        stats = tier(engine).stats()
        assert stats["backend_stats"]["failures"]["write_error"] > 0 and stats["written_pages"] == 0
        assert stats["enabled"]
    finally:
        engine.shutdown()


def test_a_dead_redis_is_a_miss_then_switched_off_then_back_on(tiny_chat_folder: str, tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    engine = make(tiny_chat_folder, tmp_path, **{
        "hicache.storage": "redis", "hicache.redis_url": f"redis://127.0.0.1:{port}/0",
        "hicache.storage_timeout_s": 0.3, "hicache.storage_fail_limit": 3})
    try:
        outs = [engine.generate(tokens(40 + i, 30), GREEDY) for i in range(4)]
        settle(engine)
        stats = tier(engine).stats()
        failures = tier(engine).backend.stats()["failures"]  # the tier's copy is refreshed in the background
        assert failures["unavailable"] >= 1 and failures["unavailable"] + failures["write_error"] >= 3
        assert not stats["enabled"] and stats["switched_off"] == 1  # switched off, with a log line
        again = engine.generate(tokens(40, 30), GREEDY)
        assert same(again, outs[0])  # type: ignore[arg-type]
        assert tier(engine).counters.prefetch["issued"] <= 3 + 1  # no probes while off
        engine.engine.set_storage(True)
        assert tier(engine).enabled and tier(engine).failing == 0
    finally:
        engine.shutdown()


def test_shutdown_finishes_queued_writes(tiny_chat_folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import cache.storage.file_backend as file_mod

    real = file_mod.write_file

    def slow_write(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.02)
        return real(*args, **kwargs)

    monkeypatch.setattr(file_mod, "write_file", slow_write)
    engine = make(tiny_chat_folder, tmp_path)
    engine.generate(PROMPT, GREEDY)
    engine.shutdown()  # writes still queued land first
    assert len(page_files(tmp_path)) == (len(PROMPT) + 7) // 4  # prompt + the tokens computed after it
    again = make(tiny_chat_folder, tmp_path)  # a new process over the same directory
    try:
        warm = again.generate(PROMPT, GREEDY)
        assert warm["meta_info"]["cached_tokens_by_tier"]["storage"] == 64
    finally:
        again.shutdown()


def test_storage_needs_a_host_tier(tiny_chat_folder: str, tmp_path: Path) -> None:
    from kernel.config import ConfigError

    with pytest.raises(ConfigError, match="host tier"):
        Engine(None, {"model.path": tiny_chat_folder, **TINY_OVERRIDES, "cache.prefix": "radix",
                      "hicache.storage": "file", "hicache.storage_dir": str(tmp_path)})


async def test_metrics_and_server_info_report_the_storage_tier(tiny_chat_folder: str, tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from tests.inprocess import serve_http

    overrides = {"cache.prefix": "radix", **TIERED, "hicache.storage": "file", "hicache.storage_dir": str(tmp_path)}
    async with serve_http(tiny_chat_folder, overrides) as (engine, client):
        await engine.generate(PROMPT, GREEDY)
        await engine.settle_copies()
        assert engine.flush_cache()[0]
        warm = await engine.generate(PROMPT, GREEDY)
        assert warm["meta_info"]["cached_tokens_by_tier"]["storage"] == 64
        text = await (await client.get("/metrics")).text()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples[("tierserve_prefix_cache_hits_tokens_total", (("tier", "storage"),))] == 64
        assert samples[("tierserve_storage_written_pages_total", ())] >= 16
        assert samples[("tierserve_storage_read_pages_total", ())] == 16
        assert samples[("tierserve_storage_prefetch_total", (("outcome", "completed"),))] == 1
        assert samples[("tierserve_storage_failures_total", (("reason", "corrupt"),))] == 0
        assert samples[("tierserve_storage_enabled", ())] == 1
        assert samples[("tierserve_tier_offloaded_bytes_total", ())] > 0
        info = await (await client.get("/server_info")).json()
        assert info["storage"]["backend_stats"]["pages"] >= 16 and info["storage"]["max_bytes"] == 8 << 30
        snapshot = engine.snapshot()
        assert any(node["stored"] for node in snapshot)  # the inspector sees what is in storage


@pytest.mark.parametrize("probes", [3, 1])
def test_a_fetch_evicted_before_admission_is_fetched_again(
    tiny_chat_folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, probes: int
) -> None:
    """Host eviction can take what a fetch brought before its request is admitted; the
    request then checks storage again (probes=1 plants the old one-check behaviour)."""
    import kernel.tiers.storage_tier as storage_mod

    monkeypatch.setattr(storage_mod, "MAX_PROBES", probes)
    real = storage_mod.StorageTier._filled
    evicted = []

    def filled_then_evicted(self: Any, fetch: Any, fut: Any) -> None:
        real(self, fetch, fut)
        if not evicted:  # the first fetch's pages go right away, as under host pressure
            evicted.append(self.tree.evict_host(10**6))

    monkeypatch.setattr(storage_mod.StorageTier, "_filled", filled_then_evicted)
    engine = make(tiny_chat_folder, tmp_path)
    try:
        ref, warm = cold_then_storage_hit(engine)
        assert evicted and evicted[0]
        assert same(warm, ref)
        stored = warm["meta_info"]["cached_tokens_by_tier"]["storage"]
        assert stored == (64 if probes > 1 else 0)
        assert tier(engine).counters.prefetch["issued"] == 1 + min(probes, 2)  # the cold run probed once too
    finally:
        engine.shutdown()


def wait_for_host_copies(engine: Engine) -> None:
    deadline = time.monotonic() + 30
    while engine.engine.host.busy:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "host copies never landed"
        time.sleep(0.01)


def written_while_off_then_backfilled(engine: Engine) -> tuple[dict[str, Any], dict[str, Any]]:
    """PROMPT runs (and gets its host copies) while storage is off; storage is switched
    back on and another request makes the engine plan; then the tree is emptied, so what
    PROMPT reuses can only come from storage: (the cold run, the rerun)."""
    engine.engine.set_storage(False)
    ref = engine.generate(PROMPT, GREEDY)
    wait_for_host_copies(engine)
    assert tier(engine).counters.written_pages == 0
    engine.engine.set_storage(True)
    engine.generate(tokens(9, 5), GREEDY)  # plans: missed writes are queued from host copies
    settle(engine)
    return ref, engine.generate(PROMPT, GREEDY)  # type: ignore[return-value]


def test_pages_copied_while_storage_was_off_are_written_once_it_is_on(tiny_chat_folder: str, tmp_path: Path) -> None:
    engine = make(tiny_chat_folder, tmp_path)
    try:
        ref, warm = written_while_off_then_backfilled(engine)
        stats = tier(engine).stats()
        assert stats["backfilled_pages"] > 0 and stats["written_pages"] >= stats["backfilled_pages"]
        assert warm["meta_info"]["cached_tokens_by_tier"]["storage"] >= len(PROMPT) // 2
        assert same(warm, ref)  # leaks: checked at shutdown (tests/leaks.py)
    finally:
        engine.shutdown()


def test_red_missed_writes_forgotten(tiny_chat_folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: a missed write is not remembered → the prefix never reaches storage."""
    from kernel.tiers.storage_tier import StorageTier

    monkeypatch.setattr(StorageTier, "missed", lambda self, node: None)
    engine = make(tiny_chat_folder, tmp_path)
    try:
        ref, warm = written_while_off_then_backfilled(engine)
        assert tier(engine).stats()["backfilled_pages"] == 0
        assert warm["meta_info"]["cached_tokens_by_tier"]["storage"] == 0 and same(warm, ref)
    finally:
        engine.shutdown()


def packaged(storage_dir: Path, deterministic: bool) -> Engine:
    """The packaged model at its default numerics (bf16 or float32, with int4 linears), its KV
    in the model's dtype in both modes: so only the numerics name in the storage key tells
    the two modes' pages apart. NOTE: a float32 machine's default mode keeps float16 KV (a
    key of its own), where the planted key below would be harmless."""
    return Engine(None, {"model.path": SMOLLM, "cache.prefix": "radix", "cache.num_pages": 64,
                         "cache.kv_dtype": "model",
                         "hicache.host_pages": 200, "hicache.storage": "file",
                         "hicache.storage_dir": str(storage_dir), "deterministic": deterministic,
                         "debug.check_invariants": True})


def read_after_the_other_mode(tmp_path: Path, writer_det: bool) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """(a server of the other mode's output of PROMPT over the writer's storage, its cold
    run over empty storage, its storage stats)."""
    writer = packaged(tmp_path, writer_det)
    try:
        writer.generate(PROMPT, GREEDY)
        settle(writer)
    finally:
        writer.shutdown()
    reader, cold = packaged(tmp_path, not writer_det), packaged(tmp_path / "empty", not writer_det)
    try:
        out, ref = reader.generate(PROMPT, GREEDY), cold.generate(PROMPT, GREEDY)
        return out, ref, tier(reader).stats()  # type: ignore[return-value]
    finally:
        reader.shutdown()
        cold.shutdown()


@pytest.mark.parametrize("writer_det", [False, True], ids=["default-writes", "deterministic-writes"])
def test_pages_of_the_other_numerics_are_a_miss(tmp_path: Path, writer_det: bool) -> None:
    """Deterministic mode's pages are a cold run's bits only on a server computing the same
    way: a page one mode stored is a counted miss for the other (the storage key names the
    arithmetic, kernel/model_build.py `exact_numerics`)."""
    out, ref, stats = read_after_the_other_mode(tmp_path, writer_det)
    assert out["meta_info"]["cached_tokens_by_tier"]["storage"] == 0
    assert stats["prefetch"]["empty"] >= 1  # looked, found nothing of its numerics
    if not writer_det:
        assert same(out, ref)  # the deterministic reader: its own cold run's bits


def test_red_pages_keyed_without_the_numerics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the key without deterministic mode's name. A deterministic server reads the
    default server's pages and its output is not its cold run's. The default server's
    prefill attention runs torch's SDPA here: where the C++ kernels run, its prefill chunks
    otherwise take the chained kernel, deterministic mode's, and on a CPU where its 4-bit
    linears also run the same op in both modes (no dense copy: no AMX) its pages would be
    deterministic mode's bits, the planted key harmless."""
    import kernel.model_build as build_mod
    from gpu.attention import paged_decode

    monkeypatch.setattr(build_mod, "exact_numerics", lambda config, model, cpu_kernels: "")
    monkeypatch.setattr(paged_decode, "chained_extends", lambda pool: False)
    out, ref, _ = read_after_the_other_mode(tmp_path, writer_det=False)
    assert out["meta_info"]["cached_tokens_by_tier"]["storage"] > 0
    assert not same(out, ref)
