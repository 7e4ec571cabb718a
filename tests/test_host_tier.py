"""The host tier in the engine (dense models): write-through copies cached pages to host
memory, device eviction keeps them matchable from host, and a hit loads them back —
bit-identical to a cold run in deterministic mode, counted per tier. Prefetch policies
decide how long a request waits for its load; a planted copy into the wrong host page
is caught by the bit-exact compare."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from kernel import Engine
from tests import leaks
from tests.conftest import TINY_OVERRIDES

PAGE = TINY_OVERRIDES["cache.page_size"]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "return_logprob": True}
# 40 usable device pages of 4 tokens; 200 host pages.
TIERED = {"cache.prefix": "radix", "cache.num_pages": 41, "hicache.host_pages": 200, "deterministic": True}


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(50, 40000) for _ in range(n)]


def logprobs(out: dict[str, Any]) -> list[float]:
    return [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]


def make(folder: str, **extra: Any) -> Engine:
    return Engine(None, {"model.path": folder, **TINY_OVERRIDES, **TIERED, **extra})


def host_hit(engine: Engine, loads: list[int] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(cold reference, warm run) of a prompt whose prefix was pushed out to host; `loads`
    gets the pages loaded back from host during the warm run."""
    shared = tokens(1, 60)
    prompt = shared + tokens(2, 7)
    assert engine.flush_cache()
    ref = engine.generate(prompt, GREEDY)
    assert engine.flush_cache()
    engine.generate(shared, GREEDY)  # cached on device, written through to host
    # Fill the device pool: the shared prefix (the least recently used) is evicted to host.
    # Each fill waits for the copies it started, and one fill more than the pool needs runs
    # after the shared prefix's copy has surely landed (a node is locked while it is copied).
    for i in range(5):
        engine.generate(tokens(10 + i, 60), GREEDY)
        settle(engine)
    before = engine.engine.stats()["host"]["loaded_pages"]
    warm = engine.generate(prompt, GREEDY)
    if loads is not None:
        loads.append(engine.engine.stats()["host"]["loaded_pages"] - before)
    return ref, warm  # type: ignore[return-value]


def settle(engine: Engine) -> None:
    """Wait until the tier copies in flight have landed. NOTE: a node is locked while its copy
    runs, so eviction takes the next victim instead; without this wait, whether the shared
    prefix left the device before the warm run depended on how fast the copy worker was
    against the steps (write_back copies only under pressure: on a fast Xeon the prefix
    was once still on the device, a device hit and no host hit)."""
    deadline = time.monotonic() + 60  # a safety net: copies of a few pages take milliseconds
    while not engine.engine.is_idle():
        assert time.monotonic() < deadline, f"tier copies still in flight: {engine.engine.stats()['host']}"
        time.sleep(0.005)


def test_host_hit_is_bit_exact_and_counted(tiny_chat_folder: str) -> None:
    engine = make(tiny_chat_folder)
    try:
        ref, warm = host_hit(engine)
        tiers = warm["meta_info"]["cached_tokens_by_tier"]
        assert tiers["host"] > 0, tiers
        assert warm["meta_info"]["cached_tokens"] == tiers["device"] + tiers["host"]
        assert warm["output_ids"] == ref["output_ids"] and logprobs(warm) == logprobs(ref)
        host = engine.engine.stats()["host"]
        assert host["offloaded_pages"] > 0 and host["loaded_pages"] > 0
        assert host["prefetch"]["completed"] >= 1
    finally:
        engine.shutdown()


def test_loads_jump_queued_offloads(tiny_chat_folder: str) -> None:
    """A load-back has a request waiting for it: it is submitted urgent (it starts before
    offloads still queued on the copy worker); offloads are not."""
    engine = make(tiny_chat_folder)
    host = engine.engine.host
    assert host is not None
    real = host.worker.submit_copy
    seen: list[tuple[str, bool]] = []

    def submit_copy(fn: Any, urgent: bool = False) -> Any:
        kind = fn.__code__.co_names  # the names the job's lambda calls
        seen.append(("load" if "load_back" in kind else "offload", urgent))
        return real(fn, urgent=urgent)

    host.worker.submit_copy = submit_copy  # type: ignore[method-assign]
    try:
        ref, warm = host_hit(engine)
        assert warm["output_ids"] == ref["output_ids"] and logprobs(warm) == logprobs(ref)
        assert ("load", True) in seen and ("offload", False) in seen, seen
        assert {urgent for kind, urgent in seen if kind == "load"} == {True}
        assert {urgent for kind, urgent in seen if kind == "offload"} == {False}
    finally:
        engine.shutdown()


