"""Tensor parallelism with the graph runner emulated (`graphs.mode: emulate`): every rank
builds the same buckets from the same config, warms them up together (their collectives
run inside the static-shape forward, eagerly over gloo) and runs each batch in the bucket
rank 0 runs it in. Greedy tokens equal tp_size 1's (logprobs within 1e-4, float32),
deterministic cache hits `==` cold runs at tp_size 2 in graph buckets, dense and hybrid.
Planted: a worker told another bucket than rank 0's refuses the step before its first
collective, and the engine halts with an error instead of mixing shapes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kernel import Engine
from kernel.parallel.workers import TensorParallelRunner
from tests import leaks
from tests.conftest import GRAPHS_EMULATE, assert_replayed, graph_replays
from tests.test_tensor_parallel import GREEDY, PROMPTS, assert_same, engine
from tests.tiny_hybrid import build_tiny_qwen3_5
from tests.tiny_models import build_tiny, build_tiny_llama

DET = {"deterministic": True, **GRAPHS_EMULATE, "scheduler.chunked_prefill_size": 32,
       "scheduler.max_num_batched_tokens": 64}  # chunks that fit the prefill buckets
NONE = {"decode": 0, "prefill": 0}

BUILDS = {
    "llama": (lambda f: build_tiny_llama(f, 6, 2), {}),
    "qwen3_5": (lambda f: build_tiny_qwen3_5(f), {"cache.state_track_interval": 32}),  # a chunk reaches one
    "qwen3_moe": (lambda f: build_tiny("qwen3_moe", f), {"model.moe": "dense"}),  # static shapes
}


def generate(path: str, tp: int, prompts: list[Any], **extra: Any) -> tuple[list[dict[str, Any]], dict[str, int]]:
    e = engine(path, tp, **extra)
    try:
        out = e.generate(prompts, GREEDY)
        assert isinstance(out, list)
        return out, graph_replays(e)
    finally:
        e.shutdown()


@pytest.mark.parametrize("case", list(BUILDS))
def test_graphs_emulated_at_tp2_match_tp1(case: str, tmp_path: Path) -> None:
    build, extra = BUILDS[case]
    path = str(build(tmp_path))
    ref, _ = generate(path, 1, PROMPTS, **DET, **extra)
    got, replays = generate(path, 2, PROMPTS, **DET, **extra)
    assert_same(ref, got)
    assert replays["decode"] > 0 and replays["prefill"] > 0, replays


@pytest.mark.parametrize("case", ["llama", "qwen3_5"])
def test_deterministic_hit_equals_cold_at_tp2_in_graph_buckets(case: str, tmp_path: Path) -> None:
    build, extra = BUILDS[case]
    path = str(build(tmp_path))
    shared = [(7 * i) % 300 + 3 for i in range(128)]  # whole pages and two state checkpoints
    first, second = shared + [5, 6, 7], shared + [8, 9]
    cold, _ = generate(path, 2, [second], **DET, **extra)
    e = engine(path, 2, **DET, **extra)
    try:
        e.generate(first, GREEDY)
        before = graph_replays(e)
        warm = e.generate([second, [3, 4, 5]], GREEDY)[0]  # type: ignore[index]
        assert_replayed(e, before, ("decode",))
    finally:
        e.shutdown()
    assert warm["meta_info"]["cached_tokens"] >= 64
    assert warm["output_ids"] == cold[0]["output_ids"]
    assert warm["meta_info"]["output_token_logprobs"] == cold[0]["meta_info"]["output_token_logprobs"]


def test_red_a_worker_told_another_bucket_halts_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 tells the workers "eager" while it replays a bucket: the worker refuses before
    the step's first collective; rank 0's collective fails; every request gets the error."""
    monkeypatch.setattr(TensorParallelRunner, "bucket_of", lambda self, batch: None)
    path = str(build_tiny_llama(tmp_path, 6, 2))
    e: Engine = engine(path, 2, **DET)
    procs = e.engine.parts.runner.workers.procs  # type: ignore[attr-defined]
    try:
        with pytest.raises(Exception, match="tensor-parallel|rank"):
            e.generate(PROMPTS[1], GREEDY)
        assert e.engine.halt_reason is not None
        for proc in procs:
            proc.wait(timeout=30)
        assert all(p.returncode not in (None, 0) for p in procs), "the worker ran a step in another bucket"
        leaks.excuse(e.engine)  # halted on purpose: the evidence
    finally:
        e.shutdown()
