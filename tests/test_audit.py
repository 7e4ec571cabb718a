"""The online audit (kernel/audit.py): served cache hits replayed cold and compared.

The verdict rule on its own; then engines on the tiny model: a clean run checks its hits
and finds nothing, and the replays leave the cache and the served-traffic counters as
they were; a planted stale page on the hit path is caught (the metric moves, the last
mismatch names the request) while the server keeps serving.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from kernel import Engine
from kernel.audit import Replayed, Served, compare, deepest_tier
from kernel.config import ConfigError, load_config
from kernel.sampling_params import SamplingParams
from kernel.scheduling.prefix_reuse import PrefixReuse
from plugins.metrics import counters
from tests import leaks
from tests.conftest import TINY_OVERRIDES

PARAMS = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "return_logprob": True}
SAMPLED = {**PARAMS, "temperature": 0.9, "top_p": 0.9}  # unseeded: the audit replays the drawn seed


def job(tokens: list[int], logprobs: list[float] | None) -> Served:
    return Served("r", [1, 2], SamplingParams(), None, "host", tokens, logprobs)


def test_verdicts() -> None:
    same = job([5, 6, 7], [-0.5, -0.25, -1.0])
    assert compare(same, Replayed([5, 6, 7], [-0.5, -0.25, -1.0]), True, 0.0) == (False, False, None)
    one_bit = Replayed([5, 6, 7], [-0.5, -0.25000003, -1.0])
    assert compare(same, one_bit, True, 0.0) == (True, False, 1)  # bitwise: any bit
    assert compare(same, one_bit, False, 1e-3) == (False, False, None)  # within the tolerance
    parted = Replayed([5, 9, 7], [-0.5, -0.7, -1.0])
    assert compare(same, parted, True, 0.0) == (True, True, 1)
    assert compare(same, parted, False, 1e-3) == (False, True, 1)  # a near tie may flip outside deterministic mode
    off_before = Replayed([5, 9, 7], [-0.6, -0.7, -1.0])
    assert compare(same, off_before, False, 1e-3) == (True, True, 0)
    shorter = Replayed([5, 6], [-0.5, -0.25])
    assert compare(same, shorter, True, 0.0) == (True, True, 2)
    assert compare(job([5, 6, 7], None), Replayed([5, 6, 7], [0.0] * 3), True, 0.0).mismatch is False


def test_deepest_tier() -> None:
    assert deepest_tier({"device": 8, "host": 0, "storage": 0}) == "device"
    assert deepest_tier({"device": 8, "host": 4, "storage": 0}) == "host"
    assert deepest_tier({"device": 0, "host": 4, "storage": 4}) == "storage"


@pytest.mark.parametrize("bad", [{"audit.sample_rate": 1.5}, {"audit.queue": 0}, {"audit.tolerance": -1.0}])
def test_bad_config(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="audit"):
        load_config(None, bad)


def make(folder: str, rate: float, **extra: Any) -> Engine:
    return Engine(None, {"model.path": folder, **TINY_OVERRIDES, "deterministic": True, "cache.prefix": "radix",
                         "audit.sample_rate": rate, **extra})


def wait_audit(engine: Engine, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        audit: dict[str, Any] = engine.engine.stats()["audit"]
        if audit["pending"] == 0 or time.monotonic() > deadline:
            return audit
        time.sleep(0.02)


def conversation(seed: int) -> list[list[int]]:
    """Three prompts, each extending the one before: turns 2 and 3 hit the cache."""
    rng = random.Random(seed)
    first = [rng.randint(50, 40000) for _ in range(21)]
    second = first + [rng.randint(50, 40000) for _ in range(9)]
    return [first, second, second + [rng.randint(50, 40000) for _ in range(6)]]


def serve(engine: Engine, prompts: list[list[int]]) -> list[dict[str, Any]]:
    return [engine.generate(p, PARAMS if i % 2 == 0 else SAMPLED) for i, p in enumerate(prompts)]  # type: ignore[misc]


def test_clean_hits_check_out_and_leave_the_cache_alone(tiny_chat_folder: str) -> None:
    prompts = conversation(1) + conversation(2)
    audited, plain = make(tiny_chat_folder, 1.0), make(tiny_chat_folder, 0.0)
    try:
        outs = serve(audited, prompts)
        audit = wait_audit(audited)
        hits = sum(1 for o in outs if o["meta_info"]["cached_tokens"] > 0)
        assert hits == 4
        assert audit["checked"] == {"device": hits, "host": 0, "storage": 0}, audit
        assert sum(audit["mismatched"].values()) == 0 and audit["errors"] == 0, audit
        assert audit["last_mismatch"] is None
        # The replays ran cold and cached nothing: the same counters and cache as an engine
        # that served the same requests without an audit.
        again = serve(plain, prompts)
        assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
        assert [o["meta_info"]["output_token_logprobs"] for o in again] == [
            o["meta_info"]["output_token_logprobs"] for o in outs]
        a, p = audited.engine.stats(), plain.engine.stats()
        assert a["cache"] == p["cache"] and a["counters"]["prompt_tokens"] == p["counters"]["prompt_tokens"]
        assert a["counters"]["generation_tokens"] == p["counters"]["generation_tokens"]
        assert a["pages"] == p["pages"]
        assert plain.engine.stats()["audit"] is None
    finally:
        audited.shutdown()
        plain.shutdown()


def stale_second_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: a hit maps its first cached page where its second belongs (a stale page
    table entry); the request's own accounting is untouched."""
    real = PrefixReuse.match

    def stale(self: PrefixReuse, req: Any) -> None:
        real(self, req)
        if req.shared_pages >= 2:
            self.req_table.write_pages(req.row, 1, [req.pages[0]], self.page_size)

    monkeypatch.setattr(PrefixReuse, "match", stale)


