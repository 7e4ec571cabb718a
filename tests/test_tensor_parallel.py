"""Tensor parallelism end to end (kernel/parallel/): rank 0 in the engine, the other ranks
as the worker processes it starts over gloo. Greedy tokens equal tp_size 1's and logprobs
within 1e-4 (float32) on tiny random Llama / Qwen2 / Qwen3 checkpoints (heads that divide,
KV heads replicated) and the packaged SmolLM2 at tp_size 3 (9 heads over 3 KV heads); in
deterministic mode a cache hit `==` a cold run; a killed worker halts the engine with an
error to every request and leaves no process behind; what does not split is refused."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kernel import Engine
from kernel.config import ConfigError
from kernel.parallel import workers as workers_mod
from tests import leaks
from tests.conftest import FLOAT32, SMOLLM
from tests.tiny_hybrid import (
    build_tiny_lfm2,
    build_tiny_lfm2_moe,
    build_tiny_qwen3_5,
    build_tiny_qwen3_5_moe,
    build_tiny_qwen3_next,
)
from tests.tiny_models import build_tiny, build_tiny_llama

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "return_logprob": True}
# Ids below 384: the tiny hybrids' vocabulary.
PROMPTS = [[5, 17, 99, 3, 250, 41, 77, 8, 300, 12, 64, 7, 9, 31, 200, 11, 4, 6] * 3,
           [33, 2, 380, 18, 90, 91, 92, 5], [7] * 40]
BASE = {**FLOAT32, "model.cpu_kernels": "off", "cache.num_pages": 64, "debug.check_invariants": True}


def engine(path: str, tp: int, **extra: Any) -> Engine:
    return Engine(None, {"model.path": path, **BASE, "parallel.tp_size": tp, **extra})


def outputs(e: Engine, prompts: list[Any], params: Any) -> list[dict[str, Any]]:
    """The engine's outputs of `prompts`, then the engine shut down."""
    try:
        out = e.generate(prompts, params)
        assert isinstance(out, list)
        return out
    finally:
        e.shutdown()


def run(path: str, tp: int, prompts: list[Any], **extra: Any) -> list[dict[str, Any]]:
    return outputs(engine(path, tp, **extra), prompts, GREEDY)


