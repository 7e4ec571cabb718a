"""Decode runs (scheduler.decode_steps): k greedy decode steps in one native call give the
tokens k single steps give, stop where a single step would, and keep nothing past the stop.

The reference is the same engine with its runs detached (`scheduler.runs = None`: one
native step a call), so every comparison is `==` on one machine's arithmetic. Page size 4
with runs of 3 and 4, so runs cross page boundaries; the integrity check runs after every
step. Planted bugs — a token past a stop kept, a run's KV written and read one position
off — go red.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gpu import model_runner
from gpu.graphs.cpu_step import CpuStepRunner
from gpu.kernels import cpu
from kernel import Engine
from kernel.async_engine import AsyncEngine
from kernel.config import ConfigError
from kernel.sampling_params import SamplingParams
from kernel.scheduling import decode_runs
from kernel.scheduling.scheduler import Scheduler
from plugins.metrics import EngineCollector
from tests.aborts import leave_and_abort, wait_idle
from tests.conftest import CONFIG, TINY_OVERRIDES
from tests.test_host_tier import settle

if not all(cpu.load(name) for name in ("decode_step", "quant_gemv", "paged_attention", "llama_glue")):
    pytest.skip("the C++ CPU kernels are off or do not build here", allow_module_level=True)

# The packaged model (its text varies, so stops land inside runs) on its native step;
# radix, so a finished request's pages are cached.
NATIVE = {"graphs.mode": "cpu", "cache.prefix": "radix", "cache.page_size": 4, "cache.num_pages": 2048,
          "debug.check_invariants": True}
PLAIN = {"temperature": 0, "ignore_eos": True}
NEW_TOKENS = (1, 2, 5, 13, 30, 21)
PROMPTS = ("The capital of France is", "Write a short poem about the sea.", "1, 2, 3,",
           "Explain what a hash table is.", "Once upon a time, in a small village,", "List some fruits:")


def _prompts() -> list[list[int]]:
    return [list(range(1000 + 7 * i, 1000 + 7 * i + 3)) + TOKENS[text] for i, text in enumerate(PROMPTS)]


TOKENS: dict[str, list[int]] = {}  # each prompt's ids (the engine fixture fills it)


# Runs of 4, and of 3 in deterministic mode (its chained attention; a cache hit == a cold run there).
@pytest.fixture(scope="module", params=[(4, False), (3, True)], ids=["4-steps", "3-steps-deterministic"])
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    steps, deterministic = request.param
    engine = Engine(CONFIG, {**NATIVE, "scheduler.decode_steps": steps, "deterministic": deterministic})
    TOKENS.update((text, engine.engine.tokenizer.encode(text)) for text in PROMPTS)  # type: ignore[attr-defined]
    assert isinstance(_scheduler(engine).runs, decode_runs.DecodeRuns)
    yield engine
    engine.shutdown()


def _scheduler(engine: Engine) -> Scheduler:
    return engine.engine.scheduler  # type: ignore[attr-defined, no-any-return]


@contextmanager
def _cold(engine: Engine, runs: bool) -> Iterator[None]:
    """From a cold cache, with the engine's runs attached or detached (single steps)."""
    sched = _scheduler(engine)
    kept = sched.runs
    if not runs:
        sched.runs = None
    try:
        engine.flush_cache()
        yield
    finally:
        sched.runs = kept


def _generate(engine: Engine, params: list[dict[str, Any]], runs: bool = True) -> list[Any]:
    kept = _scheduler(engine).runs
    before = kept.runs if kept is not None else 0
    with _cold(engine, runs):
        outs = engine.generate(_prompts(), params)
    assert isinstance(outs, list) and kept is not None
    if runs:
        assert kept.runs > before, "no decode run was planned"
    else:
        assert kept.runs == before
    return [(o["output_ids"], o["meta_info"]["finish_reason"], o["meta_info"]["matched_stop"], o["text"]) for o in outs]