def test_red_a_stale_page_is_caught_and_serving_goes_on(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make(tiny_chat_folder, 1.0, **{"debug.check_invariants": False})
    stale_second_page(monkeypatch)
    try:
        serve(engine, conversation(3))
        audit = wait_audit(engine)
        assert audit["mismatched"]["device"] >= 1, audit
        last = audit["last_mismatch"]
        assert last is not None and last["tier"] == "device" and last["first_divergence"] is not None
        assert last["served_logprobs"] != last["replay_logprobs"] or last["served_tokens"] != last["replay_tokens"]
        metrics = {m.name: m for m in counters(engine.engine.stats())}
        mismatched = {s.labels["tier"]: s.value for s in metrics["tierserve_audit_mismatched"].samples}
        assert mismatched["device"] >= 1
        # Still serving: a request with no hit completes as usual.
        out = engine.generate([7, 8, 9, 10, 11], PARAMS)
        assert isinstance(out, dict) and len(out["output_ids"]) == PARAMS["max_new_tokens"]
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()


def test_red_a_replay_that_may_hit_the_cache_finds_nothing(tiny_chat_folder: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Why replays run cold: planted, a replay matches the cache like any request; it then
    reads the same stale page as the request it checks, and the audit is blind to it."""
    engine = make(tiny_chat_folder, 1.0, **{"debug.check_invariants": False})
    stale_second_page(monkeypatch)
    real = PrefixReuse._matchable

    def hot(self: PrefixReuse, req: Any) -> list[int]:
        audit, req.audit = req.audit, False
        try:
            return real(self, req)
        finally:
            req.audit = audit

    monkeypatch.setattr(PrefixReuse, "_matchable", hot)
    try:
        serve(engine, conversation(3))
        audit = wait_audit(engine)
        assert sum(audit["checked"].values()) >= 2 and sum(audit["mismatched"].values()) == 0, audit
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()


@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer"])
def test_hybrid_hits_check_out(hybrid_folders: dict[str, str], strategy: str) -> None:
    """Qwen3.5 (Gated DeltaNet): a replay runs its recurrent state cold too (no state slot
    matched, none donated to the cache) and equals what the hit served."""
    from tests.conftest import HYBRID_OVERRIDES
    from tests.tiny_hybrid import VOCAB

    engine = Engine(None, {**HYBRID_OVERRIDES, "model.path": hybrid_folders["qwen3_5_text"], "deterministic": True,
                           "cache.state_strategy": strategy, "audit.sample_rate": 1.0})
    rng = random.Random(5)
    first = [rng.randrange(3, VOCAB) for _ in range(37)]
    try:
        for prompt in (first, first + [rng.randrange(3, VOCAB) for _ in range(11)]):
            engine.generate(prompt, PARAMS)
        audit = wait_audit(engine)
        assert audit["checked"]["device"] == 1 and sum(audit["mismatched"].values()) == 0, audit
        assert engine.engine.check() is None
    finally:
        engine.shutdown()


async def test_the_audit_on_metrics_server_info_and_the_admin_stats(tiny_chat_folder: str) -> None:
    """Through the real HTTP app: the counters on /metrics, the audit in /server_info and
    the admin stats, with the official OpenAI client as the traffic."""
    import asyncio

    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from tests.inprocess import serve_http

    overrides = {"deterministic": True, "cache.prefix": "radix", "audit.sample_rate": 1.0}
    async with serve_http(tiny_chat_folder, overrides) as (engine, http):
        client = openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="x", max_retries=0)
        prompt = "The lighthouse keeper counted the ships that passed in the night, one by one, until"
        for tail in ("", " the dawn came"):
            await client.completions.create(model=engine.info.model_name, prompt=prompt + tail, max_tokens=8,
                                            temperature=0, logprobs=1)
        await client.close()
        for _ in range(500):
            info = await (await http.get("/server_info")).json()
            if info["audit"]["pending"] == 0:
                break
            await asyncio.sleep(0.02)
        assert info["audit"]["checked"]["device"] == 1 and info["audit"]["mismatched"]["device"] == 0, info["audit"]
        assert info["audit"]["compare"] == "bitwise"
        assert (await (await http.get("/admin/stats")).json())["audit"]["checked"]["device"] == 1
        samples = {(s.name, s.labels.get("tier")): s.value
                   for f in text_string_to_metric_families(await (await http.get("/metrics")).text())
                   for s in f.samples}
        assert samples[("tierserve_audit_checked_total", "device")] == 1.0
        assert samples[("tierserve_audit_mismatched_total", "host")] == 0.0


def test_outside_deterministic_mode_within_the_tolerance(tiny_chat_folder: str) -> None:
    """Default numerics: hits are checked against the tolerance and say so."""
    engine = make(tiny_chat_folder, 1.0, deterministic=False)
    try:
        serve(engine, conversation(4))
        audit = wait_audit(engine)
        assert audit["compare"] == "logprobs within 0.001"
        assert audit["checked"]["device"] == 2 and sum(audit["mismatched"].values()) == 0, audit
    finally:
        engine.shutdown()
