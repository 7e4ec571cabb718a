"""Structured outputs without a model: the SamplingParams fields, the bitmask applied in
the sampler, the xgrammar compiler over the packaged tokenizer, and the grammar cache."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest
import torch

from gpu.grammar_mask import TokenMask, apply_token_mask, build_token_mask, mask_width
from gpu.loader import resolve_model_path
from gpu.loader.gguf import load_gguf_tokenizer
from gpu.sampling import SamplingBatch, sample
from gpu.tokenizer import Tokenizer
from kernel.sampling_params import SamplingParams, SamplingParamsError
from kernel.structured.grammar import (
    GrammarCache,
    GrammarCompiler,
    GrammarError,
    check_json_schema,
    grammar_key,
)
from tests.conftest import SMOLLM
from tests.structured_cases import allowed_tokens

CPU = torch.device("cpu")


# ---- SamplingParams -----------------------------------------------------------------
def test_a_schema_object_becomes_its_json_text() -> None:
    p = SamplingParams.from_dict({"json_schema": {"type": "object"}})
    assert p.json_schema == '{"type": "object"}' and grammar_key(p) == ("json_schema", p.json_schema)
    assert grammar_key(SamplingParams.from_dict({"regex": "a+"})) == ("regex", "a+")
    assert grammar_key(SamplingParams()) is None


@pytest.mark.parametrize("fields, param", [
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf"),
    ({"json_schema": "{}", "regex": "a"}, "regex"),
    ({"regex": ""}, "regex"),
    ({"ebnf": 5}, "ebnf"),
    ({"json_schema": 3}, "json_schema"),
])
def test_bad_grammar_fields_are_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams.from_dict(fields)
    assert err.value.param == param


# ---- the bitmask in the sampler ---------------------------------------------------
class FixedMask:
    """A masker allowing a fixed set of tokens (what a matcher does, without a grammar)."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        for t in self.allowed:
            word = bitmask[row, t // 32].item()
            bit = 1 << (t % 32)
            value = word | bit
            bitmask[row, t // 32] = value - (1 << 32) if value >= 1 << 31 else value  # as int32


def test_the_mask_keeps_exactly_the_allowed_tokens_of_constrained_rows() -> None:
    vocab, allowed = 70, [0, 31, 32, 63, 69]  # word edges and the sign bit
    mask = build_token_mask([None, FixedMask(allowed), None], vocab, CPU)
    assert mask is not None and mask.rows == [1]
    assert allowed_tokens(mask.bitmask, vocab)[1].nonzero().flatten().tolist() == allowed
    logits = torch.randn(3, vocab)
    out = apply_token_mask(logits, mask)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])  # unconstrained rows untouched
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == allowed
    assert torch.equal(out[1, allowed], logits[1, allowed])


def test_masked_greedy_picks_the_best_allowed_token_and_logprobs_are_of_the_masked_distribution() -> None:
    vocab = 100
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1)) * 3
    before = logits.clone()
    allowed = [7, 40, 99]
    params = [SamplingParams(temperature=0.0, top_logprobs_num=5)] * 3
    batch = SamplingBatch.build(params, [0] * 3, [0] * 3, [[]] * 3, [[]] * 3, vocab, CPU,
                                maskers=[None, FixedMask(allowed), None])
    out = sample(logits, batch)
    assert torch.equal(logits, before), "sample must not modify its input"
    best = max(allowed, key=lambda t: logits[1, t].item())
    assert out.token_ids == [logits[0].argmax().item(), best, logits[2].argmax().item()]
    masked_lp = torch.log_softmax(logits[1, allowed], -1)
    assert out.logprobs[1] == pytest.approx(masked_lp[allowed.index(best)].item(), abs=1e-5)
    assert sorted(t for t, _ in out.top_logprobs[1][:3]) == allowed  # then -inf entries
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1).max().item(), abs=1e-5)


def test_random_draws_stay_inside_the_mask() -> None:
    vocab, allowed = 64, [3, 5, 60]
    params = [SamplingParams(temperature=1.5, seed=s) for s in range(16)]
    batch = SamplingBatch.build(params, list(range(16)), [0] * 16, [[]] * 16, [[]] * 16, vocab, CPU,
                                maskers=[FixedMask(allowed)] * 16)
    assert set(sample(torch.zeros(16, vocab), batch).token_ids) <= set(allowed)


def test_a_batch_without_constrained_rows_builds_no_mask() -> None:
    batch = SamplingBatch.build([SamplingParams()] * 2, [0, 0], [0, 0], [[], []], [[], []], 10, CPU)
    assert batch.token_mask is None
    logits = torch.randn(2, 10)
    assert apply_token_mask(logits, None) is logits
    mask = TokenMask([1], torch.zeros(2, 1, dtype=torch.int32))  # row 0's zeros are not applied
    out = apply_token_mask(logits, mask)
    assert torch.equal(out[0], logits[0]) and torch.isinf(out[1]).all()


# ---- the compiler over the packaged tokenizer -----------------------------------------
@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = load_gguf_tokenizer(resolve_model_path(SMOLLM))
    assert tok is not None
    return tok


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size + 40)  # lm_head rows past the tokenizer's


