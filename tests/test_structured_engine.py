"""Structured outputs on the engine: regex, ebnf and json_schema through the offline
Engine, and a request whose grammar is still compiling parked (not queued) while
others run, then queued, aborted or failed without leaking anything."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import AsyncIterator
from typing import Any

import jsonschema
import pytest

from kernel.async_engine import AsyncEngine
from kernel.sampling_params import SamplingParams
from kernel.structured.grammar import GrammarCompiler, GrammarError
from tests.conftest import TINY_OVERRIDES
from tests.structured_cases import CASES, MAX_TOKENS, follows

GREEDY = {"temperature": 0, "max_new_tokens": MAX_TOKENS}


def test_offline_engine_regex_ebnf_and_json_schema(tiny_engine: Any) -> None:
    regex = r"[0-9]{3}-[a-z]{2,4}"
    ebnf = 'root ::= "yes" | "no" | "maybe " digit\ndigit ::= [0-9]'
    prompt, schema = CASES[7]
    outs = tiny_engine.generate(["Code:", "Answer:", prompt], [
        {**GREEDY, "regex": regex}, {"temperature": 1.0, "seed": 3, "max_new_tokens": 8, "ebnf": ebnf},
        {**GREEDY, "json_schema": json.dumps(schema)},
    ])
    assert re.fullmatch(regex, outs[0]["text"]) and outs[0]["meta_info"]["finish_reason"] == "stop"
    assert re.fullmatch(r"yes|no|maybe [0-9]", outs[1]["text"]) and outs[1]["meta_info"]["finish_reason"] == "stop"
    follows(outs[2]["text"], outs[2]["meta_info"]["finish_reason"], schema)
    jsonschema.validate(json.loads(outs[2]["text"]), schema)


def test_offline_engine_refuses_a_bad_grammar_before_queueing_any(tiny_engine: Any) -> None:
    with pytest.raises(GrammarError, match="regex cannot be compiled"):
        tiny_engine.generate(["a", "b"], [GREEDY, {**GREEDY, "regex": "(("}])
    assert tiny_engine.engine.num_requests() == 0


class Gate:
    """Holds every grammar compilation until `open()` (on the worker thread)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.event = threading.Event()
        self.entered = threading.Event()
        compile_ = GrammarCompiler.compile

        def held(compiler: GrammarCompiler, key: tuple[str, str]) -> Any:
            self.entered.set()
            assert self.event.wait(30)
            return compile_(compiler, key)

        monkeypatch.setattr(GrammarCompiler, "compile", held)

    def open(self) -> None:
        self.event.set()


@pytest.fixture
async def engine(tiny_chat_folder: str) -> AsyncIterator[AsyncEngine]:
    eng = await AsyncEngine.create(None, {"model.path": tiny_chat_folder, **TINY_OVERRIDES})
    yield eng
    await eng.shutdown()


async def test_a_request_waiting_for_its_grammar_is_parked_while_others_run(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = Gate(monkeypatch)
    prompt, schema = CASES[2]
    rid = engine.add_request(prompt, {**GREEDY, "json_schema": json.dumps(schema)})
    assert not engine.scheduler.waiting and engine.num_requests() == 1 and not engine.is_idle()
    plain = await engine.generate("hello there", {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
    assert plain["meta_info"]["completion_tokens"] == 8  # ran to the end while the grammar waited
    await asyncio.get_running_loop().run_in_executor(None, gate.entered.wait, 30)
    assert not engine.scheduler.waiting and rid not in {r.rid for r in engine.scheduler.running}  # still parked
    gate.open()
    out = await engine.collect(rid)
    follows(out["text"], out["meta_info"]["finish_reason"], schema)


async def test_aborting_a_parked_request_ends_it_and_leaks_nothing(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = Gate(monkeypatch)
    rid = engine.add_request("hi", {**GREEDY, "regex": "[a-z]{4}"})
    collecting = asyncio.ensure_future(engine.collect(rid))
    await asyncio.sleep(0)
    engine.abort(rid)
    out = await collecting
    assert out["meta_info"]["finish_reason"] == "abort" and out["output_ids"] == []
    gate.open()
    for _ in range(200):  # the compilation lands, and the request is not queued after all
        if engine.is_idle():
            break
        await asyncio.sleep(0.01)
    assert engine.is_idle() and not engine.scheduler.waiting


async def test_a_parked_request_whose_grammar_fails_gets_the_error(engine: AsyncEngine) -> None:
    rid = engine.add_request("hi", {**GREEDY, "ebnf": "root ::= ("})  # not prepared: parked, then failed
    with pytest.raises(GrammarError, match="ebnf cannot be compiled"):
        await engine.collect(rid)
    assert engine.is_idle()


async def test_a_model_without_a_tokenizer_refuses_grammars(tmp_path: Any) -> None:
    from tests.tiny_models import build_tiny

    eng = await AsyncEngine.create(None, {"model.path": str(build_tiny("llama", tmp_path)), **TINY_OVERRIDES})
    try:
        with pytest.raises(GrammarError, match="regex needs the model's tokenizer, and this model has none"):
            await eng.prepare_grammars([SamplingParams(regex="a+")])
        with pytest.raises(GrammarError, match="needs the model's tokenizer"):
            eng.add_request([1, 2, 3], {"regex": "a+"})
        assert eng.is_idle()
    finally:
        await eng.shutdown()
