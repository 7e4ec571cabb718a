"""Tools on /v1/chat/completions against the real server: malformed tools and choices are
400s naming the field, answered while a good request generates undisturbed and without
leaking anything (the `server` fixture waits for an idle, page-complete pool); tool
messages go back through the template; tool_choice none hides the tools."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest
from openai import OpenAI

from tests.test_http_errors import _send
from tests.test_http_fixtures import GOOD, InFlight, ServerProcess, post

pytest_plugins = ["tests.test_http_fixtures"]

CHAT, C = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}


def fn(**function: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": function}]


BAD: list[tuple[dict[str, Any], str]] = [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [5]}, "tools[0]"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": fn(description="no name")}, "tools[0].function.name"),
    ({"tools": fn(name="get weather")}, "tools[0].function.name"),
    ({"tools": fn(name="f", description=5)}, "tools[0].function.description"),
    ({"tools": fn(name="f", strict="yes")}, "tools[0].function.strict"),
    ({"tools": fn(name="f", parameters=[1])}, "tools[0].function.parameters"),
    ({"tools": fn(name="f", parameters={"type": "string"})}, "tools[0].function.parameters"),
    ({"tools": fn(name="f", parameters={"type": "object", "properties": 5})}, "tools[0].function.parameters"),
    ({"tools": fn(name="f", parameters={"type": "object", "required": "city"})}, "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER] * 129}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice.function.name"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "call_x", "content": "sunny"}]}, "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
]


async def test_malformed_tools_are_400s_and_a_good_request_is_unaffected(server: ServerProcess) -> None:
    expected = post(server, C, GOOD).json()["choices"][0]["text"]
    async with aiohttp.ClientSession() as session, InFlight(server.url + C) as good:
        results = await asyncio.gather(*(
            _send(session, server.url + CHAT, {"messages": USER, "max_tokens": 4, **body}) for body, _ in BAD))
        assert server.info()["pool"]["running"] == 1 and not good.finished  # refused while it generated
        assert await good.text() == expected
    for (body, param), (status, err) in zip(BAD, results):
        assert status == 400, (body, err)
        assert set(err["error"]) == {"message", "type", "param", "code"}, err
        assert err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error", (body, err)
    messages = [err["error"]["message"] for _, err in results]
    assert "not a valid JSON Schema" in messages[10] and "not a valid JSON Schema" in messages[11]  # meta-schema
    assert "'nope'" in messages[18] and "['get_weather']" in messages[18]


def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def test_the_openai_client_sees_the_400(server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(server).chat.completions.create(
            model=server.info()["model"], messages=USER, max_tokens=4,  # type: ignore[arg-type]
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}],
        )
    assert info.value.param == "tools[0].function.parameters"


def prompt_tokens(server: ServerProcess, **kw: Any) -> int:
    out = client(server).chat.completions.create(model=server.info()["model"], messages=kw.pop("messages", USER),
                                                 max_tokens=2, temperature=0, **kw)
    assert out.usage is not None
    return out.usage.prompt_tokens


def test_tools_are_rendered_unless_tool_choice_is_none(server: ServerProcess) -> None:
    plain = prompt_tokens(server)
    assert prompt_tokens(server, tools=[WEATHER], tool_choice="none") == plain
    assert prompt_tokens(server, tools=[WEATHER]) > plain + 50  # auto: the functions are in the prompt


def test_a_tool_round_trip_goes_back_through_the_template(server: ServerProcess) -> None:
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    out = client(server).chat.completions.create(model=server.info()["model"], messages=history, tools=[WEATHER],
                                                 max_tokens=4, temperature=0)
    assert out.choices[0].message.role == "assistant"
    tokens = post(server, "/v1/tokenize", {"messages": history[:1]}).json()["count"]
    assert out.usage is not None and out.usage.prompt_tokens > tokens + 20  # the call and its answer were rendered
