"""Token trees (`speculative.topk` > 1) change nothing either: in deterministic mode a
speculating engine's output equals a plain engine's, token for token and logprob for
logprob, whether drafts are accepted on the main chain or off it (side nodes run on
scratch table rows and slots; an accepted side path's KV is moved to the request's own
slots before anything reads it). Drafters: `tests.spec_drafters:TreeOracle` (right tokens
on side branches where the main chain is wrong), `ngram` (other continuations of the same
n-gram) and a draft model (its next-best tokens). The planted bugs at the bottom go red.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gpu.kernels import cpu
from gpu.model_runner import ModelRunner
from kernel import Engine
from kernel.scheduling import step_loop
from kernel.speculative.tree import DraftTree, legal_tree, walk
from tests import leaks
from tests.conftest import GRAPHS_EMULATE, TINY_OVERRIDES
from tests.spec_drafters import motif_prompt
from tests.test_speculative import (
    PARAMS,
    PROMPTS,
    all_same,
    answers,
    reference,
    request,
    same,
    spec_stats,
    tokens,
)
from tests.test_speculative import make as make_spec

TREE = {"speculative.method": "tests.spec_drafters:TreeOracle", "speculative.num_draft_tokens": 4,
        "speculative.topk": 3}


def make(folder: str, **extra: Any) -> Engine:
    return make_spec(folder, TREE, **extra)


@pytest.fixture(scope="module")
def refs(tiny_det_engine: Engine) -> list[dict[str, Any]]:
    return reference(tiny_det_engine)


@pytest.fixture(scope="module", params=["off", "emulate"])
def spec(request: pytest.FixtureRequest, tiny_chat_folder: str, refs: list[dict[str, Any]]) -> Iterator[Engine]:
    answers(refs)
    graphs = GRAPHS_EMULATE if request.param == "emulate" else {"graphs.mode": "off"}
    engine = make(tiny_chat_folder, **graphs)
    yield engine
    engine.shutdown()


def side(engine: Engine) -> tuple[int, int]:
    stats = spec_stats(engine)
    return stats["side_drafted_tokens"], stats["side_accepted_tokens"]


def test_tree_batch_equals_plain_decoding(spec: Engine, refs: list[dict[str, Any]]) -> None:
    before = side(spec)
    all_same(spec, refs)
    drafted, accepted = (a - b for a, b in zip(side(spec), before))
    assert 0 < accepted < drafted, f"side nodes both accepted and rejected expected: {accepted} of {drafted}"


def test_tree_alone_stops_and_prefix_hits(spec: Engine, tiny_det_engine: Engine, refs: list[dict[str, Any]]) -> None:
    """One request alone; max_tokens and a stop token inside an accepted side run; a later
    turn hitting the pages a tree-speculating request cached."""
    same(spec.generate(PROMPTS[2], PARAMS[2]), refs[2])  # type: ignore[arg-type]
    for case in ({"max_new_tokens": 9}, {"stop_token_ids": [refs[1]["output_ids"][10]]}):
        params = {**PARAMS[1], **case}
        same(spec.generate(PROMPTS[1], params), tiny_det_engine.generate(PROMPTS[1], params))  # type: ignore[arg-type]
    assert spec.flush_cache()
    spec.generate(PROMPTS[3], PARAMS[3])
    turn = PROMPTS[3] + refs[3]["output_ids"][:19] + tokens(97, 5)
    warm = spec.generate(turn, PARAMS[0])
    assert warm["meta_info"]["cached_tokens"] > len(PROMPTS[3])  # type: ignore[index,call-overload]
    same(warm, tiny_det_engine.generate(turn, PARAMS[0]))  # type: ignore[arg-type]


def test_ngram_tree_exact(tiny_chat_folder: str, tiny_det_engine: Engine) -> None:
    """The built-in drafter with topk 3 on a prompt whose n-grams were followed by several
    tokens: side branches are drafted, the output is exact."""
    engine = make(tiny_chat_folder, **{"speculative.method": "ngram", "speculative.ngram_min": 1})
    try:
        prompt = motif_prompt(tokens(6, 5))
        params = [PARAMS[0], PARAMS[1]]
        outs = engine.generate([prompt, prompt[2:]], params)
        assert isinstance(outs, list)
        for out, ref in zip(outs, tiny_det_engine.generate([prompt, prompt[2:]], params)):  # type: ignore[arg-type]
            same(out, ref)  # type: ignore[arg-type]
        assert side(engine)[0] > 0, "no side branch drafted"
    finally:
        engine.shutdown()


def test_draft_model_tree_exact(tiny_chat_folder: str, tiny_det_engine: Engine, refs: list[dict[str, Any]]) -> None:
    """A draft model's next-best tokens as leaves beside its chain."""
    from tests.test_speculative_draft import make as make_draft

    engine = make_draft(tiny_chat_folder, tiny_chat_folder, **{"speculative.topk": 2})
    try:
        all_same(engine, refs)
        assert side(engine)[0] > 0, "no leaf drafted"
    finally:
        engine.shutdown()


NATIVE = {"model.quantization": "int8", "graphs.mode": "cpu", "deterministic": False}
needs_native_step = pytest.mark.skipif(
    not all(cpu.load(name) for name in ("decode_step", "quant_gemv", "paged_attention", "llama_glue")),
    reason="the C++ CPU kernels are off or do not build here (graphs.mode: cpu needs them)")


