"""The host tier with hybrid models, deterministic mode: a prefix pushed out of a small
device pool to host is loaded back and the request resumes from the recurrent state
cached at the host part's end — tokens and logprobs `==` a cold run, for every state
strategy, prefill and decode hits, a match split between device and host, a load that
outlives its budget or is revoked (the request then computes from its device part's
state), and every unlocked state slot evicted the moment a load starts (host-only nodes
become tombstones; the node being loaded keeps its slot).

Revert-then-red: the fix reverted (the request keeps its device part's state), a state
one checkpoint short, and a KV page copied to the wrong host page are each caught by the
bit-exact compare. Pages, state slots and host pages are checked by tests/leaks.py at
teardown and by the integrity check after every step (`debug.check_invariants`).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import pytest

from kernel import Engine
from kernel.request import Request
from kernel.tiers.host_tier import HostTier, Load
from tests import leaks
from tests.conftest import HYBRID_FAMILIES, HYBRID_OVERRIDES
from tests.test_host_tier import one_page_early
from tests.tiny_hybrid import VOCAB

STRATEGIES = ("no_buffer", "extra_buffer", "extra_buffer_lazy")
INTERVAL = cast(int, HYBRID_OVERRIDES["cache.state_track_interval"])  # 8 tokens, 2 pages
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "return_logprob": True}
# 40 usable device pages of 4 tokens (about two 60-token requests); 200 host pages.
TIERED = {"cache.num_pages": 41, "hicache.host_pages": 200, "deterministic": True,
          "debug.check_invariants": True}


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


SHARED = tokens(1, 7 * INTERVAL + 4)  # 60 tokens: states cached up to 56
HEAD = SHARED[: 4 * INTERVAL + 1]  # its match ends at the checkpoint at 32
PROMPT = SHARED + tokens(2, 7)  # matches SHARED's states up to 56


def make(folder: str, strategy: str, **extra: Any) -> Engine:
    return Engine(None, {**HYBRID_OVERRIDES, **TIERED, "model.path": folder,
                         "cache.state_strategy": strategy, **extra})


def logprobs(out: dict[str, Any]) -> list[float]:
    return [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]


def tiers(out: dict[str, Any]) -> dict[str, int]:
    return out["meta_info"]["cached_tokens_by_tier"]  # type: ignore[no-any-return]


def run(engine: Engine, prompt: list[int], params: dict[str, Any] = GREEDY) -> dict[str, Any]:
    out = engine.generate(prompt, params)
    assert isinstance(out, dict)
    return out


def cold(engine: Engine, prompt: list[int], params: dict[str, Any] = GREEDY) -> dict[str, Any]:
    assert engine.flush_cache()
    out = run(engine, prompt, params)
    assert out["meta_info"]["cached_tokens"] == 0
    return out


def same(out: dict[str, Any], ref: dict[str, Any]) -> bool:
    return out["output_ids"] == ref["output_ids"] and logprobs(out) == logprobs(ref)


def push_to_host(engine: Engine, seed: int = 10) -> None:
    """Fill the device pool: what was cached before keeps only its host copies."""
    for i in range(4):
        run(engine, tokens(seed + i, 60))


def split_prefix(engine: Engine, head_waits: bool = True) -> dict[str, Any]:
    """Cache SHARED, push it to host, and run HEAD, which brings its part (32 tokens)
    back to device: SHARED's states then end at 32 on device and at 40, 48, 56 on host
    only. Returns HEAD's output: a host hit with no device part if it waits for its load
    (`head_waits`; a best_effort request computes the part itself)."""
    run(engine, SHARED)
    push_to_host(engine)
    head = run(engine, HEAD)
    host = 4 * INTERVAL if head_waits else 0
    assert tiers(head) == {"device": 0, "host": host, "storage": 0}, tiers(head)
    return head


def host_stats(engine: Engine) -> dict[str, Any]:
    """The host tier's counters once no copy is in flight (a late load has landed)."""
    deadline = time.monotonic() + 10.0
    while not engine.engine.is_idle() and time.monotonic() < deadline:
        time.sleep(0.002)
    return engine.engine.stats()["host"]  # type: ignore[no-any-return]


