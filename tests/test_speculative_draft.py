"""`speculative.method: draft`: a draft model proposes, the target verifies — the output is
the plain engine's exactly (deterministic mode), whether the draft agrees with the target
(the same weights: nearly every draft accepted) or not (another random model: most
rejected); a draft model whose vocabulary differs is refused at start-up."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kernel import Engine
from kernel.config import ConfigError
from tests.conftest import TINY_OVERRIDES
from tests.test_speculative import PARAMS, PROMPTS, same, tokens


@pytest.fixture(scope="module")
def other_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.tiny_models import build_tiny_chat

    return str(build_tiny_chat(Path(tmp_path_factory.mktemp("tiny_other")), seed=1))


def make(folder: str, draft: str, **extra: Any) -> Engine:
    return Engine(None, {"model.path": folder, **TINY_OVERRIDES, "deterministic": True, "cache.prefix": "radix",
                         "speculative.method": "draft", "speculative.draft_model": draft, **extra})


@pytest.fixture(scope="module")
def refs(tiny_det_engine: Engine) -> list[dict[str, Any]]:
    outs = tiny_det_engine.generate(PROMPTS, PARAMS)
    assert isinstance(outs, list)
    return outs


@pytest.fixture(scope="module", params=["same", "other"])
def spec(request: pytest.FixtureRequest, tiny_chat_folder: str, other_folder: str) -> Iterator[Engine]:
    engine = make(tiny_chat_folder, tiny_chat_folder if request.param == "same" else other_folder)
    yield engine
    engine.shutdown()


def test_draft_model_output_is_exact(spec: Engine, refs: list[dict[str, Any]]) -> None:
    outs = spec.generate(PROMPTS, PARAMS)
    assert isinstance(outs, list)
    for out, ref in zip(outs, refs):
        same(out, ref)
    stats = spec.engine.stats()["speculative"]
    assert stats["verify_steps"] > 0 and stats["drafted_tokens"] > 0
    if spec.config.speculative.draft_model == spec.config.model.path:
        # Greedy, the same weights: the draft (greedy too, not batch-invariant) is nearly always right.
        out = spec.generate(PROMPTS[0], PARAMS[0])
        same(out, refs[0])  # type: ignore[arg-type]
        meta = out["meta_info"]  # type: ignore[index]
        assert meta["spec_accepted_tokens"] > 0.8 * meta["spec_drafted_tokens"], meta


def test_stops_and_later_requests(spec: Engine, tiny_det_engine: Engine, refs: list[dict[str, Any]]) -> None:
    """A request after others (the draft's KV of a reused row and pages is rebuilt), and
    max_tokens / stop token ids inside accepted runs."""
    for case in ({"max_new_tokens": 7}, {"stop_token_ids": [refs[2]["output_ids"][9]]}):
        params = {**PARAMS[2], **case}
        same(spec.generate(PROMPTS[2], params), tiny_det_engine.generate(PROMPTS[2], params))  # type: ignore[arg-type]


def test_a_draft_with_another_vocabulary_is_refused(tiny_chat_folder: str, hybrid_folders: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="vocabulary"):
        make(tiny_chat_folder, hybrid_folders["lfm2"])


# ---- prefix hits for the draft (kernel/speculative/draft_pages.py) ----------------------
PAGE = 4  # TINY_OVERRIDES["cache.page_size"]
assert TINY_OVERRIDES["cache.page_size"] == PAGE
def first_starts(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Per request id, where its first draft job starts (recorded from now on)."""
    from kernel.speculative.draft_model import ModelDrafter

    starts: dict[str, int] = {}
    job = ModelDrafter.job

    def recorded(self: ModelDrafter, req: Any, count: int, others: int = 0, **kw: Any) -> Any:
        out = job(self, req, count, others, **kw)
        starts.setdefault(req.rid, out.start)
        return out

    monkeypatch.setattr(ModelDrafter, "job", recorded)
    return starts


def draft_hits(engine: Engine, det: Engine, starts: dict[str, int]) -> tuple[int, int, int]:
    """First-job starts of: a cold prompt, a later turn over its pages (the draft's KV of
    them is its own), and a turn over pages a request without draft jobs computed."""
    page = PAGE
    prompt = tokens(60, 10 * page + 1)
    assert engine.flush_cache()
    first = engine.generate(prompt, PARAMS[0])
    turn = prompt + first["output_ids"][:8] + tokens(61, 3)  # type: ignore[index,call-overload]
    same(engine.generate(turn, PARAMS[0]), det.generate(turn, PARAMS[0]))  # type: ignore[arg-type]
    other = tokens(62, 10 * page + 1)
    engine.generate(other, {**PARAMS[0], "speculative": False})  # the target's KV only
    again = other + tokens(63, 5)
    same(engine.generate(again, PARAMS[0]), det.generate(again, PARAMS[0]))  # type: ignore[arg-type]
    values = list(starts.values())
    assert len(values) == 3, starts
    return values[0], values[1], values[2]


def test_draft_prefix_hits(tiny_chat_folder: str, tiny_det_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make(tiny_chat_folder, tiny_chat_folder)
    try:
        cold, warm, foreign = draft_hits(engine, tiny_det_engine, first_starts(engine, monkeypatch))
        assert cold == 0
        assert warm >= 10 * PAGE, "the draft recomputed pages it had written"
        assert foreign == 0, "the draft trusted pages whose draft KV is not of their tokens"
    finally:
        engine.shutdown()


def test_planted_draft_trusts_every_cached_page_red(tiny_chat_folder: str, tiny_det_engine: Engine,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The marks' keys not compared: pages the target computed alone are trusted."""
    from kernel.speculative.draft_pages import DraftPages

    monkeypatch.setattr(DraftPages, "trusted", lambda self, req: req.shared_pages * self.page_size)
    engine = make(tiny_chat_folder, tiny_chat_folder)
    try:
        _, _, foreign = draft_hits(engine, tiny_det_engine, first_starts(engine, monkeypatch))
        assert foreign > 0  # the guard above (foreign == 0) goes red
    finally:
        engine.shutdown()
