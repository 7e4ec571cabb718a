"""Hybrid models through the host and storage tiers in two settings the tier tests leave
out: the graph runner emulated (`graphs.mode: emulate`) and `model.dtype: bfloat16`
(recurrent states stay float32, conv windows and KV pages are bf16). Deterministic mode.

One round trip per engine: a cold run caches PROMPT (its pages go to host and storage as
they are cached), every device page is then pushed out (each node keeps only its host
copy, and its state slot: hybrid states never move to host), PROMPT hits on host, the
tree is emptied, PROMPT hits on storage (its state read back into a fresh slot). Each hit
is counted by the tier it means (`cached_tokens_by_tier`) and its tokens and logprobs
are `==` the cold run's.

Revert-then-red, each caught by the bit-exact guard of the tier it breaks: a host hit
(graphs emulated) that resumes from the state one checkpoint short, and (bf16) the
float32 recurrent state rounded to the model dtype on its way to storage.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from cache.state_pool import RECURRENT_DTYPE
from kernel import Engine
from kernel.request import Request
from kernel.tiers.host_tier import HostTier, Load
from tests import leaks
from tests.conftest import GRAPHS_EMULATE, HYBRID_FAMILIES, HYBRID_OVERRIDES, graph_replays
from tests.test_bit_exact_hybrid import assert_bit_exact
from tests.test_host_tier_hybrid import INTERVAL, WRONG_STATES, cold, run, tiers, tokens
from tests.test_storage_tier_hybrid import TIERED as STORAGE_TIERED
from tests.test_storage_tier_hybrid import from_storage

HIT = 4 * INTERVAL  # PROMPT's deepest cached state: after 32 tokens
PROMPT = tokens(1, HIT + 3)
GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True, "return_logprob": True}
BF16: dict[str, Any] = {"model.dtype": "bfloat16"}
# The emulated graph runner with only the buckets these steps need (fewer to warm up):
# one decode row, prefill chunks of up to 32 tokens (a hit's 3-token rest fits 16).
GRAPHS: dict[str, Any] = {**GRAPHS_EMULATE, "graphs.decode_buckets": [1], "graphs.prefill_tokens": [16, 32],
          "graphs.prefill_max_requests": 1}


def make_tiered(folder: str, storage_dir: Path, strategy: str = "extra_buffer", **extra: Any) -> Engine:
    """A hybrid engine with a small device pool, a host tier and a `file` storage tier."""
    return Engine(None, {**HYBRID_OVERRIDES, **STORAGE_TIERED, "model.path": folder,
                         "cache.state_strategy": strategy, "hicache.storage_dir": str(storage_dir), **extra})


def push_all_to_host(engine: Engine) -> int:
    """Once every host copy has landed, evict every unlocked device page: a cached node
    with a host copy becomes host-only (keeping its state slot), one without leaves.
    What device pressure does, all at once. Returns the device pages freed."""
    async def evict() -> int:
        ae = engine.engine
        host = ae.host
        assert host is not None, "the engine has no host tier"
        while not ae.is_idle() or host.deferred:
            await asyncio.sleep(0.002)
        tree = ae.scheduler.prefix.cache
        return len(tree.evict(tree.total_pages))

    return engine._call(evict())


def check_hit(out: dict[str, Any], ref: dict[str, Any], tier: str) -> None:
    """`out` reused HIT tokens, all from `tier`, and is bit-identical to `ref`."""
    try:
        assert_bit_exact(out, ref)
    except AssertionError as exc:
        raise AssertionError(f"{tier} hit: {exc}") from None
    want = {"device": 0, "host": 0, "storage": 0, tier: HIT}
    assert tiers(out) == want, f"{tier} hit: served by {tiers(out)}"


def tier_round_trip(engine: Engine) -> None:
    ref = cold(engine, PROMPT, GREEDY)  # storage starts empty: PROMPT's pages and states go there
    assert push_all_to_host(engine) > 0
    check_hit(run(engine, PROMPT, GREEDY), ref, "host")
    check_hit(from_storage(engine, PROMPT, GREEDY), ref, "storage")
    stats = engine.engine.stats()
    assert stats["host"]["prefetch"]["completed"] >= 2 and stats["storage"]["hit_tokens"] == HIT, stats


# ---- guards ---------------------------------------------------------------------
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_tiers_with_graphs_emulated(hybrid_folders: dict[str, str], family: str, tmp_path: Path) -> None:
    engine = make_tiered(hybrid_folders[family], tmp_path, **GRAPHS)
    try:
        tier_round_trip(engine)
        replays = graph_replays(engine)
        assert all(replays.values()), replays  # decode and prefill ran in the buckets
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_bf16_states_through_host_and_storage(hybrid_folders: dict[str, str], family: str, tmp_path: Path) -> None:
    engine = make_tiered(hybrid_folders[family], tmp_path, **BF16)
    try:
        ae = engine.engine
        states, host = ae.parts.runner.states, ae.host
        assert states is not None and host is not None
        assert ae.parts.runner.model.dtype == torch.bfloat16 and host.host_pool.dtype == torch.bfloat16
        assert {t.dtype for t in states.conv} == {torch.bfloat16}
        assert {t.dtype for t in states.recurrent if t is not None} <= {RECURRENT_DTYPE}
        tier_round_trip(engine)
    finally:
        engine.shutdown()


# ---- revert-then-red ------------------------------------------------------------
def plant_host_resume_one_checkpoint_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded host part is attached, but the request resumes from the state of the
    checkpoint before the host node's."""
    real, pick = HostTier._attach, WRONG_STATES["one_checkpoint_short"]

    def planted(self: HostTier, req: Request, load: Load) -> None:
        before = req.resume_slot
        real(self, req, load)
        req.resume_slot = pick(load, before)

    monkeypatch.setattr(HostTier, "_attach", planted)


def plant_recurrent_state_in_model_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """The state bytes for storage rounded to bf16: the float32 recurrent state loses
    its low bits (the blob's size and checksum stay valid)."""
    from kernel.tiers import storage_io

    real = storage_io.slot_to_bytes

    def rounded(tensors: Any, slot: int) -> bytes:
        return real([t[slot : slot + 1].to(torch.bfloat16).to(t.dtype) for t in tensors], 0)

    monkeypatch.setattr(storage_io, "slot_to_bytes", rounded)


PLANTS: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], dict[str, Any], str]] = {
    # name: (plant, engine settings, the guard that goes red)
    "graphs-host_resume_one_checkpoint_short": (plant_host_resume_one_checkpoint_short, GRAPHS, "host"),
    # (A state stored one checkpoint early, the storage half's plant, is red without graphs
    # in tests/test_storage_tier_hybrid.py and with Redis in test_storage_state_blobs_hybrid.py.)
    "bf16-storage_recurrent_state_rounded": (plant_recurrent_state_in_model_dtype, BF16, "storage"),
}


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_red_a_wrong_state_through_a_tier(
    hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str
) -> None:
    plant, settings, tier = PLANTS[name]
    plant(monkeypatch)
    engine = make_tiered(hybrid_folders["qwen3_5_text"], tmp_path, **settings)
    try:
        with pytest.raises(AssertionError, match=f"^{tier} hit: bit-exact guard"):
            tier_round_trip(engine)
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()