def fill(compiler: GrammarCompiler, kind: str, text: str, prefix: str, tokenizer: Tokenizer) -> torch.Tensor:
    grammar = compiler.matcher(compiler.compile((kind, text)))
    for t in tokenizer.encode(prefix, add_special_tokens=False):
        assert grammar.accept(t)
    bitmask = torch.zeros(1, mask_width(compiler.vocab_size), dtype=torch.int32)
    grammar.fill_mask(bitmask, 0)
    return allowed_tokens(bitmask, compiler.vocab_size)[0]


def test_ids_past_the_tokenizer_are_never_allowed_and_eos_only_at_the_end(
    compiler: GrammarCompiler, tokenizer: Tokenizer,
) -> None:
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
    mid = fill(compiler, "json_schema", schema, '{"a": "x', tokenizer)
    assert mid.sum() > 1000 and not mid[tokenizer.vocab_size:].any()
    assert not any(mid[t] for t in tokenizer.eos_token_ids)
    done = fill(compiler, "json_schema", schema, '{"a": "x"}', tokenizer)
    assert set(done.nonzero().flatten().tolist()) == set(tokenizer.eos_token_ids)


def test_a_matcher_terminates_on_eos_once_the_grammar_is_complete(
    compiler: GrammarCompiler, tokenizer: Tokenizer,
) -> None:
    grammar = compiler.matcher(compiler.compile(("regex", "[0-9]{2}")))
    for t in tokenizer.encode("42", add_special_tokens=False):
        assert grammar.accept(t) and not grammar.terminated
    assert not grammar.accept(tokenizer.encode("7", add_special_tokens=False)[0])  # refused: past the end
    assert grammar.accept(min(tokenizer.eos_token_ids)) and grammar.terminated


@pytest.mark.parametrize("kind, text, words", [
    ("regex", "a(b", "regex cannot be compiled: Regex parsing error at position"),
    ("ebnf", 'root ::= "a" |', "ebnf cannot be compiled: EBNF parser error at line 1"),
    ("ebnf", 'start ::= "a"', 'The root rule with name "root" is not found'),
    ("json_schema", '{"type": "object",', "json_schema is not valid JSON: Expecting"),
    ("json_schema", '{"type": "frob"}', "json_schema is not a valid JSON Schema (at type)"),
    ("json_schema", '{"type": "object", "minProperties": -1}', "at minProperties"),
    ("json_schema", '[1]', "json_schema must be a JSON object, got list"),
])
def test_bad_grammars_raise_a_message_naming_the_problem(
    compiler: GrammarCompiler, kind: str, text: str, words: str,
) -> None:
    with pytest.raises(GrammarError) as err:
        compiler.compile((kind, text))
    assert words in str(err.value) and err.value.param == kind
    assert "/project/" not in str(err.value)  # the engine's source location is stripped


def test_check_json_schema_accepts_real_schemas() -> None:
    check_json_schema('{"type": "object", "properties": {"x": {"type": "integer", "maximum": 3}}}')
    check_json_schema("true")


# ---- the cache ----------------------------------------------------------------------
class SlowCompiler:
    """Counts compilations and takes `delay_s` for each, on the worker thread."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.seen: list[tuple[str, str]] = []
        self.threads: set[str] = set()

    def compile(self, key: tuple[str, str]) -> str:
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay_s)
        self.seen.append(key)
        if key[1] == "bad":
            raise GrammarError("regex cannot be compiled: bad", key[0])
        return f"compiled {key[1]}"


def cache_of(compiler: SlowCompiler, capacity: int = 2, max_chars: int = 100) -> GrammarCache:
    return GrammarCache(lambda: compiler, max_chars, capacity, threads=2)  # type: ignore[arg-type,return-value]


async def test_concurrent_requests_share_one_compilation_off_the_loop() -> None:
    compiler = SlowCompiler(delay_s=0.05)
    cache = cache_of(compiler)
    results = await asyncio.gather(*(cache.compile(("regex", "a+")) for _ in range(5)))
    assert results == ["compiled a+"] * 5 and compiler.seen == [("regex", "a+")]
    assert cache.ready(("regex", "a+")) == "compiled a+" and cache.compiles == 1
    assert threading.main_thread().name not in compiler.threads
    cache.shutdown()


async def test_the_cache_keeps_the_most_recent_and_forgets_failures() -> None:
    compiler = SlowCompiler()
    cache = cache_of(compiler, capacity=2)
    for text in ("a", "b", "a", "c"):  # "a" used again before "c": "b" is the one to go
        await cache.compile(("regex", text))
    assert cache.ready(("regex", "a")) and cache.ready(("regex", "c")) and cache.ready(("regex", "b")) is None
    assert cache.ready(("ebnf", "a")) is None  # the kind is part of the key
    for _ in range(2):
        with pytest.raises(GrammarError):
            await cache.compile(("regex", "bad"))
    assert compiler.seen.count(("regex", "bad")) == 2  # not kept: tried again
    cache.shutdown()


async def test_text_over_the_limit_is_refused_before_compiling() -> None:
    compiler = SlowCompiler()
    cache = cache_of(compiler, max_chars=10)
    with pytest.raises(GrammarError) as err:
        cache.compile(("ebnf", "x" * 11))
    assert "ebnf is 11 characters, over the limit of 10 (structured.max_grammar_chars)" in str(err.value)
    assert compiler.seen == []
    cache.shutdown()
