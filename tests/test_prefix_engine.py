"""The radix prefix cache inside the engine: hits are reported, reuse matches cold runs,
eviction under a small pool loses nothing, flush only when idle. Tokens are compared with
`==` against a cold run, so both run in deterministic mode (invariant 7): outside it a hit's
shorter prefill may round differently, and a near tie would flip on some CPUs."""

from __future__ import annotations

from kernel import Engine
from tests.conftest import TINY_OVERRIDES

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "return_logprob": True}
SYSTEM = "You are a helpful assistant. Answer briefly and politely, and never make things up. " * 3


def make(folder: str, **extra: object) -> Engine:
    return Engine(None, {"model.path": folder, **TINY_OVERRIDES, "cache.prefix": "radix", "deterministic": True,
                         **extra})


def test_warm_prefix_hits_and_matches_cold(tiny_chat_folder: str, tiny_det_engine: Engine) -> None:
    prompts = [SYSTEM + q for q in ("What is rain?", "Why is the sky blue?", "Name a fruit.")]
    cold = tiny_det_engine.generate(prompts, GREEDY)  # no prefix cache
    engine = make(tiny_chat_folder)
    try:
        first = engine.generate(prompts[0], GREEDY)
        assert isinstance(first, dict) and first["meta_info"]["cached_tokens"] == 0
        warm = engine.generate(prompts[1:], GREEDY)
        for out, ref in zip(warm, cold[1:]):  # type: ignore[index]
            assert out["meta_info"]["cached_tokens"] > 0
            assert out["output_ids"] == ref["output_ids"]
        # Second turn reuses tokens the first turn generated (decode hit). Built from ids,
        # not text, so re-tokenizing the boundary cannot change the prefix.
        prompt0 = engine.tokenizer.encode(prompts[0])
        turn2 = prompt0 + first["output_ids"] + engine.tokenizer.encode(" And snow?")
        again = engine.generate(turn2, GREEDY)
        assert isinstance(again, dict)
        page = engine.config.cache.page_size
        aligned_prompt = len(prompt0) // page * page  # all the prompt's own pages can give
        # KV exists for the prompt and all generated tokens but the last: whole pages of it.
        computed = (len(prompt0) + GREEDY["max_new_tokens"] - 1) // page * page
        assert computed >= aligned_prompt + 2 * page  # the lengths make the check meaningful
        hit = again["meta_info"]["cached_tokens"]
        assert hit > aligned_prompt, "second turn did not reuse any generated token's KV"
        assert hit == computed
        ref2 = tiny_det_engine.generate(turn2, GREEDY)
        assert again["output_ids"] == ref2["output_ids"]  # type: ignore[call-overload]
        stats = engine.engine.cache_stats()
        assert 0 < stats["prefix_hit_tokens"] < stats["prefix_query_tokens"]
        assert engine.flush_cache() is True
        assert engine.engine.cache_stats()["cached_pages"] == 0
    finally:
        engine.shutdown()


def test_small_pool_evicts_and_loses_nothing(tiny_chat_folder: str, tiny_det_engine: Engine) -> None:
    prompts = [SYSTEM[: 40 + 9 * i] + str(i) for i in range(10)]
    ref = tiny_det_engine.generate(prompts, GREEDY)
    engine = make(tiny_chat_folder, **{"cache.num_pages": 40})
    try:
        got = engine.generate(prompts, GREEDY)
        pages = engine.engine.stats()["pages"]
        hits_before = engine.engine.cache_stats()["prefix_hit_tokens"]
        got2 = engine.generate(prompts, GREEDY)  # again, with whatever survived eviction
        for r, a, b in zip(ref, got, got2):  # type: ignore[arg-type]
            assert a["output_ids"] == r["output_ids"] == b["output_ids"]
        # Distinct whole pages the first pass computed (shared prefixes counted once): more
        # than the cache holds afterwards, so some were evicted.
        page = engine.config.cache.page_size
        computed: set[tuple[int, ...]] = set()
        for p, out in zip(prompts, got):  # type: ignore[arg-type]
            seq = engine.tokenizer.encode(p) + out["output_ids"][:-1]  # the last has no KV
            computed.update(tuple(seq[: k * page]) for k in range(1, len(seq) // page + 1))
        assert pages["cached"] < len(computed), "the small pool evicted nothing"
        # The second pass still hits what survived.
        assert any(b["meta_info"]["cached_tokens"] > 0 for b in got2)  # type: ignore[index]
        assert engine.engine.cache_stats()["prefix_hit_tokens"] > hits_before
        # Idle: every page is free or cached, and no cached page is still locked.
        stats = engine.engine.stats()["pages"]
        assert stats["held"] == 0 and stats["free"] + stats["cached"] == stats["usable"]
        assert stats["evictable"] == stats["cached"]
    finally:
        engine.shutdown()


def test_lru_eviction_drops_the_oldest_prefix_and_keeps_the_newest(
    tiny_chat_folder: str, tiny_det_engine: Engine
) -> None:
    # Pages of 4 tokens, 33 usable. Prompts share no first page. A request of 30 prompt
    # tokens + 12 generated leaves 41 tokens of KV: 10 whole pages cached once it ends.
    a, b, c = ([1000 * k + j for j in range(30)] for k in (1, 2, 3))
    d = [4000 + j for j in range(40)]  # needs 13 pages while it runs, caches 12
    engine = make(tiny_chat_folder, **{"cache.num_pages": 34})
    try:
        assert engine.engine.stats()["pages"]["usable"] == 33
        cold = {}
        for name, ids in (("a", a), ("b", b), ("c", c)):
            out = engine.generate(ids, GREEDY)
            assert out["meta_info"]["cached_tokens"] == 0  # type: ignore[call-overload]
            cold[name] = out
        assert engine.engine.cache_stats()["cached_pages"] == 30  # nothing evicted yet
        # D needs 13 pages, 3 are free: the least recently used prefix (A's) must go.
        cold["d"] = engine.generate(d, GREEDY)
        after_d = engine.engine.cache_stats()["cached_pages"]
        assert 30 + 12 - after_d >= 10, "D's pages were not made by evicting cached ones"
        # C, used after A, survived: a full hit (every whole page below the last token).
        c2 = engine.generate(c, GREEDY)
        assert c2["meta_info"]["cached_tokens"] == 28  # type: ignore[call-overload]
        # A, the oldest, was evicted: nothing of it is left to hit.
        a2 = engine.generate(a, GREEDY)
        assert a2["meta_info"]["cached_tokens"] == 0  # type: ignore[call-overload]
        stats = engine.engine.cache_stats()
        assert stats["prefix_hit_tokens"] == 28
        assert stats["prefix_query_tokens"] == 30 * 3 + 40 + 30 + 30
        for out, ref in ((c2, cold["c"]), (a2, cold["a"])):
            assert out["output_ids"] == ref["output_ids"]  # type: ignore[call-overload]
        assert cold["d"]["output_ids"] == tiny_det_engine.generate(d, GREEDY)["output_ids"]  # type: ignore[call-overload]
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
