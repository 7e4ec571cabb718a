"""Speculative decoding changes nothing (invariant 9): in deterministic mode a speculating
engine's output equals a plain engine's, token for token and logprob for logprob, for
greedy, seeded sampling, penalties, logit_bias, top logprobs, stops inside accepted runs,
and prefix hits on what speculating requests cached; with graphs off and emulated.

The drafter is `tests.spec_drafters:Oracle`: the reference output with known wrong
guesses, so every verify path is taken (see that module). The planted-bug tests at the
bottom show the guards go red.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from kernel import Engine
from kernel.config import ConfigError, SpeculativeConfig, load_config
from kernel.request import Request
from kernel.sampling_params import SamplingParams
from kernel.scheduling import step_loop
from kernel.scheduling.scheduler import Scheduler
from kernel.speculative.speculator import Speculator
from tests import leaks
from tests.conftest import GRAPHS_EMULATE, TINY_OVERRIDES, graph_replays
from tests.spec_drafters import WRONG_AT, WRONG_EVERY, Oracle
from tests.structured_cases import MAX_TOKENS, SMALL, TEXT, array, obj

ORACLE = {"speculative.method": "tests.spec_drafters:Oracle", "speculative.num_draft_tokens": 4}
BASE = {"max_new_tokens": 25, "ignore_eos": True, "return_logprob": True}
PARAMS: list[dict[str, Any]] = [
    {**BASE, "temperature": 0, "top_logprobs_num": 3},
    {**BASE, "temperature": 1.5, "top_p": 0.95, "top_k": 500, "seed": 7},
    {**BASE, "temperature": 0.7, "repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.3,
     "seed": 3},
    {**BASE, "temperature": 0, "logit_bias": {"1234": 4.0, "77": -3.0}},
    {**BASE, "temperature": 1.6, "min_p": 0.01, "seed": 5, "top_logprobs_num": 2},
]


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(50, 40000) for _ in range(n)]


PROMPTS = [tokens(i, 7 + 6 * i) for i in range(len(PARAMS))]


def same(out: dict[str, Any], ref: dict[str, Any]) -> None:
    """The guard: what a client reads is the plain engine's, exactly."""
    assert out["output_ids"] == ref["output_ids"], "speculation guard: tokens differ"
    assert out["text"] == ref["text"], "speculation guard: text differs"
    m, r = out["meta_info"], ref["meta_info"]
    assert m.get("output_token_logprobs") == r.get("output_token_logprobs"), "speculation guard: logprobs differ"
    assert m.get("output_top_logprobs") == r.get("output_top_logprobs"), "speculation guard: top logprobs differ"
    for key in ("completion_tokens", "finish_reason", "matched_stop"):
        assert m[key] == r[key], f"speculation guard: {key} {m[key]!r} != {r[key]!r}"


def make(folder: str, drafter: dict[str, Any] = ORACLE, **extra: Any) -> Engine:
    return Engine(None, {"model.path": folder, **TINY_OVERRIDES, "deterministic": True, "cache.prefix": "radix",
                         **drafter, **extra})


def answers(outs: list[dict[str, Any]]) -> None:
    """What the Oracle drafts for PROMPTS (each engine configuration has its own outputs)."""
    for prompt, out in zip(PROMPTS, outs):
        Oracle.answers[tuple(prompt)] = out["output_ids"]


def reference(engine: Engine) -> list[dict[str, Any]]:
    """The plain engine's outputs of PROMPTS, which the Oracle then drafts."""
    outs = engine.generate(PROMPTS, PARAMS)
    assert isinstance(outs, list)
    answers(outs)
    return outs


