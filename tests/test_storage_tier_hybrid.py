"""The storage tier with hybrid models, deterministic mode: a node's recurrent state is
written with its last page, and a prompt whose prefix is only in storage resumes from the
deepest stored state — tokens and logprobs `==` a cold run, for every state strategy,
prefill and decode hits, counted as storage hits.

Revert-then-red: a state written at the wrong position (a node's key with the state of
the checkpoint before it) is caught by the bit-exact compare. Pages, state slots and host pages are
checked by tests/leaks.py at teardown and by the integrity check after every step.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, cast

import pytest

from kernel import Engine
from tests import leaks
from tests.conftest import HYBRID_FAMILIES, HYBRID_OVERRIDES
from tests.tiny_hybrid import VOCAB

STRATEGIES = ("no_buffer", "extra_buffer", "extra_buffer_lazy")
INTERVAL = cast(int, HYBRID_OVERRIDES["cache.state_track_interval"])  # 8 tokens, 2 pages
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "return_logprob": True}
TIERED = {"cache.num_pages": 41, "hicache.host_pages": 200, "deterministic": True,
          "debug.check_invariants": True, "hicache.storage": "file"}


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


PROMPT = tokens(1, 7 * INTERVAL + 4) + tokens(2, 7)  # 67 tokens: states cached at 8, 16, ..., 64


def make(folder: str, strategy: str, storage_dir: Path) -> Engine:
    return Engine(None, {**HYBRID_OVERRIDES, **TIERED, "model.path": folder, "cache.state_strategy": strategy,
                         "hicache.storage_dir": str(storage_dir)})


def run(engine: Engine, prompt: list[int], params: dict[str, Any] = GREEDY) -> dict[str, Any]:
    out = engine.generate(prompt, params)
    assert isinstance(out, dict)
    return out


def logprobs(out: dict[str, Any]) -> list[float]:
    return [lp for lp, _ in out["meta_info"]["output_token_logprobs"]]


def same(out: dict[str, Any], ref: dict[str, Any]) -> bool:
    return out["output_ids"] == ref["output_ids"] and logprobs(out) == logprobs(ref)


def tiers(out: dict[str, Any]) -> dict[str, int]:
    return out["meta_info"]["cached_tokens_by_tier"]  # type: ignore[no-any-return]


def from_storage(engine: Engine, prompt: list[int], params: dict[str, Any] = GREEDY) -> dict[str, Any]:
    """`prompt` after the tree was emptied (copies and writes settled first): whatever it
    reuses comes from storage."""
    assert engine.flush_cache()
    return run(engine, prompt, params)


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_prefill_hit_from_storage(hybrid_folders: dict[str, str], strategy: str, family: str, tmp_path: Path) -> None:
    engine = make(hybrid_folders[family], strategy, tmp_path)
    try:
        ref = run(engine, PROMPT)  # cold: storage starts empty; its pages and states go there
        assert ref["meta_info"]["cached_tokens"] == 0
        warm = from_storage(engine, PROMPT)
        assert tiers(warm) == {"device": 0, "host": 0, "storage": 8 * INTERVAL}, tiers(warm)
        assert same(warm, ref), "bit-exact guard: a storage hit differs from cold"
        storage = engine.engine.stats()["storage"]
        assert storage["prefetch"]["completed"] == 1 and storage["hit_tokens"] == 8 * INTERVAL
    finally:
        engine.shutdown()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_decode_hit_from_storage(hybrid_folders: dict[str, str], strategy: str, tmp_path: Path) -> None:
    """The second turn resumes from a state the first turn's generated tokens reached."""
    engine = make(hybrid_folders["qwen3_5_text"], strategy, tmp_path)
    try:
        first = tokens(3, 3 * INTERVAL + 2)
        turn1 = run(engine, first, {**GREEDY, "max_new_tokens": 3 * INTERVAL})
        turn2 = first + turn1["output_ids"] + tokens(4, 5)
        warm = from_storage(engine, turn2)
        assert tiers(warm)["storage"] > len(first) and tiers(warm)["device"] == 0, tiers(warm)
        engine.engine.storage.backend.clear()  # type: ignore[union-attr]
        cold = from_storage(engine, turn2)
        assert cold["meta_info"]["cached_tokens"] == 0
        assert same(warm, cold)
    finally:
        engine.shutdown()


