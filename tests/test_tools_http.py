"""Tools on /v1/chat/completions against the real server: malformed tools and choices are
400s naming the field, answered while a good request's step is held (so it is still
generating) and before any reaches the engine; the good one then finishes undisturbed; tool
messages go back through the template; tool_choice none hides the tools."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import openai
import pytest
from openai import OpenAI

from kernel.async_engine import AsyncEngine
from plugins.http import chat
from plugins.http.tools import ToolUse
from tests.held_steps import hold_a_step
from tests.inprocess import serve_http
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


async def answered_before_the_engine(engine: AsyncEngine, sends: list[Awaitable[Any]]) -> list[Any]:
    """Await `sends` while the good request's step is held: none may reach the engine
    (it would wait on the held step), so the engine holds the good request alone."""
    tasks = [asyncio.ensure_future(send) for send in sends]
    try:
        while not all(t.done() for t in tasks):
            reqs = engine.stats()["requests"]
            assert reqs == {"waiting": 0, "running": 1}, f"a malformed request reached the engine: {reqs}"
            await asyncio.wait(tasks, timeout=0.01)
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            t.cancel()


async def malformed_while_a_good_one_is_held(folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The good request's third step is held until every malformed one is answered."""
    async with serve_http(folder) as (engine, http):
        expected = (await (await http.post(C, json=GOOD)).json())["choices"][0]["text"]
        held, release = hold_a_step(engine, monkeypatch)
        try:
            async with InFlight(str(http.make_url(C))) as good:
                assert await asyncio.to_thread(held.wait, 60), "the good request never reached its third step"
                results = await answered_before_the_engine(engine, [
                    _send(http.session, str(http.make_url(CHAT)), {"messages": USER, "max_tokens": 4, **body})
                    for body, _ in BAD])
                assert not good.finished  # by construction: its step is held
                release.set()
                assert await good.text() == expected
        finally:
            release.set()
    for (body, param), (status, err) in zip(BAD, results):
        assert status == 400, (body, err)
        assert set(err["error"]) == {"message", "type", "param", "code"}, err
        assert err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error", (body, err)
    messages = [err["error"]["message"] for _, err in results]
    assert "not a valid JSON Schema" in messages[10] and "not a valid JSON Schema" in messages[11]  # meta-schema
    assert "'nope'" in messages[18] and "['get_weather']" in messages[18]


async def test_malformed_tools_are_400s_and_a_good_request_is_unaffected(
    tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await malformed_while_a_good_one_is_held(tiny_chat_folder, monkeypatch)


async def test_red_a_malformed_tool_that_reaches_the_engine(
    tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bug: the tool fields are not checked, so those requests are admitted."""
    monkeypatch.setattr(chat, "parse_tool_use", lambda body: ToolUse((), "none", parallel=True))
    with pytest.raises(AssertionError, match="a malformed request reached the engine"):
        await malformed_while_a_good_one_is_held(tiny_chat_folder, monkeypatch)


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