def test_red_a_page_copied_to_the_wrong_host_slot(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import kernel.tiers.host_tier as tier_mod

    real = tier_mod.offload

    def shifted(kv_pool: Any, device_pages: list[int], host_pool: Any, host_pages: list[int], *rest: Any) -> int:
        # planted: each page lands in the host page before its own (the first is lost, the
        # last written twice). NOTE: not a permutation: see `one_page_early`.
        return one_page_early(lambda d, h: real(kv_pool, d, host_pool, h, *rest), device_pages, host_pages)

    monkeypatch.setattr(tier_mod, "offload", shifted)
    engine = make(tiny_chat_folder)
    try:
        ref, warm = host_hit(engine)
        assert warm["meta_info"]["cached_tokens_by_tier"]["host"] > 0
        assert logprobs(warm) != logprobs(ref)  # the bit-exact compare goes red
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()


def one_page_early(copy: Callable[[list[int], list[int]], int], src: list[int], dst: list[int]) -> int:
    """A planted copy of a node's pages `src` to `dst`, each one page early: page i+1 into
    slot i, the last page into its own slot too; returns the bytes `copy` reported.
    NOTE: a red test needs wrong contents, not pages swapped among themselves: the new
    tokens attend to every cached key, each key carries its position (rotated), and the
    sum over keys does not care where they sit, so a permutation changes the output only
    by rounding — on CUDA it did not change it at all."""
    return copy(src[1:], dst[:-1]) + copy(src[-1:], dst[-1:])


def assert_host_hit(warm: dict[str, Any]) -> None:
    tiers = warm["meta_info"]["cached_tokens_by_tier"]
    assert tiers["host"] > 0, f"host-hit guard: the warm run loaded nothing from host ({tiers})"


# timeout: a budget no load of 60 tokens outlasts (the budget of a real deployment is ms).
POLICIES = {"best_effort": {}, "wait_complete": {}, "timeout": {"hicache.prefetch_timeout_s": 60.0}}


def policy_run(folder: str, policy: str, **extra: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, int]]:
    """(cold reference, warm run, prefetch counters) of host_hit under the policy."""
    engine = make(folder, **{"hicache.prefetch_policy": policy, **POLICIES[policy], **extra})
    try:
        ref, warm = host_hit(engine)
        return ref, warm, engine.engine.stats()["host"]["prefetch"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("policy", list(POLICIES))
def test_prefetch_policies_give_the_same_output(tiny_chat_folder: str, policy: str) -> None:
    ref, warm, prefetch = policy_run(tiny_chat_folder, policy)
    assert warm["output_ids"] == ref["output_ids"] and logprobs(warm) == logprobs(ref)
    assert prefetch["issued"] >= 1
    if policy == "best_effort":
        assert warm["meta_info"]["cached_tokens_by_tier"]["host"] == 0  # it did not wait
    else:  # it waited for the load, within its budget
        assert_host_hit(warm)
        assert prefetch["completed"] >= 1 and prefetch["timed_out"] == 0, prefetch


def test_red_timeout_that_never_waits(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the timeout policy's budget is lost (it waits like best_effort)."""
    from handlers.tier_prefetch import Timeout

    monkeypatch.setattr(Timeout, "budget_s", lambda self, num_tokens: 0.0)
    with pytest.raises(AssertionError, match="host-hit guard: the warm run loaded nothing from host"):
        test_prefetch_policies_give_the_same_output(tiny_chat_folder, "timeout")


def test_timeout_expires_while_the_load_is_held(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The load is held until the request's budget has run out (an event, not a clock):
    the request computes its prefix itself, `==`, and the timeout is counted."""
    import kernel.tiers.host_tier as tier_mod

    expired = threading.Event()
    real_load, real_expire = tier_mod.load_back, tier_mod.HostTier.expire

    def held_load(*args: Any) -> int:
        assert expired.wait(60), "the request's budget never ran out"
        return real_load(*args)  # type: ignore[no-any-return]

    def expire(self: Any, req: Any) -> None:
        before = self.counters.prefetch["timed_out"]
        real_expire(self, req)
        if self.counters.prefetch["timed_out"] > before:
            expired.set()

    monkeypatch.setattr(tier_mod, "load_back", held_load)
    monkeypatch.setattr(tier_mod.HostTier, "expire", expire)
    ref, warm, prefetch = policy_run(tiny_chat_folder, "timeout", **{"hicache.prefetch_timeout_s": 1e-6,
                                                                     "hicache.prefetch_timeout_per_token_s": 0.0})
    assert warm["output_ids"] == ref["output_ids"] and logprobs(warm) == logprobs(ref)
    assert warm["meta_info"]["cached_tokens_by_tier"]["host"] == 0 and prefetch["timed_out"] == 1, prefetch


def test_decode_hit_from_host(tiny_chat_folder: str) -> None:
    """The second turn reuses tokens the first turn generated, after they went to host."""
    engine = make(tiny_chat_folder)
    try:
        first = tokens(3, 30)
        turn1 = engine.generate(first, {**GREEDY, "max_new_tokens": 24})
        turn2 = first + turn1["output_ids"] + tokens(4, 5)  # type: ignore[index]
        for i in range(4):
            engine.generate(tokens(20 + i, 60), GREEDY)  # push the conversation to host
        warm = engine.generate(turn2, GREEDY)
        tiers = warm["meta_info"]["cached_tokens_by_tier"]  # type: ignore[index]
        assert tiers["device"] + tiers["host"] > len(first) and tiers["host"] > 0, tiers
        assert engine.flush_cache()
        cold = engine.generate(turn2, GREEDY)
        assert warm["output_ids"] == cold["output_ids"] and logprobs(warm) == logprobs(cold)  # type: ignore[arg-type]
    finally:
        engine.shutdown()


async def test_metrics_count_host_hits(tiny_chat_folder: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from plugins.metrics import add_metrics_route
    from tests.inprocess import serve_engine

    async with serve_engine(tiny_chat_folder, add_metrics_route, {**TIERED}) as (engine, client):
        shared = tokens(5, 60)
        await engine.generate(shared, GREEDY)
        await engine.settle_copies()
        for i in range(4):
            await engine.generate(tokens(30 + i, 60), GREEDY)
        await engine.generate(shared + [7, 7, 7, 7, 7], GREEDY)
        text = await (await client.get("/metrics")).text()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples[("tierserve_prefix_cache_hits_tokens_total", (("tier", "host"),))] > 0
        assert samples[("tierserve_tier_offloaded_pages_total", ())] > 0
        assert samples[("tierserve_tier_prefetch_total", (("outcome", "completed"),))] >= 1


def test_write_back_copies_only_what_is_about_to_be_evicted(tiny_chat_folder: str) -> None:
    write_back_run(tiny_chat_folder)


def test_red_write_back_that_never_copies(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: write-back copies nothing before eviction (victims are dropped): the guard on
    pages loaded back for the warm run goes red."""
    from handlers.tier_write import WriteBack

    monkeypatch.setattr(WriteBack, "on_evict", False)
    with pytest.raises(AssertionError, match="host-hit guard: the warm run loaded nothing from host"):
        write_back_run(tiny_chat_folder)


def write_back_run(tiny_chat_folder: str) -> None:
    engine = make(tiny_chat_folder, **{"hicache.write_policy": "write_back"})
    try:
        engine.generate(tokens(50, 20), GREEDY)  # plenty of free device pages: nothing copied
        assert engine.engine.stats()["host"]["offloaded_pages"] == 0
        loads: list[int] = []
        ref, warm = host_hit(engine, loads)  # the pool fills: the victims move to host first
        # NOTE: counted by the host tier, not the request's `cached_tokens_by_tier`: write-back
        # locks the victims it copies, so under load the warm request may run out of pages
        # after its load and be retracted; re-admitted, it finds its prefix on the device,
        # and its meta_info reports that last admission only.
        assert loads[0] > 0, f"host-hit guard: the warm run loaded nothing from host ({warm['meta_info']})"
        assert warm["output_ids"] == ref["output_ids"] and logprobs(warm) == logprobs(ref)
        offloaded = engine.engine.stats()["host"]["offloaded_pages"]
    finally:
        engine.shutdown()
    through = make(tiny_chat_folder)
    try:
        host_hit(through)
        assert offloaded < through.engine.stats()["host"]["offloaded_pages"]  # less copy traffic
    finally:
        through.shutdown()

