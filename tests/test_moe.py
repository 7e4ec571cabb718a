"""Mixture-of-experts models (gpu/moe/, gpu/models/llama_moe.py) in the engine: routing as
the reference does it, deterministic mode batch-invariant (a token's expert outputs do not
depend on which tokens were routed with it), radix hits bit-identical, and the graph
runner refused for the eager-only implementation. Parity with transformers:
tests/test_tiny_models.py (qwen3_moe)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kernel import Engine
from kernel.config import ConfigError
from tests.conftest import FLOAT32, GRAPHS_EMULATE, graph_replays
from tests.tiny_models import VOCAB, build_tiny

PARAMS = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True, "return_logprob": True,
          "top_logprobs_num": 3}


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny("qwen3_moe", Path(tmp_path_factory.mktemp("moe")) / "qwen3_moe"))


def make(folder: str, **extra: Any) -> Engine:
    return Engine(None, {**FLOAT32, "model.path": folder, "cache.num_pages": 128, "cache.page_size": 4,
                         "cache.prefix": "radix", "scheduler.chunked_prefill_size": 16,
                         "scheduler.max_num_batched_tokens": 32, "debug.check_invariants": True, **extra})


@pytest.fixture(scope="module")
def det(moe_folder: str) -> Iterator[Engine]:
    engine = make(moe_folder, deterministic=True)
    yield engine
    engine.shutdown()


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + j * 17) % (VOCAB - 10) + 5 for j in range(n)]


def exact(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["output_ids"] == b["output_ids"], "moe guard: tokens differ"
    assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"], \
        "moe guard: logprobs differ"
    assert a["meta_info"]["output_top_logprobs"] == b["meta_info"]["output_top_logprobs"], \
        "moe guard: top logprobs differ"


def alone_vs_batch(engine: Engine) -> None:
    target = prompt(1, 13)
    others = [prompt(2 + i, 5 + 7 * i) for i in range(5)]
    assert engine.flush_cache()
    alone = engine.generate(target, PARAMS)
    assert engine.flush_cache()
    outs = engine.generate(others[:2] + [target] + others[2:], PARAMS)
    assert isinstance(outs, list)
    exact(outs[2], alone)  # type: ignore[arg-type]


def test_routing_matches_the_reference() -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from gpu.moe.routing import softmax_topk

    for normalize in (True, False):
        config = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=normalize)
        router = Qwen3MoeTopKRouter(config)
        torch.nn.init.normal_(router.weight)
        x = torch.randn(11, 16)
        _, weights, experts = router(x)
        got = softmax_topk(torch.nn.functional.linear(x, router.weight), 3, normalize)
        assert torch.equal(got.experts, experts) and torch.equal(got.weights, weights)


def test_deterministic_batch_invariance(det: Engine) -> None:
    """A request decoded among others (chunked prefills, other tokens in its experts'
    groups) gives exactly what it gives alone."""
    alone_vs_batch(det)


def test_planted_group_order_red(det: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The experts run smallest group first: a token's sum over its 3 experts then runs in
    an order its batch decides, and the guard sees the bits move. (Largest first happens to
    keep this target's three experts in one order alone and in this batch with the C++
    glue's rounding: its bits do not move there.)"""
    from gpu.moe import torch_moe

    def smallest_first(self: Any, linear: Any, x: torch.Tensor, routing: Any, experts: Any) -> torch.Tensor:
        k = routing.experts.shape[1]
        flat = routing.experts.reshape(-1)
        weights = routing.weights.reshape(-1)
        counts = torch.bincount(flat, minlength=len(experts.down))
        out = torch.zeros_like(x)
        for e in torch.argsort(counts, stable=True).tolist():
            pairs = (flat == e).nonzero().reshape(-1)
            if len(pairs):
                y = torch_moe.swiglu(linear, x.index_select(0, pairs // k), experts.gate_up[e], experts.down[e])
                out.index_add_(0, pairs // k, y * weights.index_select(0, pairs)[:, None])
        return out

    monkeypatch.setattr(torch_moe.TorchMoE, "__call__", smallest_first)
    with pytest.raises(AssertionError, match="moe guard"):
        alone_vs_batch(det)


def test_radix_hit_is_bit_exact(det: Engine) -> None:
    first = prompt(7, 21)
    out = det.generate(first, PARAMS)
    turn = first + out["output_ids"] + prompt(8, 6)  # type: ignore[index,call-overload,operator]
    warm = det.generate(turn, PARAMS)
    assert warm["meta_info"]["cached_tokens"] >= 20  # type: ignore[index,call-overload]
    assert det.flush_cache()
    cold = det.generate(turn, PARAMS)
    assert cold["meta_info"]["cached_tokens"] == 0  # type: ignore[index,call-overload]
    exact(warm, cold)  # type: ignore[arg-type]


def test_config_errors(moe_folder: str) -> None:
    with pytest.raises(ConfigError, match="static shapes"):
        make(moe_folder, **{"graphs.mode": "emulate", "model.attention": "deterministic", "model.moe": "torch"})
    with pytest.raises(ConfigError, match="model.moe"):
        make(moe_folder, **{"model.moe": "nope"})


def test_tokens_per_expert_are_counted(det: Engine) -> None:
    """Every routed token counted once per chosen expert, in /metrics' family too."""
    from plugins.metrics import counters

    before = det.engine.stats()["moe"]
    det.generate(prompt(9, 11), {**PARAMS, "max_new_tokens": 4})
    after = det.engine.stats()["moe"]
    assert sorted(after) == ["0", "2"]  # the sparse layers (1 is in mlp_only_layers)
    k = 3  # num_experts_per_tok of the tiny checkpoint
    # 11 prompt tokens + 3 decode steps run through each sparse layer (the last token is not fed).
    for layer in after:
        assert sum(after[layer]) - sum(before[layer]) == k * (11 + 3)
    family = next(m for m in counters(det.engine.stats()) if m.name == "tierserve_moe_expert_tokens")
    assert sum(s.value for s in family.samples if s.name.endswith("_total")) == sum(map(sum, after.values()))


def test_expert_loads_histogram() -> None:
    """One observation per expert, its tokens over an even share: 60 tokens over 4 experts
    (15 each if even) routed 0 / 10 / 10 / 40 are loads 0, 2/3, 2/3, 8/3."""
    from prometheus_client import CollectorRegistry, generate_latest

    from plugins.metrics import moe_metrics

    class One:
        def collect(self) -> Any:
            return moe_metrics({"0": [0, 10, 10, 40], "2": [0, 0, 0, 0]})

    registry = CollectorRegistry()
    registry.register(One())  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    buckets = {le: float(v) for le, v in
               (line.split('le="')[1].split('"} ') for line in text.splitlines()
                if line.startswith('tierserve_moe_expert_load_bucket{layer="0"'))}
    assert (buckets["0.0"], buckets["0.5"], buckets["0.75"], buckets["2.0"], buckets["4.0"], buckets["+Inf"]) == (
        1, 1, 3, 3, 4, 4)
    assert 'tierserve_moe_expert_load_sum{layer="0"} 4.0' in text
    assert 'tierserve_moe_expert_load_bucket{layer="2",le="0.0"} 4.0' in text  # nothing routed yet


def test_graph_padding_rows_are_not_counted(moe_folder: str) -> None:
    """Under the graph runner (`model.moe: dense`, emulated) a bucket's padding rows are routed
    like tokens: only the live ones are counted, and the capture's warm-up forwards not at all."""
    counts = graph_counts(moe_folder)
    assert counts["prefill"] > 0 and counts["decode"] > 0  # both kinds of bucket replayed
    assert counts["start"] == 0  # the warm-up forwards of every bucket
    assert counts["routed"] == 3 * (11 + 3)  # k x (prompt + decode steps), per sparse layer


def test_red_padding_rows_counted(moe_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the replay counts every row of the bucket."""
    from gpu.moe.layers import MoeLayers

    count = MoeLayers.count
    monkeypatch.setattr(MoeLayers, "count", lambda self, routes, tokens: count(self, routes, 1 << 30))
    assert graph_counts(moe_folder)["routed"] > 3 * (11 + 3)


def graph_counts(folder: str) -> dict[str, int]:
    engine = make(folder, **GRAPHS_EMULATE, **{"model.moe": "dense", "model.attention": "deterministic"})
    try:
        start = engine.engine.stats()["moe"]
        engine.generate(prompt(9, 11), {**PARAMS, "max_new_tokens": 4})
        after = engine.engine.stats()["moe"]
        replays = graph_replays(engine)
    finally:
        engine.shutdown()
    routed = {sum(after[layer]) - sum(start[layer]) for layer in after}
    assert len(routed) == 1  # the same in every sparse layer
    return {"start": sum(map(sum, start.values())), "routed": routed.pop(), **replays}


def test_sliding_window_configs() -> None:
    """Qwen3-MoE configs carry a sliding_window they do not use; Mixtral's would be used: refused."""
    from gpu.loader.hf import build_arch_config

    config = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 4, "max_position_embeddings": 40960, "sliding_window": 4096,
              "use_sliding_window": False}
    assert build_arch_config(config).sparse_layers == (0, 1)
    mixtral = {k: v for k, v in config.items() if k != "moe_intermediate_size"}
    mixtral.update(architectures=["MixtralForCausalLM"], use_sliding_window=True)
    with pytest.raises(ValueError, match="sliding"):
        build_arch_config(mixtral)
    assert build_arch_config({**mixtral, "sliding_window": None}).moe_intermediate_size == 8  # intermediate_size


def test_host_tier_hit_and_retraction_exact(moe_folder: str, det: Engine) -> None:
    """A prefix pushed out to the host tier and loaded back, and requests retracted under
    page pressure, give exactly what a cold run gives (deterministic mode)."""
    from tests.test_host_tier import settle

    params = {**PARAMS, "max_new_tokens": 6}
    shared = prompt(20, 40)
    target = shared + prompt(21, 5)
    assert det.flush_cache()
    cold = det.generate(target, params)
    tiered = make(moe_folder, deterministic=True, **{"cache.num_pages": 41, "hicache.host_pages": 200})
    try:
        tiered.generate(shared, params)  # cached on device, written through to host
        for i in range(5):  # fill the device pool: the shared prefix is evicted to host
            tiered.generate(prompt(30 + i, 40), {**params, "max_new_tokens": 2})
            settle(tiered)
        before = tiered.engine.stats()["host"]["loaded_pages"]
        exact(tiered.generate(target, params), cold)  # type: ignore[arg-type]
        assert tiered.engine.stats()["host"]["loaded_pages"] > before, "no host hit"
    finally:
        tiered.shutdown()
    prompts = [prompt(40 + i, 10 + i) for i in range(6)]
    params = {**PARAMS, "max_new_tokens": 30}
    assert det.flush_cache()
    refs = det.generate(prompts, params)
    small = make(moe_folder, deterministic=True, **{"cache.num_pages": 25})  # 96 tokens for ~6 x 42
    try:
        outs = small.generate(prompts, params)
        assert small.engine.scheduler.num_retractions > 0
        for out, ref in zip(outs, refs):  # type: ignore[arg-type]
            exact(out, ref)  # type: ignore[arg-type]
    finally:
        small.shutdown()


def few_equals_grouped(few: Any, dtype: torch.dtype) -> bool:
    """The few-token path against the grouped one, row-invariant linears, 1-8 tokens,
    top-3 of 6 random experts: every bit equal."""
    from gpu.batch_invariant import linear_tiled
    from gpu.moe.routing import softmax_topk
    from gpu.moe.torch_moe import Experts, TorchMoE

    torch.manual_seed(3)
    hidden, width = 32, 16
    experts = Experts(gate_up=[(torch.randn(2 * width, hidden) / 4).to(dtype) for _ in range(6)],
                      down=[(torch.randn(hidden, width) / 3).to(dtype) for _ in range(6)])
    for tokens in range(1, 9):
        x = torch.randn(tokens, hidden).to(dtype)
        routing = softmax_topk(torch.randn(tokens, 6).to(dtype), 3, True)
        if not torch.equal(few(linear_tiled, x, routing, experts), TorchMoE._grouped(linear_tiled, x, routing, experts)):
            return False
    return True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_token_path_gives_the_grouped_bits(dtype: torch.dtype) -> None:
    from gpu.moe.torch_moe import TorchMoE

    assert few_equals_grouped(TorchMoE._few, dtype)


def test_red_few_token_path_in_routing_order() -> None:
    """Planted: the few-token path adds each token's experts in its routing order (best
    first), not in expert order: the guard above goes red."""
    from gpu.moe.torch_moe import swiglu

    def routing_order(linear: Any, x: torch.Tensor, routing: Any, experts: Any) -> torch.Tensor:
        out = torch.zeros_like(x)
        for t, (chosen, weights) in enumerate(zip(routing.experts.tolist(), routing.weights.tolist())):
            for e, w in zip(chosen, weights):
                out[t] += swiglu(linear, x[t : t + 1], experts.gate_up[e], experts.down[e])[0] * w
        return out

    assert not few_equals_grouped(routing_order, torch.float32)
