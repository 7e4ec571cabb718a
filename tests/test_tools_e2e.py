"""Forced tool calls end to end, through the official `openai` client on an in-process
server with the tiny chat model: tool_choice "required" and a named function generate
the call under its JSON Schema (plugins/http/tool_schema.py), so `arguments` always
parses and validates against the chosen function's parameters, whole and streamed."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessage

from kernel.sampling_params import SamplingParams
from plugins.http import tool_schema
from plugins.http.errors import APIError
from plugins.http.tools import NO_PARAMETERS, Function, parse_tool_use
from tests.inprocess import Client, record_seeds, serve_http
from tests.test_tools_prompt import TOOLS_TEMPLATE

MESSAGES: list[Any] = [{"role": "user", "content": "Call a tool."}]
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "required": ["a", "b"],
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "tree", "parameters": {  # a local $ref: moved with the schema
        "type": "object", "required": ["leaf", "tags"],
        "$defs": {"leaf": {"type": "object", "required": ["v"], "properties": {"v": {"type": "integer",
                                                                                     "minimum": 0, "maximum": 9}}}},
        "properties": {"leaf": {"$ref": "#/$defs/leaf"},
                       "tags": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"enum": ["x", "y"]}}}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SEEDS = range(3)


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def openai_client(http: Client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="x", max_retries=0)


def check_call(message: ChatCompletionMessage, finish: str | None, name: str | None = None) -> tuple[str, Any]:
    """One call whose arguments validate against its function's schema; (name, arguments)."""
    assert finish == "tool_calls" and message.content is None and message.tool_calls is not None
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in SCHEMAS and (name is None or call.function.name == name)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return call.function.name, arguments


async def forced(client: openai.AsyncOpenAI, model: str, choice: Any, seed: int, stream: bool) -> tuple[str, Any]:
    args: dict[str, Any] = {"model": model, "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice,
                            "temperature": 1.0, "seed": seed, "max_tokens": 120}
    if not stream:
        out = await client.chat.completions.create(**args)
        return check_call(out.choices[0].message, out.choices[0].finish_reason,
                          None if isinstance(choice, str) else choice["function"]["name"])
    async with client.chat.completions.stream(**args) as events:  # the client adds up the deltas
        final = await events.get_final_completion()
    return check_call(final.choices[0].message, final.choices[0].finish_reason,
                      None if isinstance(choice, str) else choice["function"]["name"])


CHOICES = ["required", named("get_weather"), named("add"), named("tree")]


async def test_forced_calls_validate_whole_and_streamed(tiny_chat_folder: str) -> None:
    async with serve_http(tiny_chat_folder) as (engine, http):
        client, model = openai_client(http), engine.info.model_name
        chosen = set()
        for choice in CHOICES:
            for seed in SEEDS:
                whole = await forced(client, model, choice, seed, stream=False)
                assert await forced(client, model, choice, seed, stream=True) == whole  # same seed, same call
                chosen.add(whole[0])
        assert chosen == set(SCHEMAS)  # "required" is not stuck on one function, and each named one is called


async def test_a_forced_call_is_unaffected_by_malformed_ones_beside_it(tiny_chat_folder: str) -> None:
    async with serve_http(tiny_chat_folder) as (engine, http):
        client, model = openai_client(http), engine.info.model_name
        alone = await forced(client, model, "required", 7, stream=False)
        bad = [{"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                        "properties": 5}}}]},
               {"tools": TOOLS, "tool_choice": named("missing")}, {"tools": "x", "tool_choice": "required"}]

        async def refused(extra: dict[str, Any]) -> str:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, **extra)
            return str(info.value.param)

        together = await asyncio.gather(forced(client, model, "required", 7, stream=True), *map(refused, bad))
        assert together[0] == alone
        assert together[1:] == ["tools[0].function.parameters", "tool_choice.function.name", "tools"]


async def test_planted_bug_dropping_the_parameters_schema_is_caught(
    tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The validation above is not vacuous: with the function's parameters left out of
    the call schema (as if the function had none), the arguments do not validate."""
    real = tool_schema.call_object

    def without_parameters(function: Function, at: str) -> dict[str, Any]:
        return real(dataclasses.replace(function, parameters=NO_PARAMETERS), at)

    monkeypatch.setattr(tool_schema, "call_object", without_parameters)
    async with serve_http(tiny_chat_folder) as (engine, http):
        client, model = openai_client(http), engine.info.model_name
        failures = 0
        for seed in SEEDS:
            try:
                await forced(client, model, "required", seed, stream=False)
            except jsonschema.ValidationError:
                failures += 1
        assert failures == len(SEEDS)


def test_a_forced_call_cannot_be_combined_with_another_grammar() -> None:
    use = parse_tool_use({"tools": TOOLS, "tool_choice": "required"})
    with pytest.raises(APIError) as info:
        tool_schema.with_forced_call(SamplingParams(regex="a+"), use)
    assert info.value.status == 400 and info.value.param == "tool_choice"
    with pytest.raises(APIError) as info:
        tool_schema.with_forced_call(SamplingParams(json_schema='{"type": "object"}'), use)
    assert "response_format" in info.value.message  # the chat client's name for it
    auto = parse_tool_use({"tools": TOOLS})
    assert tool_schema.with_forced_call(SamplingParams(), auto) == SamplingParams()  # auto: nothing forced


async def test_a_tools_aware_template_renders_the_request_tools(tiny_chat_folder: str, tmp_path: Path) -> None:
    """A checkpoint whose template reads `tools` gets them (and the tool messages) itself:
    the prompt the server counted is the template's own rendering, not the fallback's."""
    folder = tmp_path / "tools_aware"
    shutil.copytree(tiny_chat_folder, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": true}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    async with serve_http(str(folder)) as (engine, http):
        tokenizer = engine.tokenizer
        assert tokenizer is not None
        expected = tokenizer.encode(tokenizer.apply_chat_template(
            [*MESSAGES, {**history[1], "content": "", "tool_calls": [{**history[1]["tool_calls"][0], "function": {
                "name": "add", "arguments": {"a": 1, "b": True}}}]}, history[2]], tools=TOOLS))
        out = await openai_client(http).chat.completions.create(
            model=engine.info.model_name, messages=history, tools=TOOLS, tool_choice=named("add"), max_tokens=60)
        assert out.usage is not None and out.usage.prompt_tokens == len(expected)
        check_call(out.choices[0].message, out.choices[0].finish_reason, "add")


async def test_each_of_n_choices_is_its_own_call_and_logprobs_follow_the_tokens(
    tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serve_http(tiny_chat_folder) as (engine, http):
        seeds = record_seeds(engine, monkeypatch)
        client, model = openai_client(http), engine.info.model_name
        out = await client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                   n=3, temperature=1.0, seed=3, max_tokens=120)
        calls = [check_call(c.message, c.finish_reason) for c in out.choices]
        assert len(calls) == 3 and seeds == [3, 4, 5]  # seed + j per choice: its own draw, each a call
        stream = await client.chat.completions.create(
            model=model, messages=MESSAGES, tools=TOOLS, tool_choice=named("add"), max_tokens=60, logprobs=True,
            stream=True, stream_options={"include_usage": True})
        entries, usage = 0, None
        async for event in stream:
            for choice in event.choices:
                entries += len(choice.logprobs.content or []) if choice.logprobs else 0
            usage = event.usage or usage
        assert usage is not None and entries == usage.completion_tokens > 0