def all_same(engine: Engine, refs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    outs = engine.generate(PROMPTS, PARAMS)
    assert isinstance(outs, list)
    for out, ref in zip(outs, refs):
        same(out, ref)
    return outs


@pytest.fixture(scope="module")
def refs(tiny_det_engine: Engine) -> list[dict[str, Any]]:
    return reference(tiny_det_engine)


@pytest.fixture(scope="module", params=["off", "emulate"])
def spec(request: pytest.FixtureRequest, tiny_chat_folder: str) -> Iterator[Engine]:
    graphs = GRAPHS_EMULATE if request.param == "emulate" else {"graphs.mode": "off"}
    engine = make(tiny_chat_folder, **graphs)
    yield engine
    engine.shutdown()


def spec_stats(engine: Engine) -> dict[str, Any]:
    stats = engine.engine.stats()["speculative"]
    assert stats is not None
    return stats  # type: ignore[no-any-return]


def test_batch_equals_plain_decoding(spec: Engine, refs: list[dict[str, Any]]) -> None:
    before = spec_stats(spec)["accepted_tokens"], spec_stats(spec)["drafted_tokens"]
    replays = graph_replays(spec)["decode"] if spec.config.graphs.mode == "emulate" else 0
    outs = spec.generate(PROMPTS, PARAMS)
    assert isinstance(outs, list)
    for out, ref in zip(outs, refs):
        same(out, ref)
        assert out["meta_info"]["spec_verify_ct"] > 0, "no verify step ran"
    stats = spec_stats(spec)
    accepted, drafted = stats["accepted_tokens"] - before[0], stats["drafted_tokens"] - before[1]
    assert 0 < accepted < drafted, f"both accepted and rejected drafts expected: {accepted} of {drafted}"
    if spec.config.graphs.mode == "emulate":
        assert graph_replays(spec)["decode"] > replays, "verify steps never replayed a decode bucket"


def test_one_at_a_time_and_opt_out(spec: Engine, refs: list[dict[str, Any]]) -> None:
    """Alone in the batch (verify rows only), and with the per-request opt-out."""
    same(spec.generate(PROMPTS[1], PARAMS[1]), refs[1])  # type: ignore[arg-type]
    out = spec.generate(PROMPTS[0], {**PARAMS[0], "speculative": False})
    same(out, refs[0])  # type: ignore[arg-type]
    assert "spec_verify_ct" not in out["meta_info"]  # type: ignore[index]


def stop_cases(ref: dict[str, Any], tokenizer: Any) -> list[dict[str, Any]]:
    """Stops that land inside verify steps: a stop token, max_tokens, and stop strings
    (each the text of one reference token, so its hit is at a known token)."""
    ids = ref["output_ids"]
    cases: list[dict[str, Any]] = [{"stop_token_ids": [ids[i]]} for i in (5, 9, 12) if ids[i] not in ids[:i]]
    cases += [{"max_new_tokens": n} for n in (6, 11, 17)]
    for i in (4, 8, 10, 13, 16):
        piece = tokenizer.decode(ids[: i + 1])[len(tokenizer.decode(ids[:i])):]
        if piece.strip():
            cases.append({"stop": [piece]})
            # max_tokens just past it: a verify step that ends the request by length after
            # the stop string's token finishes it by the stop string (what plain decoding did).
            cases.append({"stop": [piece], "max_new_tokens": i + 2})
    return cases


def test_stops_inside_accepted_runs(spec: Engine, tiny_det_engine: Engine, refs: list[dict[str, Any]],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    cuts: list[int] = []
    cut = Request.cut_output
    monkeypatch.setattr(Request, "cut_output", lambda self, keep: (cuts.append(keep), cut(self, keep))[1])
    params = {**PARAMS[1], "ignore_eos": False}  # sampled: the tiny model's greedy text repeats one token
    cases = stop_cases(refs[1], spec.tokenizer)
    assert len(cases) >= 6
    for case in cases:
        ref = tiny_det_engine.generate(PROMPTS[1], {**params, **case})
        same(spec.generate(PROMPTS[1], {**params, **case}), ref)  # type: ignore[arg-type]
    assert cuts, "no stop string ended a request inside a verify step's tokens"


def test_prefix_hits_on_speculated_output(spec: Engine, tiny_det_engine: Engine, refs: list[dict[str, Any]]) -> None:
    """A later turn hits the pages a speculating request cached (accepted KV only)."""
    assert spec.flush_cache()
    first = spec.generate(PROMPTS[3], PARAMS[3])
    same(first, refs[3])  # type: ignore[arg-type]
    turn = PROMPTS[3] + refs[3]["output_ids"][:19] + tokens(99, 5)
    warm = spec.generate(turn, PARAMS[0])
    assert warm["meta_info"]["cached_tokens"] > len(PROMPTS[3])  # type: ignore[index]
    same(warm, tiny_det_engine.generate(turn, PARAMS[0]))  # type: ignore[arg-type]


def test_ngram_drafts_what_the_tree_holds(tiny_chat_folder: str, tiny_det_engine: Engine) -> None:
    """A repeated random prompt (no n-gram in it repeats): the second run drafts what the
    first one left in the tree, and nearly every draft is accepted."""
    engine = make(tiny_chat_folder, **{"speculative.method": "ngram"})
    try:
        prompt, params = tokens(42, 21), PARAMS[1]
        ref = tiny_det_engine.generate(prompt, params)
        same(engine.generate(prompt, params), ref)  # type: ignore[arg-type]
        again = engine.generate(prompt, params)
        same(again, ref)  # type: ignore[arg-type]
        meta = again["meta_info"]  # type: ignore[index]
        assert meta["spec_accepted_tokens"] >= 15 and meta["spec_accepted_tokens"] > 0.8 * meta["spec_drafted_tokens"]
    finally:
        engine.shutdown()


def test_grammar_inside_verify_steps(spec: Engine, tiny_det_engine: Engine) -> None:
    """Structured output: each verify row samples under its grammar's mask after the drafts
    before it; drafts the grammar refuses are never verified."""
    schema = json.dumps(obj({"name": TEXT, "age": SMALL, "tags": array(TEXT)}))
    cases = [(tokens(70 + i, 9 + i), {**params, "json_schema": schema, "max_new_tokens": MAX_TOKENS})
             for i, params in enumerate(PARAMS[:3])]
    refs = [tiny_det_engine.generate(prompt, params) for prompt, params in cases]
    for (prompt, _), ref in zip(cases, refs):
        Oracle.answers[tuple(prompt)] = ref["output_ids"]  # type: ignore[index]
    before = spec_stats(spec)["accepted_tokens"]
    for (prompt, params), ref in zip(cases, refs):
        out = spec.generate(prompt, params)
        same(out, ref)  # type: ignore[arg-type]
        json.loads(out["text"])  # type: ignore[index]
    assert spec_stats(spec)["accepted_tokens"] > before


def test_ngram_drafter_exact(tiny_chat_folder: str, tiny_det_engine: Engine) -> None:
    """The built-in drafter on a repetitive prompt: drafts are accepted, output exact."""
    engine = make(tiny_chat_folder, **{"speculative.method": "ngram", "speculative.ngram_min": 1})
    try:
        motif = tokens(5, 6)
        prompt = motif * 5
        params = [PARAMS[0], PARAMS[1]]
        outs = engine.generate([prompt, prompt[3:]], params)
        assert isinstance(outs, list)
        for out, ref in zip(outs, tiny_det_engine.generate([prompt, prompt[3:]], params)):  # type: ignore[arg-type]
            same(out, ref)
        assert spec_stats(engine)["accepted_tokens"] > 0
    finally:
        engine.shutdown()


# ---- the drafter and the adaptive rule, alone ---------------------------------------
_rids = itertools.count()


def request(prompt: list[int], output: list[int] = (), **params: Any) -> Request:  # type: ignore[assignment]
    req = Request(f"r{next(_rids)}", list(prompt), SamplingParams(**params), seed=0)
    req.output_ids = list(output)
    return req


def test_ngram_proposes_the_latest_continuation() -> None:
    from handlers.drafter_ngram import NgramDrafter

    drafter = NgramDrafter(ngram_min=1, ngram_max=3)
    req = request([1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 6, 1, 2, 3])
    assert drafter.propose(req, 2) == [5, 6]  # the latest (1, 2, 3), not the first
    req.output_ids = [5, 6]
    assert drafter.propose(req, 3) == [1, 2, 3]  # (3, 5, 6) was followed by 1, 2, 3; index grew
    req.output_ids = [5, 6, 7]
    assert drafter.propose(req, 3) == []  # 7 is new
    assert drafter.propose(request([1, 2, 3]), 4) == []  # never seen before
    assert drafter.propose(request([8, 8, 8, 8]), 5) == [8] * 5  # a period continues past the end
    assert drafter.propose(request([4, 5, 4, 5, 4]), 5) == [5, 4, 5, 4, 5]


def test_tree_continuation_is_read_only() -> None:
    from cache.allocator import PageAllocator
    from cache.radix_tree import RadixTree
    from handlers.evict_lru import LRU

    alloc = PageAllocator(64)
    tree = RadixTree(4, alloc.free, LRU())
    a = list(range(100, 124))  # 6 pages
    b = a[:10] + list(range(500, 514))  # branches inside page 3
    for seq in (a, b):
        tree.insert(seq, alloc.allocate(len(seq) // 4))
    nodes = tree.num_nodes
    assert tree.continuation(a[:5], None, 3) == a[5:8]  # a partial page, into the run
    assert tree.continuation(a[:13], None, 20) == a[13:]  # past its node's end: only what is cached
    assert tree.continuation(b[:11], None, 4) == b[11:15]  # the branch it is on
    assert tree.continuation(a[:8], None, 4) == b[8:12]  # a branch point: the child touched last
    assert tree.continuation(a[:6] + [1], None, 4) == []  # off the tree
    assert tree.continuation(a[:6], "other", 4) == []  # another namespace
    assert tree.num_nodes == nodes  # nothing split


def test_adaptive_rule_rests_a_request_and_max_batch() -> None:
    config = SpeculativeConfig(method="ngram", ngram_min=1, window=4, min_acceptance=0.5, cooldown=3, max_batch=2,
                               num_draft_tokens=8)
    spec = Speculator(config)
    req = request([7, 8] * 10)
    spec.begin_step(1)

    def draft(r: object, limit: int) -> tuple[int, ...]:
        return spec.draft(r, limit, 1 << 20).tokens  # type: ignore[arg-type]

    assert len(draft(req, 16)) == 4  # the first length: min(4, num_draft_tokens)
    spec.record(req, 4, 4)
    assert len(draft(req, 16)) == 8  # doubles after full acceptance, up to num_draft_tokens
    assert len(draft(req, 5)) == 5  # never past the caller's limit
    assert len(spec.draft(req, 16, 3).tokens) == 3  # nor past the step's token budget
    for _ in range(4):
        spec.record(req, 4, 1)  # 25 % accepted: the length halves each time, then it rests
    assert spec.counters.paused_requests == 1
    assert [draft(req, 4) for _ in range(3)] == [()] * 3
    assert len(draft(req, 4)) == 1  # back after the cooldown, at the halved length
    # Quiet steps (a decode run may take them): this one alone after a step that could draft,
    # this one and the rest of a rest; a run counts against the rest.
    assert spec.quiet_steps(req) == 1
    for _ in range(4):
        spec.record(req, 4, 0)
    assert draft(req, 4) == () and spec.quiet_steps(req) == 3  # resting: this step and 2 more
    spec.rest(req, 1)  # a run of 2 took this step and the next
    assert spec.quiet_steps(req) == 2 and draft(req, 4) == () and len(draft(req, 4)) == 1
    spec.begin_step(3)  # more decodes than max_batch: nobody drafts
    assert draft(req, 4) == () and spec.counters.skipped_batches == 1
    assert spec.quiet_steps(req) >= 1 << 20  # for as long as the batch stays over max_batch
    spec.row_limit = 5
    spec.begin_step(2)  # 3 draft rows left under the graph buckets
    other = request([7, 8] * 10)
    assert len(draft(other, 8)) == 3 and draft(request([7, 8] * 10), 4) == ()


def test_config_errors() -> None:
    for overrides, words in (
        ({"speculative.method": "nope"}, "unknown drafter"),
        ({"speculative.method": "ngram", "speculative.topk": 9}, "topk"),
        ({"speculative.method": "ngram", "scheduler.overlap": "on"}, "overlap"),
        ({"speculative.method": "ngram", "speculative.ngram_min": 5}, "ngram_max"),
        ({"speculative.method": "draft"}, "draft_model is set exactly"),
        ({"speculative.method": "ngram", "speculative.draft_model": "x"}, "draft_model is set exactly"),
    ):
        with pytest.raises(ConfigError, match=words):
            load_config(None, overrides)


# ---- planted bugs: the guards go red ------------------------------------------------
@pytest.fixture
def fresh(tiny_chat_folder: str, refs: list[dict[str, Any]]) -> Iterator[Engine]:
    engine = make(tiny_chat_folder, **{"debug.check_invariants": False})
    yield engine
    leaks.excuse(engine.engine)
    engine.shutdown()


def test_planted_draw_of_the_first_row_red(fresh: Engine, refs: list[dict[str, Any]],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every verify row drawing with the decode's own step: seeded sampling diverges."""
    monkeypatch.setattr(step_loop, "verify_row", lambda row, req, accepted: row)
    with pytest.raises(AssertionError, match="speculation guard"):
        same(fresh.generate(PROMPTS[1], PARAMS[1]), refs[1])  # type: ignore[arg-type]


def test_planted_token_past_a_stop_string_red(fresh: Engine, tiny_det_engine: Engine, refs: list[dict[str, Any]],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokens after a stop string's token kept: the guard sees them."""
    monkeypatch.setattr(Request, "cut_output", lambda self, keep: None)
    params = {**PARAMS[1], "ignore_eos": False}
    failures = 0
    for case in stop_cases(refs[1], fresh.tokenizer):
        if "stop" not in case:
            continue
        try:
            same(fresh.generate(PROMPTS[1], {**params, **case}),
                 tiny_det_engine.generate(PROMPTS[1], {**params, **case}))  # type: ignore[arg-type]
        except AssertionError as exc:
            assert "speculation guard" in str(exc)
            failures += 1
    assert failures, "no stop-string case went red with the cut removed"


def test_planted_rejected_kv_cached_red(fresh: Engine, tiny_det_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that finished in a verify step counts every row it computed as valid KV
    ("it is done anyway"): the rejected draft's KV under the stop token reaches the tree,
    and a later turn that hits that page diverges from a cold run."""
    release_landed = Scheduler._release_landed

    def buggy(self: Scheduler, req: Request) -> None:
        if req.spec_steps:  # the row after the last accepted token counted as computed
            req.kv_len = min(req.kv_len + 1, req.total_len)
        release_landed(self, req)

    prompt, m = planted_case(tiny_det_engine)
    params = {**PARAMS[1], "max_new_tokens": 40}
    out = tiny_det_engine.generate(prompt, params)
    Oracle.answers[tuple(prompt)] = out["output_ids"]  # type: ignore[index]
    stop = {**params, "stop_token_ids": [out["output_ids"][m]]}  # type: ignore[index]
    turn = prompt + out["output_ids"][: m + 1] + tokens(98, 3)  # type: ignore[index]
    cold = tiny_det_engine.generate(turn, PARAMS[0])
    for planted in (False, True):
        if planted:
            monkeypatch.setattr(Scheduler, "_release_landed", buggy)
        assert fresh.flush_cache()
        fresh.generate(prompt, stop)
        warm = fresh.generate(turn, PARAMS[0])
        assert warm["meta_info"]["cached_tokens"] >= len(prompt)  # type: ignore[index]
        if not planted:
            same(warm, cold)  # type: ignore[arg-type]
        else:
            with pytest.raises(AssertionError, match="speculation guard"):
                same(warm, cold)  # type: ignore[arg-type]


def planted_case(engine: Engine) -> tuple[list[int], int]:
    """A prompt and an output index m where the Oracle's draft is wrong (m % WRONG_EVERY ==
    WRONG_AT), its token is new (a stop token there stops there), and position
    len(prompt) + m is a page's last slot (a page the bug makes whole)."""
    page = TINY_OVERRIDES["cache.page_size"]
    for seed in range(200, 260):
        prompt = tokens(seed, 9 + seed % 7)
        ids = engine.generate(prompt, {**PARAMS[1], "max_new_tokens": 40})["output_ids"]  # type: ignore[index]
        for m in range(WRONG_AT, 38, WRONG_EVERY):
            if m > WRONG_AT and (len(prompt) + m + 1) % page == 0 and ids[m] not in ids[:m]:
                return prompt, m
    raise AssertionError("no prompt with a usable stop position")


@pytest.mark.parametrize("planted", [False, True], ids=["reset", "no-reset"])
def test_planted_stale_verify_rows_after_a_smaller_replay_red(
    tiny_chat_folder: str, refs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, planted: bool
) -> None:
    """Verify steps replay one decode bucket of 16 rows with fewer live rows each time
    (the drafts stop at the bucket): without the registry's tail reset a smaller replay
    keeps a larger one's rows, whose KV writes land in live requests' slots."""
    from gpu.graphs.static_buffers import StaticBuffers

    engine = make(tiny_chat_folder, **{**GRAPHS_EMULATE, "graphs.decode_buckets": [16], "debug.check_invariants": False})
    if planted:  # after the warm-up replays, which start from clean buffers
        monkeypatch.setattr(StaticBuffers, "reset_tail", lambda self, name, live, rows: None)
    try:
        outs = engine.generate(PROMPTS, PARAMS)
        assert isinstance(outs, list)
        assert graph_replays(engine)["decode"] > 0
        if not planted:
            for out, ref in zip(outs, refs):
                same(out, ref)
            return
        with pytest.raises(AssertionError, match="speculation guard"):
            for out, ref in zip(outs, refs):
                same(out, ref)
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()