def _stops(reference: list[Any]) -> list[dict[str, Any]]:
    """Each request stopped by its own token at an index inside a run (and one by text)."""
    params = []
    for (ids, *_), n in zip(reference, NEW_TOKENS):
        p: dict[str, Any] = {**PLAIN, "max_new_tokens": n}
        firsts = [j for j in range(6, n - 1) if ids[j] not in ids[:j]]
        if firsts:  # a token's first appearance, past the first run
            p["stop_token_ids"] = [ids[firsts[0]]]
        params.append(p)
    text = reference[3][3]
    params[3] = {**params[3], "stop_token_ids": [], "stop": [text[len(text) // 2 : len(text) // 2 + 3]]}
    return params


@pytest.fixture(scope="module")
def reference(engine: Engine) -> list[Any]:
    return _generate(engine, [{**PLAIN, "max_new_tokens": n} for n in NEW_TOKENS], runs=False)


def test_runs_give_the_tokens_of_single_steps(engine: Engine, reference: list[Any]) -> None:
    assert _generate(engine, [{**PLAIN, "max_new_tokens": n} for n in NEW_TOKENS]) == reference
    runs = _scheduler(engine).runs
    assert runs is not None and runs.tokens > runs.runs


def test_stops_inside_runs_match_single_steps(engine: Engine, reference: list[Any]) -> None:
    params = _stops(reference)
    single = _generate(engine, params, runs=False)
    assert [s[1] for s in single].count("stop") >= 3, f"the stops did not land: {single}"
    assert _generate(engine, params) == single


def test_planted_token_past_a_stop_goes_red(engine: Engine, reference: list[Any],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    params = _stops(reference)
    single = _generate(engine, params, runs=False)

    def no_break(self: Scheduler, req: Any, chunk: Any, tokens: Any) -> int:  # planted: the whole run kept
        for token in tokens:
            self._append(req, token)
        req.kv_len = chunk.start + len(tokens)
        return len(tokens)

    # The run's own stop check off, so the tokens past a stop reach the scheduler, whose cut is tested.
    monkeypatch.setattr(Scheduler, "_stop_ids", lambda self, req: ())
    assert _generate(engine, params) == single
    monkeypatch.setattr(Scheduler, "_append_run", no_break)
    assert _generate(engine, params) != single, "a token past a stop inside a run went unnoticed"


def test_planted_run_one_position_off_goes_red(engine: Engine, reference: list[Any],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    runner = engine.engine.parts.runner  # type: ignore[attr-defined]
    assert isinstance(runner.graphs, CpuStepRunner)
    decoder = runner.graphs.decoder
    steps_argmax = decoder.steps_argmax

    def shifted(ids: torch.Tensor, positions: torch.Tensor, *rest: Any) -> torch.Tensor:
        return steps_argmax(ids, positions + 1, *rest)  # type: ignore[no-any-return]

    monkeypatch.setattr(decoder, "steps_argmax", shifted)
    try:
        planted = _generate(engine, [{**PLAIN, "max_new_tokens": n} for n in NEW_TOKENS])
    except RuntimeError as exc:  # or a run reached past a row's pages: refused, the step failed
        assert "outside the row's" in str(exc)
        return
    assert planted != reference, "a run writing and reading one position off went unnoticed"


def test_a_stop_inside_a_run_caches_only_what_it_kept(engine: Engine, reference: list[Any]) -> None:
    """A request stopped inside a run leaves its prompt and kept tokens cached, nothing more:
    a follow-up that extends its text hits that prefix and equals its cold run."""
    if not engine.config.deterministic:
        pytest.skip("a hit equals a cold run bit for bit in deterministic mode")
    params = _stops(reference)
    sched = _scheduler(engine)
    stopped = _generate(engine, params)  # its pages now cached (no flush after)
    i = next(i for i, (ids, reason, *_) in enumerate(stopped) if reason == "stop" and len(ids) > 6)
    prompt = _prompts()[i] + stopped[i][0]
    follow = {**PLAIN, "max_new_tokens": 12, "return_logprob": True}
    hit = engine.generate(prompt, follow)
    assert hit["meta_info"]["cached_tokens"] >= len(prompt) // 4 * 4 - 4, hit["meta_info"]
    engine.flush_cache()
    cold = engine.generate(prompt, follow)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert (hit["output_ids"], hit["meta_info"]["output_token_logprobs"]) == (
        cold["output_ids"], cold["meta_info"]["output_token_logprobs"])
    sched.check_integrity()


@pytest.mark.parametrize("planted", [False, True], ids=["runs", "planted: runs one position early"])
def test_a_turn_written_by_runs_is_a_host_hit_equal_to_its_cold_run(planted: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The KV that runs wrote (a first turn's output) goes to the host tier when the device
    pool fills, comes back on the next turn's hit, and that turn `==` its cold run. Planted:
    the runs write and read their KV one position early (red: the hit differs)."""
    engine = Engine(CONFIG, {**NATIVE, "cache.num_pages": 41, "hicache.host_pages": 200,
                             "scheduler.decode_steps": 3, "deterministic": True})
    sched = _scheduler(engine)
    if planted:
        decoder = engine.engine.parts.runner.graphs.decoder  # type: ignore[attr-defined]
        steps_argmax = decoder.steps_argmax
        monkeypatch.setattr(decoder, "steps_argmax", lambda ids, positions, *rest: steps_argmax(ids, positions - 1, *rest))
    rng = random.Random(3)
    first, pushes = [rng.randint(50, 40000) for _ in range(30)], [[rng.randint(50, 40000) for _ in range(60)]
                                                                   for _ in range(4)]
    try:
        before = sched.runs.runs if sched.runs is not None else 0
        turn1 = engine.generate(first, {**PLAIN, "max_new_tokens": 24})
        assert sched.runs is not None and sched.runs.runs > before, "the first turn ran no decode run"
        turn2 = first + turn1["output_ids"] + [5, 6, 7]  # type: ignore[index]
        for push in pushes:  # the device pool fills: the first turn goes to host
            engine.generate(push, {**PLAIN, "max_new_tokens": 8})
            settle(engine)
        follow = {**PLAIN, "max_new_tokens": 8, "return_logprob": True}
        warm = engine.generate(turn2, follow)
        tiers = warm["meta_info"]["cached_tokens_by_tier"]  # type: ignore[index]
        assert tiers["host"] > 0 and tiers["device"] + tiers["host"] > len(first), tiers
        assert engine.flush_cache()
        cold = engine.generate(turn2, follow)
        same = (warm["output_ids"], warm["meta_info"]["output_token_logprobs"]) == (  # type: ignore[index]
            cold["output_ids"], cold["meta_info"]["output_token_logprobs"])  # type: ignore[index]
        assert same != planted, "the hit differs from its cold run" if not planted else "the planted shift went unnoticed"
        sched.check_integrity()
    finally:
        engine.shutdown()


def test_requests_that_cannot_run_step_singly(engine: Engine) -> None:
    """Logprobs on any row, or a draw cut by top-k, top-p or min-p: no run (the step picks
    only argmaxes and draws by temperature alone)."""
    sched = _scheduler(engine)
    assert sched.runs is not None
    before = sched.runs.runs
    engine.generate(_prompts()[:2], [{**PLAIN, "max_new_tokens": 9},
                                     {**PLAIN, "max_new_tokens": 9, "return_logprob": True}])
    for cut in ({"top_p": 0.9}, {"top_k": 20}, {"min_p": 0.05}):
        engine.generate(_prompts()[:1], {"temperature": 0.7, "seed": 3, "max_new_tokens": 9, **cut})
    assert sched.runs.runs == before


def _draws() -> list[dict[str, Any]]:
    """Rows drawn by temperature alone (seeded; two temperatures), and one greedy row."""
    return [{"temperature": 0.6 + 0.3 * (i % 2), "seed": 11 + i, "ignore_eos": True, "max_new_tokens": n}
            if i != 2 else {**PLAIN, "max_new_tokens": n} for i, n in enumerate(NEW_TOKENS)]


@pytest.mark.parametrize("planted", [False, True], ids=["draws", "planted: noise a step late"])
def test_draws_by_temperature_give_the_tokens_of_single_steps(engine: Engine, monkeypatch: pytest.MonkeyPatch,
                                                              planted: bool) -> None:
    """Seeded rows drawn by temperature alone run too: each step's Gumbel noise is the one
    its single step draws with, so the tokens are theirs. Planted: each run step gets the
    noise of the step before it (red)."""
    reference = _generate(engine, _draws(), runs=False)
    if planted:
        real = model_runner.run_draws

        def late(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
            temperature, noise = real(*args)
            return temperature, noise.roll(1, dims=0) if noise.numel() else noise

        monkeypatch.setattr(model_runner, "run_draws", late)
    assert (_generate(engine, _draws()) == reference) != planted


async def test_aborts_while_runs_go_on(engine: Engine) -> None:
    params = {**PLAIN, "max_new_tokens": 40}
    engine = await AsyncEngine.create(CONFIG, {**NATIVE, "scheduler.decode_steps": 4})
    try:
        prompts = _prompts()[:3]
        refs = [await engine.collect(engine.add_request(p, params)) for p in prompts]
        engine.flush_cache()
        keep = engine.add_request(prompts[0], params)
        cut, outside = (engine.add_request(p, params) for p in prompts[1:])
        assert (await leave_and_abort(engine, cut, outside))["meta_info"]["finish_reason"] == "abort"
        assert (await engine.collect(keep))["output_ids"] == refs[0]["output_ids"]
        runs = engine.scheduler.runs
        assert runs is not None and runs.runs > 0
        scraped = {m.name: m.samples[0].value for m in EngineCollector(engine).collect() if "decode_run" in m.name}
        assert scraped == {"tierserve_decode_runs": runs.runs, "tierserve_decode_run_tokens": runs.tokens}
        await wait_idle(engine)
        sched = engine.scheduler
        assert sched.allocator.num_free + sched.prefix.cache.total_pages == sched.allocator.num_usable
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("planted", [False, True], ids=["arrival cuts the run", "planted: no interrupt"])
async def test_an_arrival_cuts_a_run_short(engine: Engine, planted: bool) -> None:
    """A request that arrives while a run of 64 steps is under way is admitted after the step
    under way, not after the run; both requests still get the tokens single steps give."""
    if engine.config.deterministic:
        pytest.skip("shown once: the cut is the scheduler's and the step runner's, in either mode")
    params = [{**PLAIN, "max_new_tokens": 150}, {**PLAIN, "max_new_tokens": 20}]
    engine = await AsyncEngine.create(CONFIG, {**NATIVE, "scheduler.decode_steps": 64})
    try:
        runs = engine.scheduler.runs
        assert runs is not None
        if planted:
            runs.interrupt = lambda: None
        long, short = _prompts()[4], _prompts()[1]
        refs = []
        for prompt, p in zip((long, short), params):
            refs.append((await engine.collect(engine.add_request(prompt, p)))["output_ids"])
        engine.flush_cache()
        first = engine.add_request(long, params[0])
        stream = engine.stream(first)
        await anext(stream)  # its prefill's token: runs of 64 steps (~0.2 s or more) follow
        await asyncio.sleep(0.05)  # inside the first run
        late = engine.add_request(short, params[1])
        got = [list(c.token_ids) async for c in stream]
        assert [t for g in got for t in g] == refs[0][1:]
        assert (await engine.collect(late))["output_ids"] == refs[1]
        cut = len(got[0]) < 64 and runs.cut > 0  # the first run landed before its 64 steps
        assert cut != planted, f"first run {len(got[0])} tokens, {runs.cut} runs cut short"
    finally:
        await engine.shutdown()


def test_a_bump_before_the_run_starts_still_cuts_it(engine: Engine) -> None:
    """The run compares the counter with its value when the run was planned, so an arrival
    between planning and the device starting the run ends it after its first step."""
    engine.flush_cache()  # the engine is idle: every page is free, the run below writes two rows' own
    runner = engine.engine.parts.runner  # type: ignore[attr-defined]
    pool, decoder = runner.pool, runner.graphs.decoder
    last = pool.k[0].shape[0] // pool.page_size
    table = torch.arange(last - 6, last, dtype=torch.int64).reshape(2, 3)  # 3 pages of 4 keys a row
    ids, positions = torch.tensor([7, 1234]), torch.zeros(2, dtype=torch.int64)
    none = torch.empty(2, 0, dtype=torch.int64)
    full = decoder.steps_argmax(ids, positions, table, 8, torch.tensor([5, 5]), none)
    cut = decoder.steps_argmax(ids, positions, table, 8, torch.tensor([6, 5]), none)  # bumped after planning
    assert full.shape == (2, 8) and torch.equal(cut, full[:, :1])
    # A row's stop token ends the run after the step that picked it (row 1's token at step 4).
    stops = torch.tensor([[-1], [int(full[1, 4])]])
    first = next(s for s in range(8) if full[1, s] == full[1, 4])
    assert torch.equal(decoder.steps_argmax(ids, positions, table, 8, torch.tensor([5, 5]), stops),
                       full[:, : first + 1])
    with pytest.raises(RuntimeError, match="outside the row's 3 pages"):
        decoder.steps_argmax(ids, positions, table, 13, torch.tensor([5, 5]), none)


@pytest.mark.parametrize("planted", [False, True], ids=["stop ends the run", "planted: no stops"])
def test_a_stop_token_ends_the_run(engine: Engine, reference: list[Any], monkeypatch: pytest.MonkeyPatch,
                                   planted: bool) -> None:
    """A request whose stop token lands inside a run ends the run there: its end is reported
    at once, and no step runs past it."""
    sched = _scheduler(engine)
    assert sched.runs is not None
    if planted:
        monkeypatch.setattr(Scheduler, "_stop_ids", lambda self, req: ())
    ids, k = reference[4][0], sched.runs.steps  # 30 tokens: the prefill's, then runs of k from index 1
    inside = [j for j in range(2, len(ids) - k) if ids[j] not in ids[:j] and j % k != 0]  # not a run's last
    assert inside, "no token first appears inside a run"
    params = {**PLAIN, "max_new_tokens": len(ids), "stop_token_ids": [ids[inside[0]]]}
    before = sched.runs.cut
    engine.flush_cache()
    out = engine.generate(_prompts()[4], params)
    assert out["output_ids"] == ids[: inside[0] + 1] and out["meta_info"]["finish_reason"] == "stop"
    assert (sched.runs.cut > before) != planted, f"{sched.runs.cut - before} runs ended early"


# Speculation lends runs the steps in which nobody drafts: over max_batch (2), and while a
# request rests (any imperfect verify step sends it resting for 6 decode steps).
SPECULATING = {**NATIVE, "scheduler.decode_steps": 4, "speculative.method": "ngram", "speculative.max_batch": 2,
               "speculative.window": 1, "speculative.min_acceptance": 1.0, "speculative.cooldown": 6}


@pytest.fixture(scope="module")
def speculating() -> Iterator[Engine]:
    engine = Engine(CONFIG, SPECULATING)
    TOKENS.update((text, engine.engine.tokenizer.encode(text)) for text in PROMPTS)  # type: ignore[attr-defined]
    yield engine
    engine.shutdown()


def _one_at_a_time(engine: Engine, runs: bool) -> list[Any]:
    with _cold(engine, runs):
        outs = [engine.generate(prompt, {**PLAIN, "max_new_tokens": 40}) for prompt in _prompts()]
    return [(o["output_ids"], o["meta_info"].get("spec_verify_ct", 0)) for o in outs]  # type: ignore[index]


def test_speculation_lends_its_quiet_steps_to_runs(speculating: Engine) -> None:
    """Over max_batch nobody drafts, and a resting request drafts nothing: those steps run
    as decode runs (kernel/speculative/speculator.py `quiet_steps`), with the tokens of
    single steps; a run counts against the rest (`rest`), so drafting resumes on time."""
    runs, spec = _scheduler(speculating).runs, _scheduler(speculating).speculator
    assert runs is not None and spec is not None
    before = runs.runs
    params = [{**PLAIN, "max_new_tokens": n} for n in NEW_TOKENS]
    skipped = spec.counters.skipped_batches
    assert _generate(speculating, params) == _generate(speculating, params, runs=False)  # 6 rows > max_batch
    assert spec.counters.skipped_batches > skipped and runs.runs > before
    before, verified = runs.runs, spec.counters.verify_steps
    alone = _one_at_a_time(speculating, runs=True)
    assert [ids for ids, _ in alone] == [ids for ids, _ in _one_at_a_time(speculating, runs=False)]
    assert runs.runs > before and spec.counters.verify_steps > verified  # rests ran as runs, and it drafted again
    assert all(steps > 0 for _, steps in alone), "a request stopped drafting after its first rest"


def test_settings(tiny_chat_folder: str) -> None:
    for bad in (0, -2, "many"):
        with pytest.raises(ConfigError, match="scheduler.decode_steps"):
            Engine(None, {**TINY_OVERRIDES, "model.path": tiny_chat_folder, "scheduler.decode_steps": bad})
    with pytest.raises(ConfigError, match="decode_steps: 4 needs the native CPU decode step"):
        Engine(None, {**TINY_OVERRIDES, "model.path": tiny_chat_folder, "scheduler.decode_steps": 4})
    auto = Engine(None, {**TINY_OVERRIDES, "model.path": tiny_chat_folder})  # no native step: no runs
    try:
        assert _scheduler(auto).runs is None
    finally:
        auto.shutdown()
    assert decode_runs.resolve("auto", None, overlap=False) is None
    assert decode_runs.resolve(1, None, overlap=False) is None


def test_auto_runs_shorten_as_the_batch_grows(engine: Engine) -> None:
    """auto: 8 steps, at most 32 row-steps a run (8 rows: 4 steps; beyond 16 rows: none);
    a run also stops at max_tokens, the context and the free pages."""
    graphs = engine.engine.parts.runner.graphs  # type: ignore[attr-defined]
    runs = decode_runs.resolve("auto", graphs, overlap=False)
    assert runs is not None and (runs.steps, runs.row_steps) == (8, 32)
    assert decode_runs.resolve("auto", graphs, overlap=True) is None
    params = SamplingParams(temperature=0, max_new_tokens=100)

    def chunks(rows: int, made: int = 0) -> list[Any]:
        reqs = [SimpleNamespace(params=params, grammar=None, audit_logprobs=False, output_ids=[0] * made,
                                total_len=40, kv_len=39, pages=[0] * 10) for _ in range(rows)]
        return [SimpleNamespace(req=r, length=1, samples=True, draft=()) for r in reqs]

    def length(rows: int, made: int = 0, free: int = 100, context: int = 1000) -> int:
        c = chunks(rows, made)
        return runs.length(c, [x.req for x in c], 0, free, 4, context)  # type: ignore[arg-type]

    assert [length(n) for n in (1, 4, 8, 16, 17)] == [8, 8, 4, 2, 1]
    assert length(1, made=97) == 3  # max_tokens
    assert length(1, context=43) == 3  # the context
    # pages: 10 own hold 40 keys (KV at 39 .. 39 + steps - 1); a page more each holds up to 44
    assert (length(2, free=2), length(2, free=1)) == (5, 1)
    c = chunks(2)
    assert runs.length(c, [x.req for x in c], 1, 100, 4, 1000) == 1  # one waiting: no run  # type: ignore[arg-type]
