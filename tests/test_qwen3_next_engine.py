"""Qwen3-Next (Gated DeltaNet and gated attention layers, sparse MoE blocks with a gated
shared expert) in the engine, deterministic mode: cache hits `==` cold runs for the three
state strategies with the graph runner off (`model.moe: torch`) and emulated
(`model.moe: dense`, the static-shape implementation); hits from host and storage under
emulated graphs; `dense` gives `torch`'s bits. Parity with transformers:
tests/test_hybrid_moe.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import GRAPHS_EMULATE, assert_replayed, graph_replays
from tests.test_bit_exact_hybrid import GREEDY, guard_decode_hit, guard_prefill_hit, make, tokens
from tests.test_tier_combos_hybrid import GRAPHS, make_tiered, tier_round_trip

DENSE = {"model.moe": "dense"}


@pytest.mark.parametrize("graphs", ["off", "emulate"])
@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_cache_hits_are_bit_exact(hybrid_folders: dict[str, str], strategy: str, graphs: str) -> None:
    emulated = graphs == "emulate"
    engine = make(hybrid_folders["qwen3_next"], strategy, **({**GRAPHS_EMULATE, **DENSE} if emulated else {}))
    try:
        before = graph_replays(engine) if emulated else {}
        guard_prefill_hit(engine)
        guard_decode_hit(engine)
        if emulated:
            assert_replayed(engine, before)
    finally:
        engine.shutdown()


def test_host_and_storage_hits_with_graphs_emulated(hybrid_folders: dict[str, str], tmp_path: Path) -> None:
    engine = make_tiered(hybrid_folders["qwen3_next"], tmp_path, **GRAPHS, **DENSE)
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


def test_dense_gives_torchs_bits(hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every expert over every token, weighted by zero where not routed: in deterministic
    mode the same bits as running each expert over its own tokens. Planted: each expert
    weighted by the routing weight of the same *slot* (not of the same expert) -> red."""
    from gpu.moe import dense_moe

    folder = hybrid_folders["qwen3_next"]
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