def assert_same(ref: list[dict[str, Any]], got: list[dict[str, Any]], tol: float = 1e-4) -> None:
    for r, g in zip(ref, got):
        assert g["output_ids"] == r["output_ids"]
        want = [lp for lp, _ in r["meta_info"]["output_token_logprobs"]]
        have = [lp for lp, _ in g["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(want, have)) < tol


THREE_WAYS = {"hidden_size": 96, "intermediate_size": 96, "num_attention_heads": 6, "num_key_value_heads": 1}
CASES = {
    "llama-heads-divide": (lambda f: build_tiny_llama(f, 6, 2), 2),
    "llama-kv-replicated": (lambda f: build_tiny_llama(f, 6, 1), 3),
    "llama-biases": (lambda f: build_tiny_llama(f, 6, 3, biases=True), 3),
    "qwen2": (lambda f: build_tiny("qwen2", f), 2),
    "qwen3": (lambda f: build_tiny("qwen3", f), 2),
    "qwen3_5-gated-deltanet": (lambda f: build_tiny_qwen3_5(f), 2),
    "lfm2-short-conv": (lambda f: build_tiny_lfm2(f), 2),
    # Three ranks, one KV head replicated on each (6 query heads, 96 channels).
    "qwen3-tp3-kv-replicated": (lambda f: build_tiny("qwen3", f, shape=THREE_WAYS), 3),
    "qwen3_5-tp3-kv-replicated": (lambda f: build_tiny_qwen3_5(f, shape={
        **THREE_WAYS, "linear_num_key_heads": 3, "linear_num_value_heads": 6}), 3),
    "lfm2-tp3-kv-replicated": (lambda f: build_tiny_lfm2(f, shape={**THREE_WAYS, "block_auto_adjust_ff_dim": False}), 3),
    # Mixture of experts: experts and shared experts split along their intermediate width.
    "qwen3_moe": (lambda f: build_tiny("qwen3_moe", f), 2),
    "qwen3_next": (lambda f: build_tiny_qwen3_next(f), 2),
    "qwen3_5_moe": (lambda f: build_tiny_qwen3_5_moe(f), 2),
    "lfm2_moe": (lambda f: build_tiny_lfm2_moe(f), 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_models_match_tp1(case: str, tmp_path: Path) -> None:
    build, tp = CASES[case]
    path = str(build(tmp_path))
    assert_same(run(path, 1, PROMPTS), run(path, tp, PROMPTS))


def test_smollm_tp3_matches_tp1() -> None:
    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    assert_same(run(SMOLLM, 1, prompts), run(SMOLLM, 3, prompts))


def test_deterministic_hit_equals_cold_at_tp2(tmp_path: Path) -> None:
    path = str(build_tiny_llama(tmp_path, 6, 2))
    shared = list(range(10, 74))  # four whole pages
    first, second = shared + [5, 6, 7], shared + [8, 9]
    cold = run(path, 2, [second], deterministic=True)[0]
    e = engine(path, 2, deterministic=True)
    try:
        e.generate(first, GREEDY)
        warm = e.generate([second, [3, 4, 5]], GREEDY)[0]  # type: ignore[index]
    finally:
        e.shutdown()
    assert warm["meta_info"]["cached_tokens"] == 64
    assert warm["output_ids"] == cold["output_ids"]
    assert warm["meta_info"]["output_token_logprobs"] == cold["meta_info"]["output_token_logprobs"]


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_hybrid_deterministic_hit_equals_cold_at_tp2(strategy: str, tmp_path: Path) -> None:
    path = str(build_tiny_qwen3_5(tmp_path))
    shared = [(7 * i) % 300 + 3 for i in range(128)]  # two state checkpoints (64 tokens each)
    first, second = shared + [5, 6, 7], shared + [8, 9]
    extra = {"deterministic": True, "cache.state_strategy": strategy}
    cold = run(path, 2, [second], **extra)[0]
    e = engine(path, 2, **extra)
    try:
        e.generate(first, GREEDY)
        warm = e.generate([second, [3, 4, 5]], GREEDY)[0]  # type: ignore[index]
    finally:
        e.shutdown()
    assert warm["meta_info"]["cached_tokens"] >= 64
    assert warm["output_ids"] == cold["output_ids"]
    assert warm["meta_info"]["output_token_logprobs"] == cold["meta_info"]["output_token_logprobs"]


def _max_gap(ref: list[dict[str, Any]], got: list[dict[str, Any]]) -> float:
    return max(abs(a - b) for r, g in zip(ref, got) for (a, _), (b, _) in
               zip(r["meta_info"]["output_token_logprobs"], g["meta_info"]["output_token_logprobs"]))


def test_planted_worker_state_slots_differing_from_rank0_go_red(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers write each request's state into another request's slot (the batch's
    destination slots reversed there, not on rank 0): red."""
    path = str(build_tiny_lfm2(tmp_path))
    ref = run(path, 1, PROMPTS[:2])
    real = workers_mod.for_workers

    def swapped_slots(batch: Any) -> Any:
        out = real(batch)
        return dataclasses.replace(out, state_dst=out.state_dst[::-1])

    monkeypatch.setattr(workers_mod, "for_workers", swapped_slots)
    assert _max_gap(ref, run(path, 2, PROMPTS[:2])) > 1e-3


def test_planted_wrong_kv_slots_on_the_workers_go_red(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers' request table one slot off rank 0's (a stale or wrong page): red."""
    path = str(build_tiny_llama(tmp_path, 6, 2))
    ref = run(path, 1, PROMPTS)
    real = workers_mod.table_rows

    def shifted(table: Any, batch: Any) -> Any:
        rows, lens, flat = real(table, batch)
        return rows, lens, flat + 1

    monkeypatch.setattr(workers_mod, "table_rows", shifted)
    assert _max_gap(ref, run(path, 2, PROMPTS)) > 1e-3


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_killed_worker_halts_the_engine_and_leaves_no_process(tmp_path: Path) -> None:
    path = str(build_tiny_llama(tmp_path, 6, 1, positions=8192))
    e = engine(path, 3, **{"cache.num_pages": 600})
    procs = e.engine.parts.runner.workers.procs  # type: ignore[attr-defined]
    errors: list[BaseException] = []

    def long_request() -> None:
        try:
            e.generate([5, 6, 7], {"max_new_tokens": 8000, "temperature": 0, "ignore_eos": True})
        except BaseException as exc:  # noqa: BLE001 - what the client sees
            errors.append(exc)

    client = threading.Thread(target=long_request)
    client.start()
    time.sleep(1.0)  # generating
    os.kill(procs[0].pid, signal.SIGKILL)
    client.join(timeout=60)
    assert not client.is_alive(), "the request hung after its worker died"
    assert errors, "the request finished although a rank died"
    assert "rank" in str(errors[0]) or "tensor-parallel" in str(errors[0]), errors[0]
    assert e.engine.halt_reason is not None
    leaks.excuse(e.engine)  # halted on purpose: the evidence
    deadline = time.monotonic() + 30
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(not _alive(p.pid) for p in procs), "a worker outlived the halted engine (or is a zombie)"
    e.shutdown()


@pytest.mark.parametrize("planted", [False, True], ids=["one stop at a time", "planted: stops at once"])
def test_two_stops_at_once_stop_the_workers_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 planted: bool) -> None:
    """An engine that halts starts stopping its workers, and its shutdown stops them again,
    each from its own thread: the second waits for the first, and the workers stop cleanly.
    Planted: without the lock both stops send "stop" and meet at different collectives, which
    fail (the suite once waited out `parallel.timeout_s` there) and the workers are killed."""
    e = engine(str(build_tiny_llama(tmp_path, 6, 2)), 2, **{"parallel.timeout_s": 3})
    workers = e.engine.parts.runner.workers  # type: ignore[attr-defined]
    if planted:
        monkeypatch.setattr(workers, "_stopping", contextlib.nullcontext())
    kills: list[int] = []
    kill = workers.kill
    monkeypatch.setattr(workers, "kill", lambda: (kills.append(1), kill()))
    meet, send = threading.Barrier(2), workers_mod.group.send

    def together(message: object) -> None:  # both stops reach their send at once, where they can
        with contextlib.suppress(threading.BrokenBarrierError):
            meet.wait(timeout=1)
        send(message)

    monkeypatch.setattr(workers_mod.group, "send", together)
    stops = [threading.Thread(target=workers.stop) for _ in range(2)]
    for t in stops:
        t.start()
    for t in stops:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in stops)
    codes = [p.wait(timeout=30) for p in workers.procs]
    e.shutdown()
    if planted:
        assert kills, "two stops at once went through cleanly: the guard cannot tell"
    else:
        assert not kills and codes == [0], (kills, codes)


def test_refused_at_start_without_leftover_workers(tmp_path: Path) -> None:
    """A split that does not divide (before any worker starts) and a mode that has no
    collectives (after they started: they are stopped)."""
    with pytest.raises(ConfigError, match="9 attention heads do not split over 2"):
        engine(SMOLLM, 2)
    with pytest.raises(ConfigError, match="graphs.mode: cpu"):  # the native step has no collectives
        engine(SMOLLM, 3, **{"graphs.mode": "cpu"})
    children = [p for p in os.listdir("/proc") if p.isdigit() and _child_of_us(int(p))]
    assert children == []


def _child_of_us(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().split(")")[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return int(fields[1]) == os.getpid() and "kernel.parallel.worker" in _cmdline(pid)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


SAMPLED = {"max_new_tokens": 12, "temperature": 1.1, "top_p": 0.9, "seed": 3, "ignore_eos": True,
           "return_logprob": True}


def test_overlap_scheduling_at_tp2_equals_serial(tmp_path: Path) -> None:
    """scheduler.overlap on: step N+1 is sent with placeholders before N's tokens are on the
    host; every rank resolves them from the tokens rank 0 broadcasts. Deterministic: `==`."""
    path = str(build_tiny_llama(tmp_path, 6, 2))
    params = [GREEDY, SAMPLED, GREEDY]
    outs = {}
    for overlap in ("off", "on"):
        e = engine(path, 2, deterministic=True, **{"scheduler.overlap": overlap})
        try:
            assert e.engine.parts.overlap == (overlap == "on")  # type: ignore[attr-defined]
            outs[overlap] = e.generate(PROMPTS, params)
        finally:
            e.shutdown()
    for on, off in zip(outs["on"], outs["off"]):
        assert on["output_ids"] == off["output_ids"]
        assert on["meta_info"]["output_token_logprobs"] == off["meta_info"]["output_token_logprobs"]


def test_planted_worker_ignoring_the_broadcast_tokens_goes_red(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 broadcasts a token off by one (the workers' placeholders resolve to another
    token than rank 0's): red."""
    path = str(build_tiny_llama(tmp_path, 6, 2))
    ref = run(path, 2, PROMPTS, deterministic=True, **{"scheduler.overlap": "on"})
    real = workers_mod.dist.broadcast

    def shifted(tensor: Any, src: int = 0, **kw: Any) -> Any:
        return real(tensor + 1, src=src, **kw)

    monkeypatch.setattr(workers_mod.dist, "broadcast", shifted)
    assert _max_gap(ref, run(path, 2, PROMPTS, deterministic=True, **{"scheduler.overlap": "on"})) > 1e-3
