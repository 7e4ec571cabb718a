"""The draft model's steps under the graph runner (`graphs.mode: emulate`, what CUDA
captures): with the target in a graph runner, the draft gets one of its own (decode and
prefill buckets, a static-shape attention backend) and its jobs' chunks and greedy steps
replay them — dense and
hybrid drafts, the target's output `==` the plain engine's, nearly every draft of the same
weights accepted, and after every draft replay the rows past its live ones hold their
sentinels (a job's greedy steps shrink as its requests' drafts end).

Planted: the draft registry's tail reset removed. The stale-row check goes red. (The
outputs stay exact: the target verifies every draft; and here a stale row's writes land
only in positions the draft recomputes or in a scratch state slot, so acceptance alone
would not show it.)
"""

from __future__ import annotations

from typing import Any

import pytest

from gpu.forward_batch import ForwardBatch
from gpu.graphs.runner import GraphRunner
from gpu.graphs.static_buffers import StaticBuffers
from kernel import Engine
from tests import leaks
from tests.conftest import GRAPHS_EMULATE, TINY_OVERRIDES
from tests.test_graph_runner import stale_rows
from tests.test_speculative import same
from tests.test_speculative_draft import make as make_dense
from tests.test_speculative_hybrid import make as make_hybrid
from tests.test_speculative_hybrid import tokens

GREEDY = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True, "return_logprob": True}
# Greedy, the draft the target's own weights (a dense one in its own dtype, bf16 where the CPU has it):
# most drafts agree (0.88-1.0 on a Zen 5; not all: its numerics are not the target's).
AGREES = 0.75
DRAFT = {**GRAPHS_EMULATE, "speculative.num_draft_tokens": 4, "graphs.decode_buckets": [4]}
PROMPTS = [tokens(71, 14), tokens(72, 9), tokens(73, 12)]
PARAMS = [GREEDY, {**GREEDY, "max_new_tokens": 17}, {**GREEDY, "max_new_tokens": 29}]


@pytest.fixture(scope="module")
def folders(tiny_chat_folder: str, hybrid_folders: dict[str, str]) -> dict[str, str]:
    return {"dense": tiny_chat_folder, **hybrid_folders}


def engines(model: str, folders: dict[str, str]) -> tuple[Engine, Engine]:
    """(a target drafting with its own weights under emulated graphs, the plain target)."""
    folder = folders[model]
    if model == "dense":
        plain = Engine(None, {"model.path": folder, **TINY_OVERRIDES, "deterministic": True})
        return make_dense(folder, folder, **DRAFT), plain
    spec = make_hybrid(folder, "extra_buffer", **{"speculative.method": "draft", "speculative.draft_model": folder,
                                                  **DRAFT})
    return spec, make_hybrid(folder, "extra_buffer", **{"cache.prefix": "none"})


def draft_graphs(engine: Engine) -> GraphRunner:
    drafter = engine.engine.scheduler.speculator.drafter  # type: ignore[union-attr]
    graphs = drafter.model.runner.graphs
    assert isinstance(graphs, GraphRunner), f"the draft's steps run without a graph runner: {graphs!r}"
    return graphs


def watch_stale_rows(graphs: GraphRunner, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """After each draft replay: how many rows past its live ones do not hold their sentinel."""
    found: list[int] = []
    replay = graphs.replay

    def checked(graph: Any, batch: ForwardBatch) -> Any:
        logits = replay(graph, batch)
        found.append(sum(stale_rows(graphs, batch).values()))
        return logits

    monkeypatch.setattr(graphs, "replay", checked)
    return found


def acceptance(outs: list[dict[str, Any]]) -> float:
    drafted = sum(o["meta_info"].get("spec_drafted_tokens", 0) for o in outs)
    return sum(o["meta_info"].get("spec_accepted_tokens", 0) for o in outs) / max(drafted, 1)


@pytest.mark.parametrize("planted", [False, True], ids=["reset", "no-reset"])
@pytest.mark.parametrize("model", ["dense", "qwen3_5_text", "lfm2"])
def test_draft_steps_replay_decode_buckets(folders: dict[str, str], model: str, planted: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    spec, plain = engines(model, folders)
    graphs = draft_graphs(spec)
    stale = watch_stale_rows(graphs, monkeypatch)
    buffers, reset = graphs.buffers["decode"], StaticBuffers.reset_tail

    def draft_never_reset(self: StaticBuffers, name: str, live: int, rows: int) -> None:
        if self is not buffers:
            reset(self, name, live, rows)

    if planted:  # the draft's decode buckets only, after their warm-up
        monkeypatch.setattr(StaticBuffers, "reset_tail", draft_never_reset)
    try:
        outs = spec.generate(PROMPTS, PARAMS)
        want = plain.generate(PROMPTS, PARAMS)
        assert isinstance(outs, list) and isinstance(want, list)
        for out, ref in zip(outs, want):
            same(out, ref)
        assert stale, "no draft step replayed a bucket"
        kinds = {bucket.kind for bucket, n in graphs.replays.items() if n}
        assert kinds == {"decode", "prefill"}, f"draft replays: {dict(graphs.replays)}"
        if planted:
            assert max(stale) > 0, "stale-row guard: the planted bug left no stale row"
            return
        assert max(stale) == 0, f"stale-row guard: {max(stale)} stale rows after a draft replay"
        assert acceptance(outs) >= AGREES, f"acceptance {acceptance(outs):.2f} below {AGREES}"
    finally:
        if planted:
            leaks.excuse(spec.engine)
        spec.shutdown()
        plain.shutdown()