def test_a_missing_state_resumes_at_the_deepest_stored_one(hybrid_folders: dict[str, str], tmp_path: Path) -> None:
    engine = make(hybrid_folders["qwen3_5_text"], "extra_buffer", tmp_path)
    try:
        ref = run(engine, PROMPT)
        assert engine.flush_cache()
        storage = engine.engine.storage
        assert storage is not None and storage.state_fmt is not None
        from cache.kv_events import page_hashes
        from cache.storage import keys_for_hashes

        hashes = page_hashes(PROMPT, 4)
        last_state = keys_for_hashes([hashes[15]], storage.state_fmt)[0]  # the state after 64 tokens
        assert storage.backend.delete([last_state]) == 1
        warm = run(engine, PROMPT)
        assert tiers(warm)["storage"] == 7 * INTERVAL, tiers(warm)  # the state after 56
        assert same(warm, ref)
    finally:
        engine.shutdown()


def plant_state_one_checkpoint_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's pages and state key written with the state of the checkpoint before it."""
    import kernel.tiers.storage_tier as storage_mod

    real = storage_mod.StorageTier.capture

    def one_checkpoint_early(self: Any, node: Any, host_pages: list[int]) -> Any:
        parent = node.parent  # planted: the node's key, the state of the checkpoint before it
        if node.state_slot is None or parent is None or parent.state_slot is None:
            return real(self, node, host_pages)
        own, node.state_slot = node.state_slot, parent.state_slot
        try:
            return real(self, node, host_pages)
        finally:
            node.state_slot = own

    monkeypatch.setattr(storage_mod.StorageTier, "capture", one_checkpoint_early)


def test_red_a_state_written_at_the_wrong_position(
    hybrid_folders: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plant_state_one_checkpoint_early(monkeypatch)
    engine = make(hybrid_folders["qwen3_5_text"], "extra_buffer", tmp_path)
    try:
        ref = run(engine, PROMPT)
        warm = from_storage(engine, PROMPT)
        assert tiers(warm)["storage"] == 8 * INTERVAL
        assert not same(warm, ref)  # the bit-exact compare goes red
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()


def test_red_a_state_read_before_its_queued_copy_landed(
    hybrid_folders: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """no_buffer caches a state by a copy from the live slot that runs before the next
    forward; reverting the wait (the copy to host and storage starts at once, and here
    reads the slot at once, as a fast copy worker would) stores a stale state, and the
    bit-exact compare catches it."""
    import kernel.tiers.storage_tier as storage_mod
    from cache.host_state_pool import slot_to_bytes

    real = storage_mod.StorageTier.capture

    def eager(self: Any, node: Any, host_pages: list[int]) -> Any:
        items = real(self, node, host_pages)
        if items is None or node.state_slot is None or self.states is None:
            return items
        now = slot_to_bytes(self.states.tensors(), node.state_slot)  # before the queued copy ran

        def with_early_state() -> list[tuple[str, bytes]]:
            out = items()
            return [*out[:-1], (out[-1][0], now)]

        return with_early_state

    engine = make(hybrid_folders["qwen3_5_text"], "no_buffer", tmp_path)
    host = engine.engine.host
    assert host is not None
    monkeypatch.setattr(host, "state_pending", lambda slot: False)  # planted: the fix reverted
    monkeypatch.setattr(storage_mod.StorageTier, "capture", eager)
    try:
        ref = run(engine, PROMPT)
        warm = from_storage(engine, PROMPT)
        assert tiers(warm)["storage"] > 0
        assert not same(warm, ref)
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()
