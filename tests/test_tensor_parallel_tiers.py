"""The host and storage tiers under tensor parallelism (kernel/parallel/host_shards.py):
every rank copies its shard of a page under rank 0's page ids, and storage holds a page
(and a hybrid model's state slot) as every rank's part. In deterministic mode a host hit
and a storage hit `==` a cold run at tp_size 2, dense and hybrid × three strategies; a
page stored at tp_size 2 is a counted miss at tp_size 1 and a hit again at tp_size 2
after a restart. Planted: a worker copying its shard into the wrong host pages, storage
restoring rank 0's shard only, and a stored state never loaded on the worker, go red."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from cache.host_pool import HostPool
from kernel import Engine
from kernel.parallel.host_shards import RankCopies, RankStateBytes, ShardedHostPool
from tests.conftest import HYBRID_OVERRIDES, TINY_OVERRIDES
from tests.test_host_tier import TIERED, host_hit, logprobs
from tests.test_host_tier_hybrid import PROMPT as HYBRID_PROMPT
from tests.test_host_tier_hybrid import SHARED, push_to_host, tiers
from tests.test_host_tier_hybrid import TIERED as HYBRID_TIERED
from tests.test_storage_tier import PROMPT, cold_then_storage_hit
from tests.test_storage_tier_hybrid import GREEDY as STORAGE_GREEDY
from tests.test_storage_tier_hybrid import PROMPT as STORAGE_PROMPT
from tests.test_storage_tier_hybrid import TIERED as STORAGE_HYBRID

TP2 = {"parallel.tp_size": 2}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["output_ids"] == b["output_ids"] and logprobs(a) == logprobs(b)


def dense(folder: str, **extra: Any) -> Engine:
    return Engine(None, {"model.path": folder, **TINY_OVERRIDES, **TIERED, **TP2, **extra})


def test_host_hit_equals_cold_at_tp2(tiny_chat_folder: str) -> None:
    engine = dense(tiny_chat_folder)
    try:
        ref, warm = host_hit(engine)
        assert warm["meta_info"]["cached_tokens_by_tier"]["host"] > 0
        assert same(warm, ref), "a host hit at tp_size 2 differs from the cold run"
        host = engine.engine.stats()["host"]
        assert host["offloaded_pages"] > 0 and host["loaded_pages"] > 0 and host["failures"]["copy"] == 0
    finally:
        engine.shutdown()


def test_red_a_worker_copying_its_shard_into_the_wrong_host_pages(
    tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = RankCopies.post

    # NOTE: each shard one host page on, so the first page keeps what it held and a load reads
    # every other page's predecessor. A permutation of the offload's pages (reversed) would
    # not do: K is stored after RoPE, so attention over the same keys in another order
    # differs in summation order only, which may round alike.
    def shifted_offloads(self: RankCopies, kind: str, src: list[int], dst: list[int]) -> int:
        return real(self, kind, src, [d + 1 for d in dst] if kind == "offload" else dst)

    monkeypatch.setattr(RankCopies, "post", shifted_offloads)
    engine = dense(tiny_chat_folder)
    try:
        ref, warm = host_hit(engine)
        assert warm["meta_info"]["cached_tokens_by_tier"]["host"] > 0
        assert not same(warm, ref), "the planted bug went unseen"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_hybrid_host_hit_equals_cold_at_tp2(hybrid_folders: dict[str, str], strategy: str) -> None:
    engine = Engine(None, {**HYBRID_OVERRIDES, **HYBRID_TIERED, **TP2, "model.path": hybrid_folders["qwen3_5_text"],
                           "cache.state_strategy": strategy})
    try:
        ref = engine.generate(HYBRID_PROMPT, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True,
                                              "return_logprob": True})
        assert engine.flush_cache()
        engine.generate(SHARED, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        push_to_host(engine)
        warm = engine.generate(HYBRID_PROMPT, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True,
                                               "return_logprob": True})
        assert isinstance(ref, dict) and isinstance(warm, dict)
        assert tiers(warm)["host"] > 0, tiers(warm)
        assert same(warm, ref), "a hybrid host hit at tp_size 2 differs from the cold run"
    finally:
        engine.shutdown()


def stored(folder: str, storage_dir: Path, tp: int) -> Engine:
    return Engine(None, {"model.path": folder, **TINY_OVERRIDES, **TIERED, "parallel.tp_size": tp,
                         "hicache.storage": "file", "hicache.storage_dir": str(storage_dir)})


def test_storage_hit_at_tp2_is_a_miss_at_tp1_and_a_hit_after_restart(tiny_chat_folder: str, tmp_path: Path) -> None:
    engine = stored(tiny_chat_folder, tmp_path, 2)
    try:
        ref, warm = cold_then_storage_hit(engine)
        assert warm["meta_info"]["cached_tokens_by_tier"]["storage"] == 64
        assert same(warm, ref), "a storage hit at tp_size 2 differs from the cold run"
    finally:
        engine.shutdown()
    one = stored(tiny_chat_folder, tmp_path, 1)
    try:
        out = one.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert isinstance(out, dict)
        assert out["meta_info"]["cached_tokens"] == 0, "tp_size 1 read pages stored at tp_size 2"
        stats = one.engine.stats()["storage"]
        assert stats["read_pages"] == 0 and stats["failures"]["bad_page"] == 0
        assert stats["prefetch"]["empty"] >= 1, stats["prefetch"]  # looked, found nothing of its layout
    finally:
        one.shutdown()
    again = stored(tiny_chat_folder, tmp_path, 2)
    try:
        out = again.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True,
                                      "return_logprob": True})
        assert isinstance(out, dict)
        assert out["meta_info"]["cached_tokens_by_tier"]["storage"] == 64
        assert same(out, ref), "a storage hit after a restart at tp_size 2 differs from the cold run"
    finally:
        again.shutdown()


def hybrid_stored(folder: str, strategy: str, storage_dir: Path) -> Engine:
    return Engine(None, {**HYBRID_OVERRIDES, **STORAGE_HYBRID, **TP2, "model.path": folder,
                         "cache.state_strategy": strategy, "hicache.storage_dir": str(storage_dir)})


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_hybrid_storage_hit_equals_cold_at_tp2(hybrid_folders: dict[str, str], strategy: str, tmp_path: Path) -> None:
    engine = hybrid_stored(hybrid_folders["qwen3_5_text"], strategy, tmp_path)
    try:
        ref = engine.generate(STORAGE_PROMPT, STORAGE_GREEDY)
        assert engine.flush_cache()
        warm = engine.generate(STORAGE_PROMPT, STORAGE_GREEDY)
        assert isinstance(ref, dict) and isinstance(warm, dict)
        assert tiers(warm)["storage"] == 64, tiers(warm)
        assert same(warm, ref), "a hybrid storage hit at tp_size 2 differs from the cold run"
    finally:
        engine.shutdown()


def test_red_hybrid_storage_state_never_loaded_on_the_worker(
    hybrid_folders: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = hybrid_folders["qwen3_5_text"]
    engine = hybrid_stored(folder, "extra_buffer", tmp_path)
    try:
        ref = engine.generate(STORAGE_PROMPT, STORAGE_GREEDY)
    finally:
        engine.shutdown()
    monkeypatch.setattr(RankStateBytes, "commit", lambda self, slot: None)
    again = hybrid_stored(folder, "extra_buffer", tmp_path)  # the worker's state slots are fresh
    try:
        warm = again.generate(STORAGE_PROMPT, STORAGE_GREEDY)
        assert isinstance(ref, dict) and isinstance(warm, dict)
        assert tiers(warm)["storage"] == 64, tiers(warm)
        assert not same(warm, ref), "the planted bug went unseen"
    finally:
        again.shutdown()


def test_red_storage_reading_rank0s_shard_only(tiny_chat_folder: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    engine = stored(tiny_chat_folder, tmp_path, 2)
    try:
        ref, _ = cold_then_storage_hit(engine)
    finally:
        engine.shutdown()

    def rank0_only(self: ShardedHostPool, page: int, data: bytes) -> None:
        HostPool.load_bytes(self, page, memoryview(data)[: self.own_page_bytes])

    monkeypatch.setattr(ShardedHostPool, "load_bytes", rank0_only)
    again = stored(tiny_chat_folder, tmp_path, 2)  # the workers' host pages are fresh memory
    try:
        out = again.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True,
                                      "return_logprob": True})
        assert isinstance(out, dict)
        assert out["meta_info"]["cached_tokens_by_tier"]["storage"] == 64
        assert not same(out, ref), "the planted bug went unseen"
    finally:
        again.shutdown()


async def test_server_info_metrics_and_admin_stats_show_the_ranks(tiny_chat_folder: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from tests.inprocess import serve_http

    async with serve_http(tiny_chat_folder, {**TIERED, **TP2}) as (engine, client):
        await engine.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        info = await (await client.get("/server_info")).json()
        par = info["parallel"]
        assert info["tp_size"] == par["tp_size"] == 2
        ranks = par["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and all(r["alive"] for r in ranks)
        assert ranks[0]["pid"] == os.getpid() and ranks[1]["pid"] != os.getpid()
        assert ranks[0]["kv_bytes"] == ranks[1]["kv_bytes"]  # each rank's shard of the same pages
        kv = ranks[0]["kv_bytes"]
        page_bytes = kv["total"] // engine.scheduler.allocator.num_pages
        used = engine.scheduler.allocator.num_usable - engine.scheduler.allocator.num_free
        assert kv["used"] == used * page_bytes > 0
        assert ranks[1]["host_bytes"]["used"] > 0  # the write-through copies, the worker's shard too
        assert par["collectives"]["reduced_bytes"] > 0 and par["collectives"]["gathered_bytes"] > 0
        text = await (await client.get("/metrics")).text()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples[("tierserve_tp_rank_up", (("rank", "1"),))] == 1
        assert samples[("tierserve_tp_rank_pool_bytes", (("pool", "kv"), ("rank", "1"), ("state", "used")))] == kv["used"]
        assert samples[("tierserve_tp_reduced_bytes_total", ())] > 0
        assert engine.stats()["parallel"]["tp_size"] == 2  # what the admin socket's `stats` sends
