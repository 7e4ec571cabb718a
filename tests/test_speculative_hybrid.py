"""Speculative decoding on hybrid models (Qwen3.5's Gated DeltaNet, LFM2's short conv), in
deterministic mode: the verify step is one chunk whose every position's state goes to a
slot of its own, and the request resumes from the state after its last accepted token —
so a speculating engine's output equals a plain engine's, token for token and logprob for
logprob, for every state strategy, graphs off and emulated, chains and token trees (each
side branch a chunk of its own from the request's state, on a scratch table row), and a
later turn that hits a checkpoint a verify step cached (a grid point inside an accepted
run) equals a cold run. The planted rollback one position off, and a tree resuming from the
main chain where its path left it, go red.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kernel import Engine
from kernel.request import Request
from kernel.states.hybrid_state import HybridState
from tests import leaks
from tests.conftest import GRAPHS_EMULATE, HYBRID_OVERRIDES, graph_replays
from tests.spec_drafters import Oracle, motif_prompt
from tests.test_speculative import ORACLE, same, spec_stats
from tests.test_speculative_tree import TREE, side
from tests.tiny_hybrid import VOCAB

INTERVAL = HYBRID_OVERRIDES["cache.state_track_interval"]
BASE = {"max_new_tokens": 3 * INTERVAL + 5, "ignore_eos": True, "return_logprob": True}
PARAMS: list[dict[str, Any]] = [
    {**BASE, "temperature": 0, "top_logprobs_num": 2},
    {**BASE, "temperature": 1.3, "top_p": 0.95, "seed": 7},
]
STRATEGIES = ("no_buffer", "extra_buffer", "extra_buffer_lazy")


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


PROMPTS = [tokens(1, 2 * INTERVAL + 3), tokens(2, INTERVAL - 2)]


def make(folder: str, strategy: str, **extra: Any) -> Engine:
    return Engine(None, {**HYBRID_OVERRIDES, "model.path": folder, "deterministic": True,
                         "cache.state_strategy": strategy, **extra})


def plain(folder: str) -> Engine:
    """The reference: a plain deterministic engine (no prefix cache, no speculation)."""
    return make(folder, "extra_buffer", **{"cache.prefix": "none"})


def reference(ref: Engine, prompt: list[int], params: dict[str, Any]) -> dict[str, Any]:
    out = ref.generate(prompt, params)
    assert isinstance(out, dict)
    Oracle.answers[tuple(prompt)] = out["output_ids"]
    return out


def run_prompts(engine: Engine, ref: Engine) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """PROMPTS through `engine`, and the reference's outputs (which the Oracles draft)."""
    refs = [reference(ref, p, q) for p, q in zip(PROMPTS, PARAMS)]
    outs = engine.generate(PROMPTS, PARAMS)
    assert isinstance(outs, list)
    return outs, refs


def assert_red(outs: list[dict[str, Any]], refs: list[dict[str, Any]]) -> None:
    with pytest.raises(AssertionError, match="speculation guard"):
        for out, r in zip(outs, refs):
            same(out, r)


