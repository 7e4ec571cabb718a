"""The radix prefix cache inside the engine: hits are reported, reuse matches cold runs,
eviction under a small pool loses nothing, flush only when idle."""

from __future__ import annotations

from kernel import Engine
from tests.conftest import TINY_OVERRIDES

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "return_logprob": True}
SYSTEM = "You are a helpful assistant. Answer briefly and politely, and never make things up. " * 3


def make(folder: str, **extra: object) -> Engine:
    return Engine(None, {"model.path": folder, **TINY_OVERRIDES, "cache.prefix": "radix", **extra})


def test_warm_prefix_hits_and_matches_cold(tiny_chat_folder: str, tiny_engine: Engine) -> None:
    prompts = [SYSTEM + q for q in ("What is rain?", "Why is the sky blue?", "Name a fruit.")]
    cold = tiny_engine.generate(prompts, GREEDY)  # no prefix cache
    engine = make(tiny_chat_folder)
    try:
        first = engine.generate(prompts[0], GREEDY)
        assert isinstance(first, dict) and first["meta_info"]["cached_tokens"] == 0
        warm = engine.generate(prompts[1:], GREEDY)
        for out, ref in zip(warm, cold[1:]):  # type: ignore[index]
            assert out["meta_info"]["cached_tokens"] > 0
            assert out["output_ids"] == ref["output_ids"]
        # Second turn reuses tokens the first turn generated (decode hit).
        turn2 = prompts[0] + first["text"] + " And snow?"
        again = engine.generate(turn2, GREEDY)
        assert isinstance(again, dict)
        assert again["meta_info"]["cached_tokens"] > len(engine.tokenizer.encode(prompts[0])) - 4
        stats = engine.engine.cache_stats()
        assert 0 < stats["prefix_hit_tokens"] < stats["prefix_query_tokens"]
        assert engine.flush_cache() is True
        assert engine.engine.cache_stats()["cached_pages"] == 0
    finally:
        engine.shutdown()


def test_small_pool_evicts_and_loses_nothing(tiny_chat_folder: str, tiny_engine: Engine) -> None:
    prompts = [SYSTEM[: 40 + 9 * i] + str(i) for i in range(10)]
    ref = tiny_engine.generate(prompts, GREEDY)
    engine = make(tiny_chat_folder, **{"cache.num_pages": 40})
    try:
        got = engine.generate(prompts, GREEDY)
        got2 = engine.generate(prompts, GREEDY)  # again, with whatever survived eviction
        for r, a, b in zip(ref, got, got2):  # type: ignore[arg-type]
            assert a["output_ids"] == r["output_ids"] == b["output_ids"]
        pages = engine.engine.stats()["pages"]
        assert pages["free"] + pages["cached"] == pages["usable"]
    finally:
        engine.shutdown()


async def test_flush_refused_while_busy(tiny_chat_folder: str) -> None:
    from kernel import AsyncEngine

    engine = await AsyncEngine.create(None, {"model.path": tiny_chat_folder, **TINY_OVERRIDES, "cache.prefix": "radix"})
    try:
        rid = engine.add_request(SYSTEM, {"max_new_tokens": 4, "temperature": 0})
        ok, reason = engine.flush_cache()
        assert not ok and "in flight" in reason
        await engine.collect(rid)
        assert engine.cache_stats()["cached_pages"] > 0
        assert engine.flush_cache() == (True, "flushed")
        assert engine.cache_stats()["cached_pages"] == 0
    finally:
        await engine.shutdown()


async def test_namespaces_never_share(tiny_chat_folder: str) -> None:
    from kernel import AsyncEngine

    engine = await AsyncEngine.create(None, {"model.path": tiny_chat_folder, **TINY_OVERRIDES, "cache.prefix": "radix"})
    params = {"max_new_tokens": 2, "temperature": 0}
    try:
        async def cached(namespace: str | None) -> int:
            out = await engine.collect(engine.add_request(SYSTEM, params, namespace=namespace))
            return int(out["meta_info"]["cached_tokens"])

        assert await cached("alice") == 0
        assert await cached("bob") == 0
        assert await cached(None) == 0
        assert await cached("alice") > 0
    finally:
        await engine.shutdown()
