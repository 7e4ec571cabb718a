"""Engine behaviour on a tiny random Llama with SmolLM2's tokenizer: API shape, stops,
seeds, logprobs, bad input, retraction and aborts."""

from __future__ import annotations

import asyncio

import pytest

from gpu import sampling
from kernel import AsyncEngine, Engine
from kernel.async_engine import RequestError
from kernel.sampling_params import SamplingParams, SamplingParamsError
from tests.conftest import TINY_OVERRIDES

GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def test_generate_returns_text_ids_and_meta(tiny_engine: Engine) -> None:
    out = tiny_engine.generate("Hello there", {**GREEDY, "return_logprob": True})
    assert isinstance(out, dict)
    meta = out["meta_info"]
    assert meta["completion_tokens"] == len(out["output_ids"]) == 24
    assert meta["prompt_tokens"] == len(tiny_engine.tokenizer.encode("Hello there"))
    assert meta["cached_tokens"] == 0 and meta["finish_reason"] == "length"
    assert [t for _, t in meta["output_token_logprobs"]] == out["output_ids"]
    assert out["text"] == tiny_engine.tokenizer.decode(out["output_ids"])
    many = tiny_engine.generate(["a", [5, 6, 7]], [GREEDY, {**GREEDY, "max_new_tokens": 3}])
    assert isinstance(many, list) and [m["meta_info"]["completion_tokens"] for m in many] == [24, 3]


def test_stop_string_is_cut_and_not_emitted(tiny_engine: Engine) -> None:
    full = tiny_engine.generate("The weather", GREEDY)["text"]  # type: ignore[index]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop and stop in full
    out = tiny_engine.generate("The weather", {**GREEDY, "stop": [stop]})
    assert isinstance(out, dict)
    assert out["text"] == full[: full.index(stop)]
    assert out["meta_info"]["finish_reason"] == "stop"
    assert out["meta_info"]["matched_stop"] == stop


def test_stop_token_ids_and_eos(tiny_engine: Engine) -> None:
    ids = tiny_engine.generate("Stop here", GREEDY)["output_ids"]  # type: ignore[index]
    target = ids[5]
    out = tiny_engine.generate("Stop here", {**GREEDY, "stop_token_ids": [target]})
    assert isinstance(out, dict)
    assert out["output_ids"] == ids[: ids.index(target) + 1]
    assert out["meta_info"]["finish_reason"] == "stop" and out["meta_info"]["matched_stop"] == target


def test_same_seed_same_tokens_whatever_the_batch(tiny_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    params = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 1234, "ignore_eos": True}
    alone = tiny_engine.generate("Once upon", params)
    others = [{"max_new_tokens": 10 + i, "temperature": 0.7, "seed": i} for i in range(7)]
    batch = tiny_engine.generate(["x" * (i + 1) for i in range(7)] + ["Once upon"], others + [params])
    assert batch[-1]["output_ids"] == alone["output_ids"]  # type: ignore[index]
    # Another seed is another stream of draws: the sampler keys its draws by that seed (what
    # ran, not whether the tokens happen to differ).
    seeds: list[int] = []
    mix_seed = sampling.mix_seed
    monkeypatch.setattr(sampling, "mix_seed", lambda seed, step: seeds.append(seed) or mix_seed(seed, step))
    tiny_engine.generate("Once upon", {**params, "seed": 99})
    assert seeds and set(seeds) == {99}, seeds


def test_top_logprobs(tiny_engine: Engine) -> None:
    out = tiny_engine.generate("Hi", {**GREEDY, "max_new_tokens": 4, "return_logprob": True, "top_logprobs_num": 3})
    assert isinstance(out, dict)
    tops = out["meta_info"]["output_top_logprobs"]
    assert len(tops) == 4
    for (lp, tok), top in zip(out["meta_info"]["output_token_logprobs"], tops):
        assert len(top) == 3
        assert top[0][0] == tok and top[0][1] == pytest.approx(lp)
        assert top[0][1] >= top[1][1] >= top[2][1]


@pytest.mark.parametrize(
    "prompt, params, error",
    [
        ("ok", {"temperature": -1}, SamplingParamsError),
        ("ok", {"top_p": 0}, SamplingParamsError),
        ("ok", {"max_new_tokens": -5}, SamplingParamsError),
        ("ok", {"bogus": 1}, SamplingParamsError),
        ("", {}, RequestError),
        ([], {}, RequestError),
        ([1, 2, 10**9], {}, RequestError),
        ("ok", {"max_new_tokens": 5000}, RequestError),  # beyond the 2048-token context
    ],
)
def test_bad_input_is_refused_and_changes_nothing(tiny_engine: Engine, prompt, params, error) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error):
        tiny_engine.generate(["fine prompt", prompt], [GREEDY, params])
    # The good request of the same call was not left behind, and the engine still works.
    assert tiny_engine.engine.is_idle()
    assert tiny_engine.generate("still fine", GREEDY)["meta_info"]["completion_tokens"] == 24  # type: ignore[index]


