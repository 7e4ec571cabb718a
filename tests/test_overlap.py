"""Overlap scheduling (`scheduler.overlap: on`, kernel/scheduling/overlap.py): step N+1 is planned
and submitted before step N's tokens are applied, and it changes no output.

In deterministic mode every request's tokens and logprobs with overlap on are equal
(`==`) to overlap off, over a varied workload (greedy and seeded sampling, stop tokens,
stop strings and max_tokens finishing at different steps, n > 1, prefix-cache hits, a
grammar, penalties, top and prompt logprobs, retraction under memory pressure, aborts);
after each run nothing leaked (tests/leaks.py checks every engine) and the integrity
check ran after every step. The planted-bug tests at the bottom show the guard go red.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gpu.forward_batch import ForwardBatch, PrefillChunk, SamplingRow, placeholder
from gpu.step_inputs import NextTokens, StepInputs
from kernel import Engine
from kernel.config import ConfigError, load_config
from kernel.request import Request
from kernel.results.detokenizer import IncrementalDetokenizer
from kernel.results.events import EventBus
from kernel.results.output import OutputProcessor
from kernel.sampling_params import SamplingParams
from kernel.scheduling.overlap import resolve_overlap
from kernel.scheduling.prefix_reuse import PrefixReuse
from kernel.scheduling.scheduler import Scheduler
from tests import leaks
from tests.conftest import GRAPHS_EMULATE, TINY_OVERRIDES, graph_replays

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "return_logprob": True}
SAMPLED = {**GREEDY, "temperature": 0.8, "top_p": 0.95, "seed": 7}
PAGE = TINY_OVERRIDES["cache.page_size"]
SAMPLE_ROW = SamplingRow(0.0, 1.0, 0, 0.0, 0.0, 0.0, 1.0, 0, seed=0, step=0)
SHARED = [300 + i for i in range(24)]  # a prefix several prompts share (page-aligned: 6 pages)


def make(folder: str, overlap: str, **extra: Any) -> Engine:
    return Engine(None, {"model.path": folder, **TINY_OVERRIDES, "deterministic": True, "cache.prefix": "radix",
                         "scheduler.overlap": overlap, **extra})


@pytest.fixture(scope="module")
def engines(tiny_chat_folder: str) -> Iterator[dict[str, Engine]]:
    pair = {"off": make(tiny_chat_folder, "off"), "on": make(tiny_chat_folder, "on")}
    yield pair
    for engine in pair.values():
        engine.shutdown()


def workload(ref: Engine) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Prompts and params; stop tokens and strings are taken from a plain greedy run so
    that requests finish by them at different steps."""
    prompts = [SHARED + [900 + i, 40 + 3 * i] for i in range(4)] + [[500 + 11 * i + j for j in range(7 + i)] for i in range(4)]
    plain = ref.generate(prompts[:4], GREEDY)
    assert isinstance(plain, list)
    params: list[dict[str, Any]] = [
        {**GREEDY, "stop_token_ids": [plain[0]["output_ids"][2]]},  # a stop token at step 3
        {**GREEDY, "stop_token_ids": [plain[1]["output_ids"][6]], "ignore_eos": False},
        {**GREEDY, "stop": [plain[2]["text"][4:7]]} if len(plain[2]["text"]) > 7 else GREEDY,  # a stop string
        {**SAMPLED, "top_logprobs_num": 3},
        {**GREEDY, "max_new_tokens": 1},
        {**GREEDY, "max_new_tokens": 2, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
        {**SAMPLED, "max_new_tokens": 5, "logprob_start_len": 2},
        {**GREEDY, "max_new_tokens": 8, "regex": "[a-z]{2,6}"},
    ]
    return prompts, params


def generate(engine: Engine, prompts: list[list[int]], params: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Seeded requests run as n = 2 (the second with seed + 1, as the HTTP layer expands n)."""
    jobs = [(p, q) for p, q in zip(prompts, params)]
    jobs += [(p, {**q, "seed": q["seed"] + 1}) for p, q in jobs if "seed" in q]
    outs = engine.generate([p for p, _ in jobs], [q for _, q in jobs])
    assert isinstance(outs, list)
    return outs


def summary(out: dict[str, Any]) -> tuple[Any, ...]:
    meta = out["meta_info"]
    return (out["output_ids"], out["text"], meta.get("output_token_logprobs"), meta.get("output_top_logprobs"),
            meta.get("input_token_logprobs"), meta["finish_reason"], meta["matched_stop"])


def assert_same_outputs(got: list[dict[str, Any]], ref: list[dict[str, Any]]) -> None:
    """The guard: with overlap, exactly the tokens, text and logprobs of the plain loop."""
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        assert summary(g) == summary(r), "overlap guard: outputs differ from overlap off"


def run_both(engines: dict[str, Engine]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    prompts, params = workload(engines["off"])
    for engine in engines.values():
        assert engine.flush_cache()
    ref = [*generate(engines["off"], prompts, params), *generate(engines["off"], prompts, params)]  # 2nd: cache hits
    got = [*generate(engines["on"], prompts, params), *generate(engines["on"], prompts, params)]
    return got, ref


def test_overlap_changes_no_output(engines: dict[str, Engine]) -> None:
    before = engines["on"].engine.loop.overlapped
    got, ref = run_both(engines)
    assert_same_outputs(got, ref)
    half = len(ref) // 2
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in got[half:half + 4]), "the second pass did not hit"
    reasons = {o["meta_info"]["finish_reason"] for o in ref}
    assert reasons == {"stop", "length"}, reasons
    # It really overlapped: steps were submitted before the previous one was applied.
    assert engines["on"].engine.loop.overlapped - before > 10
    assert engines["off"].engine.loop.overlapped == 0


def under_pressure(folder: str, mode: str, planted: bool = False) -> tuple[list[dict[str, Any]], int]:
    """6 requests that grow to ~42 tokens each in 24 usable pages of 4 tokens. With a
    `planted` bug, the engine's state afterwards is the evidence: not checked for leaks."""
    prompts = [[100 + i * 7 + j for j in range(10 + i)] for i in range(6)]
    engine = make(folder, mode, **{"cache.num_pages": 25})
    try:
        outs = engine.generate(prompts, {**GREEDY, "max_new_tokens": 30})
        assert isinstance(outs, list)
        return outs, engine.engine.scheduler.num_retractions
    finally:
        if planted:
            leaks.excuse(engine.engine)
        engine.shutdown()


def test_overlap_under_memory_pressure_retracts_and_changes_nothing(tiny_chat_folder: str) -> None:
    (ref, retracted_off), (got, retracted_on) = under_pressure(tiny_chat_folder, "off"), under_pressure(tiny_chat_folder, "on")
    assert retracted_off > 0 and retracted_on > 0
    assert_same_outputs(got, ref)


def test_overlap_in_graph_buckets(tiny_chat_folder: str) -> None:
    """Static-shape emulation: placeholders resolve before the batch is copied into a bucket."""
    prompts = [[400 + 9 * i + j for j in range(6 + i)] for i in range(5)]
    outs, replays = {}, {}
    for mode in ("off", "on"):
        engine = make(tiny_chat_folder, mode, **GRAPHS_EMULATE)
        try:
            outs[mode] = engine.generate(prompts, {**SAMPLED, "max_new_tokens": 9})
            replays[mode] = graph_replays(engine)["decode"]
        finally:
            engine.shutdown()
    assert replays["on"] > 0 and replays["off"] > 0
    assert_same_outputs(outs["on"], outs["off"])  # type: ignore[arg-type]


def test_duplicate_pages_wait_for_the_look_ahead_step(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests prefill the same prompt side by side (no waiting for each other): the
    second one's copies of the cached pages are freed only once its next chunk, already
    in flight, has landed; the accounting holds after every step and outputs are equal."""
    deferred: list[int] = []
    real_free = PrefixReuse.free_deferred

    def spy(self: PrefixReuse) -> None:
        deferred.append(len(self.deferred))
        real_free(self)

    monkeypatch.setattr(PrefixReuse, "free_deferred", spy)
    prompt = [200 + (7 * j) % 97 for j in range(60)]
    outs = {}
    for mode in ("off", "on"):
        engine = make(tiny_chat_folder, mode, **{"scheduler.share_prefix_min_tokens": 0})
        try:
            deferred.clear()
            outs[mode] = engine.generate([prompt, prompt], GREEDY)
            if mode == "on":
                assert max(deferred) > 0, "no duplicate page was deferred"
            else:
                assert max(deferred) == 0
        finally:
            engine.shutdown()
    assert_same_outputs(outs["on"], outs["off"])  # type: ignore[arg-type]


async def _abort_some(engine: Engine, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Run prompts, aborting every other one after its third token (while the next step,
    which has it too, is in flight); the others' results."""
    ae = engine.engine
    params = SamplingParams.from_dict({**GREEDY, "max_new_tokens": 20})
    rids = [ae.add_request(p, params) for p in prompts]

    async def cut(rid: str) -> None:
        seen = 0
        async for chunk in ae.stream(rid):
            seen += len(chunk.token_ids)
            if seen >= 3:
                ae.abort(rid)

    await asyncio.gather(*(cut(r) for r in rids[::2]))
    return list(await asyncio.gather(*(ae.collect(r) for r in rids[1::2])))


def test_abort_while_a_look_ahead_step_runs(engines: dict[str, Engine]) -> None:
    prompts = [[700 + 5 * i + j for j in range(9)] for i in range(6)]
    ref = engines["off"].generate(prompts[1::2], {**GREEDY, "max_new_tokens": 20})
    on = engines["on"]
    got = on._call(_abort_some(on, prompts))
    assert_same_outputs(got, ref)  # type: ignore[arg-type]
    assert on.engine.check() is None


def test_placeholder_names_its_own_row_only() -> None:
    ok = ForwardBatch.build([PrefillChunk((placeholder(3),), 3, 10)], [])
    assert ok.placeholders == 1
    with pytest.raises(ValueError, match="not its own placeholder"):
        ForwardBatch.build([PrefillChunk((placeholder(2),), 3, 10)], [])


def test_next_tokens_resolve_per_row() -> None:
    nt = NextTokens(6, torch.device("cpu"))
    nt.record([4, 1], torch.tensor([77, 55]))
    ids = torch.tensor([9, placeholder(1), 8, placeholder(4)])
    assert nt.resolve(ids).tolist() == [9, 55, 8, 77]


def test_step_inputs_resolve_placeholders_only_with_overlap() -> None:
    cpu = torch.device("cpu")
    inputs = StepInputs(cpu, None)
    batch = ForwardBatch.build([PrefillChunk((3, 4), 1, 0), PrefillChunk((placeholder(2),), 2, 7)], [(0, SAMPLE_ROW)])
    with pytest.raises(ValueError, match="overlap scheduling is off"):
        inputs.build(batch)
    inputs.next_tokens = NextTokens(4, cpu)
    inputs.next_tokens.record([2], torch.tensor([42]))
    ids, pos, last = inputs.build(batch)
    assert (ids.tolist(), pos.tolist(), last.tolist()) == ([3, 4, 42], [0, 1, 7], [1])


def test_overlap_setting_is_validated_and_resolved() -> None:
    with pytest.raises(ConfigError, match="scheduler.overlap"):
        load_config(None, {"scheduler.overlap": "sometimes"})
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [resolve_overlap(s, cpu, False) for s in ("auto", "on", "off")] == [False, True, False]
    assert resolve_overlap("auto", cuda, False) and not resolve_overlap("on", cuda, True)


# ---- planted bugs: the equality guard goes red ----------------------------------
def test_red_when_a_placeholder_reads_another_rows_token(engines: dict[str, Engine],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def shifted(self: NextTokens, input_ids: torch.Tensor) -> torch.Tensor:
        rows = (-1 - input_ids).clamp(min=0)
        return torch.where(input_ids < 0, self.tokens.roll(1)[rows], input_ids)  # the neighbour's token

    monkeypatch.setattr(NextTokens, "resolve", shifted)
    with pytest.raises(AssertionError, match="overlap guard"):
        assert_same_outputs(*run_both(engines))


def abort_ahead_at_page_end(engine: Engine, rid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Abort `rid` right after a step is submitted that has it ahead of the step in
    flight, where the dropped token's KV would complete a page: the case where only
    `Scheduler._computed_len` keeps that KV out of the prefix cache."""
    loop, ae = engine.engine.loop, engine.engine
    real_submit = loop.submit

    def submit(plan: Any) -> Any:
        step = real_submit(plan)
        for chunk in plan.chunks if plan is not None else ():
            req = chunk.req
            if req.rid == rid and req.ahead and not req.finished and (req.kv_len + 1) % PAGE == 0 and req.output_ids[:-1]:
                ae.abort(rid)
        return step

    monkeypatch.setattr(loop, "submit", submit)


def abort_then_reuse(engines: dict[str, Engine]) -> tuple[Any, Any]:
    """A request aborted while its look-ahead step runs; then a prompt that extends its
    tokens (a prefix-cache hit on what it left) — on both engines, outputs compared."""
    on, off = engines["on"], engines["off"]
    prompt = [640 + j for j in range(9)]
    for engine in (on, off):
        assert engine.flush_cache()
    rid = on._call(_add(on, prompt))
    with pytest.MonkeyPatch.context() as mp:
        abort_ahead_at_page_end(on, rid, mp)
        cut = on._call(on.engine.collect(rid))
    assert cut["meta_info"]["finish_reason"] == "abort"
    longer = prompt + cut["output_ids"] + [77, 78, 79, 80, 81]
    warm = on.generate(longer, GREEDY)
    assert isinstance(warm, dict) and warm["meta_info"]["cached_tokens"] > 0, "no hit on the aborted request's pages"
    return warm, off.generate(longer, GREEDY)


async def _add(engine: Engine, prompt: list[int]) -> str:
    return engine.engine.add_request(prompt, SamplingParams.from_dict({**GREEDY, "max_new_tokens": 30}))


def test_abort_of_a_request_ahead_caches_only_its_real_tokens(engines: dict[str, Engine]) -> None:
    warm, ref = abort_then_reuse(engines)
    assert_same_outputs([warm], [ref])
    assert engines["on"].engine.check() is None


def test_red_when_a_dropped_tokens_kv_is_cached(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug: kv_len counts the look-ahead step's KV of the token the abort dropped;
    the prefix cache refuses the insert (more KV than tokens) and the engine halts."""
    monkeypatch.setattr(Scheduler, "_computed_len", staticmethod(lambda req, chunk: chunk.start + chunk.length))
    pair = {"off": make(tiny_chat_folder, "off"), "on": make(tiny_chat_folder, "on")}  # the planted bug halts one
    try:
        with pytest.raises(ValueError, match="do not make whole pages"):
            abort_then_reuse(pair)
        assert pair["on"].engine.halt_reason is not None
    finally:
        leaks.excuse(pair["on"].engine)
        for engine in pair.values():
            engine.shutdown()


def test_red_when_a_request_in_flight_is_retracted(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug: the victim search forgets that the newest request's step is in flight."""
    def careless(self: Scheduler, exclude: Any) -> Any:
        return max((r for r in self.running if id(r) not in exclude), key=lambda r: r.arrival)

    monkeypatch.setattr(Scheduler, "_newest", careless)
    # The retracted request lands without its row: the prefix cache's guard halts the engine.
    with pytest.raises(AssertionError, match="reached the prefix cache without its table row"):
        under_pressure(tiny_chat_folder, "on", planted=True)


def test_a_request_back_from_its_look_ahead_step_gets_no_second_chunk(engines: dict[str, Engine]) -> None:
    """Finished at step N (its final chunk queued), it comes back from N+1 as finished
    again before its consumer ran: nothing more is pushed to its detokenizer or stream."""
    tokenizer = engines["on"].tokenizer
    assert tokenizer is not None
    output = OutputProcessor(EventBus(), lambda req, text: None)
    req = Request("r", [5, 6], SamplingParams(), seed=0, output_ids=[40, 41])
    stream = output.open(req, IncrementalDetokenizer(tokenizer, True, ()))
    req.finish("stop", 41)
    output.emit([req])
    output.emit([req])  # N+1 landed: its token was dropped, the request is back finished
    chunks = [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]
    assert [c.finished for c in chunks] == [True]  # type: ignore[union-attr]


def test_red_when_a_closed_stream_is_emitted_again(engines: dict[str, Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    def unguarded(self: OutputProcessor, reqs: Any) -> None:
        for req in reqs:
            st = self.streams.get(req.rid)
            if st is not None:
                self._emit_one(st)

    monkeypatch.setattr(OutputProcessor, "emit", unguarded)
    with pytest.raises(RuntimeError, match="after the detokenizer stopped or finished"):
        test_a_request_back_from_its_look_ahead_step_gets_no_second_chunk(engines)
