"""Hybrid MoE models in the engine, deterministic mode: cache hits `==` cold runs for the
three state strategies with the graph runner off (`model.moe: torch`) and emulated
(`model.moe: dense`, the static-shape implementation) — Qwen3-Next in full, Qwen3.5-MoE and
LFM2-MoE with `extra_buffer`; hits from host and storage under emulated graphs; `dense`
gives `torch`'s bits. Parity with transformers: tests/test_hybrid_moe.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import GRAPHS_EMULATE, HYBRID_MOE_FAMILIES, assert_replayed, graph_replays
from tests.test_bit_exact_hybrid import GREEDY, guard_decode_hit, guard_prefill_hit, make, tokens
from tests.test_tier_combos_hybrid import GRAPHS, make_tiered, tier_round_trip

DENSE = {"model.moe": "dense"}


STRATEGIES = ("no_buffer", "extra_buffer", "extra_buffer_lazy")
# Qwen3-Next in full; Qwen3.5-MoE (the same decoder and blocks, every layer sparse) and
# LFM2-MoE with `extra_buffer` (the suite's time budget).
CASES = [(family, strategy, graphs) for family in HYBRID_MOE_FAMILIES for strategy in STRATEGIES
         for graphs in ("off", "emulate") if family == "qwen3_next" or strategy == "extra_buffer"]


@pytest.mark.parametrize("family,strategy,graphs", CASES)
def test_cache_hits_are_bit_exact(hybrid_moe_folders: dict[str, str], family: str, strategy: str, graphs: str) -> None:
    emulated = graphs == "emulate"
    engine = make(hybrid_moe_folders[family], strategy, **({**GRAPHS_EMULATE, **DENSE} if emulated else {}))
    try:
        before = graph_replays(engine) if emulated else {}
        guard_prefill_hit(engine)
        guard_decode_hit(engine)
        if emulated:
            assert_replayed(engine, before)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe_text"])
def test_host_and_storage_hits_with_graphs_emulated(hybrid_moe_folders: dict[str, str], family: str,
                                                    tmp_path: Path) -> None:
    engine = make_tiered(hybrid_moe_folders[family], tmp_path, **GRAPHS, **DENSE)
    try:
        tier_round_trip(engine)
        assert all(graph_replays(engine).values())
    finally:
        engine.shutdown()


def outputs(folder: str, moe: str) -> list[dict[str, Any]]:
    """Six requests batched together (chunked prefills beside decodes): greedy, logprobs."""
    engine = make(folder, "extra_buffer", **{"model.moe": moe})
    try:
        prompts = [tokens(40 + i, 5 + 9 * i) for i in range(6)]
        outs = engine.generate(prompts, [GREEDY] * len(prompts))
        assert isinstance(outs, list)
        return outs  # type: ignore[return-value]
    finally:
        engine.shutdown()


def dense_equals_torch(folder: str, torch_outs: list[dict[str, Any]]) -> None:
    for dense, grouped in zip(outputs(folder, "dense"), torch_outs):
        assert dense["output_ids"] == grouped["output_ids"], "moe guard: dense tokens differ from torch's"
        assert dense["meta_info"]["output_token_logprobs"] == grouped["meta_info"]["output_token_logprobs"], \
            "moe guard: dense logprobs differ from torch's"


def test_dense_gives_torchs_bits(hybrid_moe_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every expert over every token, weighted by zero where not routed: in deterministic
    mode the same bits as running each expert over its own tokens. Planted: each expert
    weighted by the routing weight of the same *slot* (not of the same expert) -> red."""
    from gpu.moe import dense_moe

    folder = hybrid_moe_folders["qwen3_next"]
    grouped = outputs(folder, "torch")
    dense_equals_torch(folder, grouped)

    def by_slot(self: Any, linear: Any, x: torch.Tensor, routing: Any, experts: Any) -> torch.Tensor:
        out = torch.zeros_like(x)
        k = routing.weights.shape[1]
        for e in range(len(experts.down)):
            out = out + dense_moe.swiglu(linear, x, experts.gate_up[e], experts.down[e]) * routing.weights[:, e % k, None]
        return out

    monkeypatch.setattr(dense_moe.DenseMoE, "__call__", by_slot)
    with pytest.raises(AssertionError, match="moe guard"):
        dense_equals_torch(folder, grouped)