@pytest.fixture(scope="module")
def native_refs(tiny_chat_folder: str) -> list[dict[str, Any]]:
    """The plain engine on the native CPU decode step (paged attention kernel, rows that
    depend on nothing but their own inputs: exact outside deterministic mode too)."""
    plain = Engine(None, {"model.path": tiny_chat_folder, **TINY_OVERRIDES, **NATIVE})
    try:
        outs = plain.generate(PROMPTS, PARAMS)
    finally:
        plain.shutdown()
    assert isinstance(outs, list)
    return outs


def native(folder: str) -> Engine:
    return Engine(None, {"model.path": folder, **TINY_OVERRIDES, "cache.prefix": "radix", **TREE, **NATIVE})


@needs_native_step
def test_tree_on_the_paged_kernel_exact(tiny_chat_folder: str, native_refs: list[dict[str, Any]]) -> None:
    """The paged attention kernel reads KV by page: a side branch's row must map whole
    pages of its own from the page holding the input token on."""
    answers(native_refs)
    engine = native(tiny_chat_folder)
    try:
        all_same(engine, native_refs)
        assert side(engine)[1] > 0, "no side node accepted"
    finally:
        engine.shutdown()


@needs_native_step
def test_planted_fork_page_not_copied_red(tiny_chat_folder: str, native_refs: list[dict[str, Any]],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The computed part of the page holding the input token never copied to a branch's
    own page: its rows attend to stale KV there."""
    from kernel.speculative import tree

    plan = tree.plan_scratch

    def no_copies(*args: Any, **kwargs: Any) -> Any:
        tokens_, planned = plan(*args, **kwargs)
        return tokens_, planned._replace(copies=()) if planned is not None else None

    monkeypatch.setattr("kernel.scheduling.scheduler.plan_scratch", no_copies)
    answers(native_refs)
    engine = native(tiny_chat_folder)
    try:
        red(engine, native_refs)
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()


# ---- the tree, alone -----------------------------------------------------------------
def test_walk_follows_the_sampled_tokens() -> None:
    # input -> a(0) -> b(1) -> c(2); beside a: x(3) -> y(4); beside b: z(5)
    tokens_, parents = (10, 11, 12, 20, 21, 30), (-1, 0, 1, -1, 3, 0)
    assert walk(tokens_, parents, [10, 11, 12, 99, 0, 0, 0]) == [0, 1, 2, 3]  # the main chain, all of it
    assert walk(tokens_, parents, [20, 0, 0, 0, 21, 5, 0]) == [0, 4, 5]  # off at the root, down x -> y
    assert walk(tokens_, parents, [10, 30, 0, 0, 0, 0, 7]) == [0, 1, 6]  # off after a, to z
    assert walk(tokens_, parents, [5, 11, 12, 99, 0, 0, 0]) == [0]  # nothing drafted was right


def test_legal_tree_drops_whole_subtrees() -> None:
    tree = DraftTree((10, 11, 12, 20, 21), (-1, 0, 1, -1, 3))
    kept = legal_tree(tree, lambda path: next((i for i, t in enumerate(path) if t in (11, 20)), len(path)))
    assert kept == DraftTree((10,), (-1,))


def test_ngram_tree_branches() -> None:
    from handlers.drafter_ngram import NgramDrafter

    drafter = NgramDrafter(ngram_min=1, ngram_max=2)
    req = request([1, 2, 7, 8, 1, 2, 5, 6, 1, 2, 3, 4, 9, 1, 2])
    tree = drafter.propose_tree(req, 4, 3, 16)
    assert tree.tokens[:4] == (3, 4, 9, 1)  # the latest continuation is the main chain
    assert tree.tokens[4:] == (5, 6, 7, 8) and tree.parents == (-1, 0, 1, 2, -1, 4, -1, 6)  # then older ones
    assert drafter.propose_tree(req, 4, 3, 5).tokens == (3, 4, 9, 1, 5)  # within the rows


# ---- planted bugs: the guards go red --------------------------------------------------
@pytest.fixture
def fresh(tiny_chat_folder: str, refs: list[dict[str, Any]]) -> Iterator[Engine]:
    answers(refs)
    engine = make(tiny_chat_folder, **{"debug.check_invariants": False})
    yield engine
    leaks.excuse(engine.engine)
    engine.shutdown()


def red(engine: Engine, refs: list[dict[str, Any]]) -> None:
    outs = engine.generate(PROMPTS, PARAMS)
    assert isinstance(outs, list)
    assert side(engine)[1] > 0, "no side node accepted: the planted bug was never reached"
    with pytest.raises(AssertionError, match="speculation guard"):
        for out, ref in zip(outs, refs):
            same(out, ref)


def test_planted_side_kv_never_moved_red(fresh: Engine, refs: list[dict[str, Any]],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The accepted side path's KV left in its scratch slots: later steps read the
    rejected main tokens' KV at those positions."""
    monkeypatch.setattr(ModelRunner, "move_kv", lambda self, moves: None)
    red(fresh, refs)


def test_planted_side_nodes_on_the_request_row_red(fresh: Engine, refs: list[dict[str, Any]],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Side nodes run on the request's own row: they read the main chain's KV at their
    depths (and write over it)."""
    rows = step_loop.verify_rows

    def own_row(req: Any, ch: Any) -> list[tuple[int, int, int, Any]]:
        return [(token, req.row, position, before) for token, _, position, before in rows(req, ch)]

    monkeypatch.setattr(step_loop, "verify_rows", own_row)
    red(fresh, refs)