def test_retraction_under_pool_pressure_loses_nothing(tiny_chat_folder: str, tiny_det_engine: Engine) -> None:
    """Deterministic mode: a retracted request recomputes in other batches, and `==` holds there only."""
    prompts = [[100 + i * 7 + j for j in range(10 + i)] for i in range(6)]
    params = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True, "return_logprob": True}
    expected = tiny_det_engine.generate(prompts, params)
    # 24 usable pages of 4 tokens = 96 tokens for 6 requests that grow to ~42 tokens each.
    small = Engine(None, {"model.path": tiny_chat_folder, **TINY_OVERRIDES, "cache.num_pages": 25,
                          "deterministic": True})
    try:
        got = small.generate(prompts, params)
        sched = small.engine.scheduler
        assert sched.num_retractions > 0
        for e, g in zip(expected, got):  # type: ignore[arg-type]
            assert g["output_ids"] == e["output_ids"]
            assert g["meta_info"]["completion_tokens"] == 30
        assert sched.allocator.num_free == sched.allocator.num_usable
    finally:
        small.shutdown()


async def test_stream_abort_returns_pages(tiny_chat_folder: str) -> None:
    engine = await AsyncEngine.create(None, {"model.path": tiny_chat_folder, **TINY_OVERRIDES})
    try:
        keep = engine.add_request("keep going", SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True))
        cut = engine.add_request("cut me off", SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True))
        seen = 0
        async for chunk in engine.stream(cut):
            seen += len(chunk.token_ids)
            if seen >= 3:
                break  # leaving the stream aborts the request
        result = await engine.collect(keep)
        assert result["meta_info"]["completion_tokens"] == 40
        for _ in range(200):
            if engine.is_idle():
                break
            await asyncio.sleep(0.01)
        sched = engine.scheduler
        assert engine.is_idle()
        assert sched.allocator.num_free == sched.allocator.num_usable
    finally:
        await engine.shutdown()


def test_failed_step_fails_its_requests_and_frees_pages(tiny_engine: Engine) -> None:
    runner = tiny_engine.engine.parts.runner
    real_run = runner.run
    calls = {"n": 0}

    def flaky(batch):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("planted device failure")
        return real_run(batch)

    runner.run = flaky  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="planted device failure"):
            tiny_engine.generate(["one", "two"], GREEDY)
    finally:
        runner.run = real_run  # type: ignore[method-assign]
    # The engine keeps serving, and nothing the failed requests held stays allocated.
    assert tiny_engine.generate("after", GREEDY)["meta_info"]["completion_tokens"] == 24  # type: ignore[index]


def test_lifecycle_events_in_order(tiny_engine: Engine) -> None:
    seen: list[tuple[str, str]] = []
    unsubscribe = tiny_engine.engine.events.subscribe(lambda e: seen.append((e.kind, e.rid)))
    try:
        out = tiny_engine.generate("events please", {**GREEDY, "max_new_tokens": 3})
    finally:
        unsubscribe()
    rid = out["meta_info"]["id"]  # type: ignore[index]
    kinds = [k for k, r in seen if r == rid]
    assert kinds[:2] == ["queued", "admitted"] and kinds[-1] == "finished"
    assert kinds.count("finished") == 1 and kinds.count("tokens") == 3


def test_zero_max_new_tokens_generates_nothing(tiny_engine: Engine) -> None:
    out = tiny_engine.generate("nothing", {"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["text"] == ""  # type: ignore[index]
    assert out["meta_info"]["finish_reason"] == "length"  # type: ignore[index]


def test_lifecycle_log_lines(tiny_engine: Engine) -> None:
    from structlog.testing import capture_logs

    from kernel.results.events import log_lifecycle

    unsubscribe = tiny_engine.engine.events.subscribe(log_lifecycle)
    try:
        with capture_logs() as logs:
            out = tiny_engine.generate("log me", {**GREEDY, "max_new_tokens": 4})
    finally:
        unsubscribe()
    rid = out["meta_info"]["id"]  # type: ignore[index]
    mine = [entry["event"] for entry in logs if entry.get("rid") == rid]
    assert mine == ["request_queued", "request_admitted", "request_first_token", "request_finished"]


async def test_abort_from_outside_ends_the_consumers_stream(tiny_chat_folder: str) -> None:
    engine = await AsyncEngine.create(None, {"model.path": tiny_chat_folder, **TINY_OVERRIDES})
    try:
        params = SamplingParams(max_new_tokens=300, temperature=0, ignore_eos=True)
        queued = [engine.add_request("busy", params) for _ in range(TINY_OVERRIDES["scheduler.max_running_requests"])]
        waiting = engine.add_request("never admitted", params)  # behind a full batch
        running = queued[0]
        consumers = [asyncio.create_task(engine.collect(rid)) for rid in (waiting, running)]
        await asyncio.sleep(0.05)
        for rid in [waiting, *queued]:
            engine.abort(rid)
        results = await asyncio.wait_for(asyncio.gather(*consumers), timeout=10)
        assert [r["meta_info"]["finish_reason"] for r in results] == ["abort", "abort"]
        assert results[0]["output_ids"] == []
    finally:
        await engine.shutdown()