@pytest.mark.parametrize("topk", [1, 3])
@pytest.mark.parametrize("graphs", ["off", "emulate"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_verify_steps_equal_plain_decoding(hybrid_ref: tuple[str, Engine], strategy: str, graphs: str, topk: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """topk 3: token trees (TreeOracle: the right tokens on side branches where the main
    chain is wrong), each side branch a chunk of its own from the request's state."""
    folder, ref = hybrid_ref
    offered: list[tuple[int, bool]] = []
    land = HybridState.land_verify

    def spy(self: HybridState, req: Request, offer: Any, *side: Any) -> None:
        land(self, req, lambda slot, length: offered.append((length, donated := offer(slot, length))) or donated,
             *side)

    monkeypatch.setattr(HybridState, "land_verify", spy)
    extra = GRAPHS_EMULATE if graphs == "emulate" else {"graphs.mode": "off"}
    engine = make(folder, strategy, **(ORACLE if topk == 1 else TREE), **extra)
    try:
        refs = [reference(ref, p, q) for p, q in zip(PROMPTS, PARAMS)]
        outs = engine.generate(PROMPTS, PARAMS)
        assert isinstance(outs, list)
        for out, r in zip(outs, refs):
            same(out, r)
            meta = out["meta_info"]
            assert 0 < meta["spec_accepted_tokens"] < meta["spec_drafted_tokens"]
        if topk > 1:
            drafted, accepted = side(engine)
            assert 0 < accepted < drafted, f"side nodes both accepted and rejected expected: {accepted} of {drafted}"
        assert any(donated for _, donated in offered), "no verify step cached a grid point"
        if graphs == "emulate":  # the verify steps ran in verify buckets' static buffers
            assert graph_replays(engine)["verify"] > 0
        # A later turn resumes from a checkpoint inside the speculated output.
        turn = PROMPTS[0] + refs[0]["output_ids"][: 2 * INTERVAL + 1] + tokens(9, 3)
        warm = engine.generate(turn, PARAMS[0])
        assert warm["meta_info"]["cached_tokens"] > len(PROMPTS[0])  # type: ignore[index]
        same(warm, ref.generate(turn, PARAMS[0]))  # type: ignore[arg-type]
    finally:
        engine.shutdown()


def test_planted_rollback_one_position_off_red(hybrid_ref: tuple[str, Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    """The request resumes from the state one position past its last accepted token (the
    first rejected draft's): the guard sees the difference."""
    folder, ref = hybrid_ref
    land = HybridState.land_verify

    def off_by_one(self: HybridState, req: Request, offer: Any, *side: Any) -> None:
        req.kv_len += 1
        try:
            land(self, req, offer, *side)
        finally:
            req.kv_len -= 1

    engine = make(folder, "extra_buffer", **ORACLE, **{"debug.check_invariants": False})
    try:
        r = reference(ref, PROMPTS[0], PARAMS[0])
        same(engine.generate(PROMPTS[0], PARAMS[0]), r)  # type: ignore[arg-type]
        monkeypatch.setattr(HybridState, "land_verify", off_by_one)
        assert engine.flush_cache()
        with pytest.raises(AssertionError, match="speculation guard"):
            same(engine.generate(PROMPTS[0], PARAMS[0]), r)  # type: ignore[arg-type]
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()


def test_planted_tree_resumes_from_the_main_chain_red(hybrid_ref: tuple[str, Engine],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A token tree whose accepted path ran through side nodes resumes from the main
    chain's state at that length (the rejected main tokens' state), as if the side
    branch's states were never taken: the guard sees the difference."""
    folder, ref = hybrid_ref
    land = HybridState.land_verify

    def main_only(self: HybridState, req: Request, offer: Any, *side: Any) -> None:
        land(self, req, offer)

    monkeypatch.setattr(HybridState, "land_verify", main_only)
    engine = make(folder, "extra_buffer", **TREE, **{"debug.check_invariants": False})
    try:
        outs, refs = run_prompts(engine, ref)
        assert side(engine)[1] > 0, "no side node accepted: the planted bug was never reached"
        assert_red(outs, refs)
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()


@pytest.mark.parametrize("topk", [1, 3])
def test_ngram_drafts_exact(hybrid_ref: tuple[str, Engine], topk: int) -> None:
    """The built-in n-gram drafter on a prompt whose n-grams were followed by several
    tokens (side branches with topk 3), a prefix hit on the second request."""
    folder, ref = hybrid_ref
    engine = make(folder, "no_buffer", **{"speculative.method": "ngram", "speculative.ngram_min": 1,
                                          "speculative.num_draft_tokens": 4, "speculative.topk": topk})
    try:
        prompt = motif_prompt(tokens(6, 5))
        for params in PARAMS:
            out = engine.generate(prompt, params)
            same(out, ref.generate(prompt, params))  # type: ignore[arg-type]
        drafted, _ = side(engine)
        assert spec_stats(engine)["drafted_tokens"] > 0 and (drafted > 0) == (topk > 1)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("planted", [False, True], ids=["reset", "no-reset"])
def test_planted_stale_verify_rows_after_a_smaller_replay_red(hybrid_ref: tuple[str, Engine],
                                                             monkeypatch: pytest.MonkeyPatch, planted: bool) -> None:
    """Verify steps replay one verify bucket with fewer live tokens each time: without the
    registry's tail reset a smaller replay keeps a larger one's rows (their KV slots,
    state slots and tracked slots), whose writes land in live requests' KV and states."""
    from gpu.graphs.static_buffers import StaticBuffers

    folder, ref = hybrid_ref
    engine = make(folder, "extra_buffer", **ORACLE, **{**GRAPHS_EMULATE, "graphs.decode_buckets": [4],
                                                       "debug.check_invariants": False})
    verify = engine.engine.parts.runner.graphs.buffers["verify"]  # type: ignore[union-attr]
    reset = StaticBuffers.reset_tail

    def verify_never_reset(self: StaticBuffers, name: str, live: int, rows: int) -> None:
        if self is not verify:
            reset(self, name, live, rows)

    if planted:  # the verify buckets' only, after the warm-up replays (which start from clean buffers)
        monkeypatch.setattr(StaticBuffers, "reset_tail", verify_never_reset)
    try:
        outs, refs = run_prompts(engine, ref)
        assert graph_replays(engine)["verify"] > 0
        if planted:
            assert_red(outs, refs)
        for out, r in zip(outs, refs) if not planted else ():
            same(out, r)
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()


@pytest.mark.parametrize("topk", [1, 3])
def test_retraction_prompt_logprobs_and_n(hybrid_ref: tuple[str, Engine], topk: int) -> None:
    """Requests retracted while speculating (their state slots and verify slots back, then
    recomputed), prompt logprobs in the same batch as verify steps, and `n` > 1 samples:
    the plain engine's output."""
    folder, ref = hybrid_ref
    prompts = [tokens(30 + i, 10 + i) for i in range(6)]
    params = [{**PARAMS[0], "max_new_tokens": 30, **({"logprob_start_len": 0} if i == 0 else {})} for i in range(6)]
    refs = [reference(ref, p, q) for p, q in zip(prompts, params)]
    # 24 usable pages of 4 tokens = 96 tokens for 6 requests that grow to ~42 tokens each.
    engine = make(folder, "extra_buffer", **(ORACLE if topk == 1 else TREE), **{"cache.num_pages": 25})
    try:
        outs = engine.generate(prompts, params)
        assert isinstance(outs, list)
        assert engine.engine.scheduler.num_retractions > 0
        for out, r in zip(outs, refs):
            same(out, r)
        assert outs[0]["meta_info"]["input_token_logprobs"] == refs[0]["meta_info"]["input_token_logprobs"]
        assert sum(out["meta_info"].get("spec_verify_ct", 0) for out in outs) > 0
        # n = 3 as the HTTP layer sends it (plugins/http/sampling.py): sample j seeded seed + j.
        samples = [{**PARAMS[1], "seed": PARAMS[1]["seed"] + j} for j in range(3)]
        want = [reference(ref, PROMPTS[1], q) for q in samples[:1]] + ref.generate([PROMPTS[1]] * 2, samples[1:])
        many = engine.generate([PROMPTS[1]] * 3, samples)
        assert isinstance(many, list) and len({tuple(o["output_ids"]) for o in many}) > 1
        for out, r in zip(many, want):
            same(out, r)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("topk", [1, 3])
def test_verify_buckets_torch_form(hybrid_ref: tuple[str, Engine], topk: int,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the C++ kernels a verify bucket's state layers run the torch static form
    (every request slot `static_steps` batched recurrent steps, the lengths read from a
    buffer): what a captured CUDA graph runs. Against a plain engine without them too.
    The host-side lengths of each verify step are replaced by ones (what a graph captured
    with other lengths would hold): the output stays exact, so the forward never reads them."""
    import dataclasses

    from gpu.graphs.runner import GraphRunner

    stage = GraphRunner._stage

    def frozen_lengths(self: GraphRunner, graph: Any, batch: Any) -> Any:
        step = stage(self, graph, batch)
        if step is not None and step.static_lens is not None:
            step = dataclasses.replace(step, extend_lens=(1,) * len(step.extend_lens))
        return step

    monkeypatch.setattr(GraphRunner, "_stage", frozen_lengths)
    folder, _ = hybrid_ref
    off = {"model.cpu_kernels": "off"}
    ref = make(folder, "extra_buffer", **{"cache.prefix": "none", **off})
    engine = make(folder, "extra_buffer", **(ORACLE if topk == 1 else TREE), **GRAPHS_EMULATE, **off)
    try:
        outs, refs = run_prompts(engine, ref)
        for out, r in zip(outs, refs):
            same(out, r)
        assert graph_replays(engine)["verify"] > 0
        assert not getattr(engine.engine.parts.runner.model, "native_recurrence", False)
    finally:
        engine.shutdown()
        ref.shutdown()