def assert_accounted(engine: Engine) -> None:
    """Invariant 3 with tiers and states, once idle: nothing held outside the cache."""
    stats = engine.engine.stats()
    pages, states, host = stats["pages"], stats["states"], stats["host"]["host_pages"]
    assert pages["held"] == 0 and pages["free"] + pages["cached"] == pages["usable"], pages
    assert states["held"] == 0 and states["free"] + states["cached"] == states["usable"], states
    assert host["copying"] == 0 and host["free"] + host["cached"] == host["usable"], host
    assert engine.engine.check() is None


# ---- guards ---------------------------------------------------------------------
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_prefill_hit_from_host(hybrid_folders: dict[str, str], strategy: str, family: str) -> None:
    """HEAD resumes from a state on host alone; PROMPT from a device part (to 32) and a
    host part (to 56), ending at the host node's state."""
    engine = make(hybrid_folders[family], strategy)
    try:
        refs = [cold(engine, HEAD), cold(engine, PROMPT)]
        assert engine.flush_cache()
        head = split_prefix(engine)
        warm = run(engine, PROMPT)
        assert tiers(warm) == {"device": 4 * INTERVAL, "host": 3 * INTERVAL, "storage": 0}, tiers(warm)
        assert warm["meta_info"]["cached_tokens"] == 7 * INTERVAL
        assert same(head, refs[0]) and same(warm, refs[1]), "bit-exact guard: a host hit differs from cold"
        host = host_stats(engine)
        assert host["prefetch"]["completed"] >= 2 and host["loaded_pages"] >= 14
        assert_accounted(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_decode_hit_from_host(hybrid_folders: dict[str, str], strategy: str) -> None:
    """The second turn resumes from a state checkpointed while the first turn decoded,
    after the conversation went to host."""
    engine = make(hybrid_folders["qwen3_5_text"], strategy)
    try:
        first = tokens(3, 30)
        turn1 = run(engine, first, {**GREEDY, "max_new_tokens": 24})  # decode checkpoints 32..48
        turn2 = first + turn1["output_ids"] + tokens(4, 5)
        push_to_host(engine, seed=20)
        warm = run(engine, turn2)
        assert tiers(warm)["host"] > 0 and warm["meta_info"]["cached_tokens"] == 6 * INTERVAL, tiers(warm)
        assert same(warm, cold(engine, turn2)), "bit-exact guard: a host decode hit differs from cold"
    finally:
        engine.shutdown()


def slow_loads(monkeypatch: pytest.MonkeyPatch, delay_s: float) -> threading.Event:
    """Loads back from host wait on the copy worker until `delay_s` passed or the
    returned event is set (the request's budget runs out meanwhile)."""
    import kernel.tiers.host_tier as tier_mod

    real, release = tier_mod.load_back, threading.Event()

    def slow(*args: Any, **kwargs: Any) -> int:
        release.wait(delay_s)
        return real(*args, **kwargs)

    monkeypatch.setattr(tier_mod, "load_back", slow)
    return release


@pytest.mark.parametrize("policy", ["timeout", "best_effort"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_past_its_budget_computes_from_the_device_state(
    hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch, strategy: str, policy: str
) -> None:
    """The request stops waiting (timeout) or never waits (best_effort): it computes the
    host part itself from its device part's state; the late load is then revoked (the
    request's own inserts gave those nodes device pages)."""
    engine = make(hybrid_folders["qwen3_5_text"], strategy, **{
        "hicache.prefetch_policy": policy, "hicache.prefetch_timeout_s": 0.05,
        "hicache.prefetch_timeout_per_token_s": 0.0})
    try:
        ref = cold(engine, PROMPT)
        assert engine.flush_cache()
        split_prefix(engine, head_waits=policy != "best_effort")
        before = host_stats(engine)["prefetch"]
        release = slow_loads(monkeypatch, delay_s=5.0)
        warm = run(engine, PROMPT)
        release.set()
        assert tiers(warm) == {"device": 4 * INTERVAL, "host": 0, "storage": 0}, tiers(warm)
        assert same(warm, ref), "bit-exact guard: the request did not resume from its device state"
        after = host_stats(engine)["prefetch"]
        delta = {k: after[k] - before[k] for k in ("issued", "timed_out", "revoked")}
        assert delta == {"issued": 1, "timed_out": int(policy == "timeout"), "revoked": 1}, delta
    finally:
        engine.shutdown()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_revoked_load_of_a_waiting_request(hybrid_folders: dict[str, str], strategy: str) -> None:
    """Two waiting requests load overlapping host parts (to 40 and to 56) at once: the
    first load restores [32, 40), so the second's restore no longer fits its path and is
    revoked; that request computes from its device part's state (at 32)."""
    short = SHARED[: 5 * INTERVAL + 5]  # its match ends at the checkpoint at 40
    # One checkpoint per chunk: every strategy caches a state at 40 (no_buffer, with
    # 32-token chunks, only at 32 and 56).
    engine = make(hybrid_folders["qwen3_5_text"], strategy, **{"scheduler.chunked_prefill_size": INTERVAL})
    try:
        refs = [cold(engine, short), cold(engine, PROMPT)]
        assert engine.flush_cache()
        split_prefix(engine)
        outs = engine.generate([short, PROMPT], [GREEDY, GREEDY])
        assert isinstance(outs, list)
        assert [tiers(o)["host"] for o in outs] == [INTERVAL, 0], [tiers(o) for o in outs]
        assert all(same(o, r) for o, r in zip(outs, refs)), "bit-exact guard: a revoked load"
        prefetch = host_stats(engine)["prefetch"]
        assert prefetch["revoked"] == 1 and prefetch["completed"] >= 2, prefetch
    finally:
        engine.shutdown()


def evict_states_when_a_load_starts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], int | None]]:
    """Each time a load starts, evict every unlocked state slot (what `HybridState`
    does, one at a time, when the state pool runs out). Records (host-only nodes'
    slots that were evictable, the loading node's slot after the eviction)."""
    real = HostTier.start_load
    seen: list[tuple[list[int], int | None]] = []

    def squeezed(self: HostTier, req: Request, match: Any) -> bool:
        started = real(self, req, match)
        if started and match.host_node is not None:
            tree = self.tree
            host_only = [n.state_slot for n in tree.nodes()  # type: ignore[attr-defined]
                         if not n.pages and n.state_slot is not None and n.lock_ref == 0]
            tree.evict_states(1 << 30)
            seen.append((host_only, match.host_node.state_slot))
        return started

    monkeypatch.setattr(HostTier, "start_load", squeezed)
    return seen


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_eviction_spares_a_node_being_loaded(
    hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """Every unlocked slot goes the moment PROMPT's load starts, host-only nodes' too
    (tombstones; SHARED's decode checkpoint at 64 among them): the node being loaded
    is locked and keeps its slot, the hit is bit-exact, the tree consistent after every
    step and nothing leaks. A later branch of SHARED resumes from the deepest slot that
    was on the locked path (48; no_buffer's 32-token chunks cache none between 32 and 56)."""
    branch = SHARED[: 6 * INTERVAL + 2] + tokens(5, 9)  # leaves PROMPT's path at 50
    resumes_at = 4 * INTERVAL if strategy == "no_buffer" else 6 * INTERVAL
    engine = make(hybrid_folders["qwen3_5_text"], strategy)
    try:
        refs = [cold(engine, PROMPT), cold(engine, branch)]
        assert engine.flush_cache()
        split_prefix(engine)
        seen = evict_states_when_a_load_starts(monkeypatch)
        warm = run(engine, PROMPT)
        assert tiers(warm) == {"device": 4 * INTERVAL, "host": 3 * INTERVAL, "storage": 0}, tiers(warm)
        assert same(warm, refs[0]), "bit-exact guard: the loading node lost its state"
        (host_only, loading_slot), = seen
        assert host_only and loading_slot is not None and loading_slot not in host_only, seen
        out = run(engine, branch)
        assert same(out, refs[1]) and out["meta_info"]["cached_tokens"] == resumes_at, tiers(out)
        assert_accounted(engine)
    finally:
        engine.shutdown()


def test_tree_a_host_only_tombstone_trims_the_host_part() -> None:
    """Tree level: evict_states of a host-only node leaves a tombstone; the host part
    then ends at the deepest host-only node still holding a slot, and a node being
    loaded (locked) keeps the slots on its path."""
    from tests.test_radix_host import Tiered, seq

    t = Tiered(hybrid=True)
    a, b, c = (t.put(seq(0, 2) + seq(30, k), state=True).node for k in range(3))
    for node in (a, b, c):
        t.copy(node)
    t.tree.evict(2)  # c then b lose their device pages: host-only, with their slots
    assert (a.tier, b.tier, c.tier) == ("device+host", "host", "host")
    full = seq(0, 2) + seq(30, 2) + [99, 99]
    hit = t.served(full)
    assert (hit.length, hit.host_length, hit.host_node) == (4, 4, c)

    t.tree.lock(c)  # a load of c's host part in flight
    assert t.tree.evict_states(10) == [] and c.state_slot is not None
    t.tree.unlock(c)
    t.tree.match(seq(0, 2) + seq(30, 1))  # touch a and b: c's slot is the oldest
    c_slot = c.state_slot
    assert t.tree.evict_states(1) == [c_slot] and c.state_slot is None and c.tier == "host"
    t.check()
    hit = t.served(full)
    assert (hit.length, hit.host_length, hit.host_node, hit.state_slot) == (4, 2, b, a.state_slot)
    assert hit.host_node.state_slot == b.state_slot and hit.lost_tokens == 2


# ---- revert-then-red ------------------------------------------------------------
def _state_before(node: Any) -> int | None:
    """The state slot of the nearest ancestor of `node` holding one (None: the root)."""
    walk = node.parent
    while walk is not None and walk.state_slot is None:
        walk = walk.parent
    return walk.state_slot if walk is not None else None


# How a planted `_attach` picks the request's resume slot: (load, the slot before) -> slot.
WRONG_STATES: dict[str, Callable[[Load, int | None], int | None]] = {
    "device_part_state": lambda load, before: before,  # the fix reverted
    "one_checkpoint_short": lambda load, before: _state_before(load.host_node),
}


@pytest.mark.parametrize("wrong", sorted(WRONG_STATES))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_red_resume_from_the_wrong_state(
    hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch, strategy: str, wrong: str
) -> None:
    """The loaded host part is attached but the request resumes from another state: the
    slot accounting is still right (the slot is lent either way), only `==` sees it."""
    real, pick = HostTier._attach, WRONG_STATES[wrong]

    def planted(self: HostTier, req: Request, load: Load) -> None:
        before = req.resume_slot
        real(self, req, load)
        req.resume_slot = pick(load, before)  # planted

    monkeypatch.setattr(HostTier, "_attach", planted)
    engine = make(hybrid_folders["qwen3_5_text"], strategy)
    try:
        ref = cold(engine, PROMPT)
        assert engine.flush_cache()
        split_prefix(engine)
        warm = run(engine, PROMPT)
        assert tiers(warm)["host"] > 0
        assert not same(warm, ref)  # the bit-exact compare goes red
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_red_a_page_copied_to_the_wrong_host_page(
    hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """The state is right but a node's KV pages land one host page early."""
    import kernel.tiers.host_tier as tier_mod

    real = tier_mod.offload

    def shifted(kv_pool: Any, device_pages: list[int], host_pool: Any, host_pages: list[int], *rest: Any) -> int:
        # planted: each page in the host page before its own (a permutation would change
        # the output by rounding only: tests/test_host_tier.py `one_page_early`)
        return one_page_early(lambda d, h: real(kv_pool, d, host_pool, h, *rest), device_pages, host_pages)

    monkeypatch.setattr(tier_mod, "offload", shifted)
    engine = make(hybrid_folders["qwen3_5_text"], strategy)
    try:
        refs = [cold(engine, HEAD), cold(engine, PROMPT)]
        assert engine.flush_cache()
        head = split_prefix(engine)
        warm = run(engine, PROMPT)
        assert tiers(warm)["host"] > 0
        assert not same(head, refs[0]) and not same(warm, refs[1])  # the bit-exact compare goes red
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()
