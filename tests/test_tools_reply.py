"""The tool-aware chat reply (plugins/http/tool_reply.py) on scripted engine chunks: the
whole response and the stream (its deltas added up as a client does) say the same, in
shapes the official `openai` client parses. The generated text here is scripted; the
end-to-end tests (tests/test_tools_e2e.py) generate it with a model."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from kernel import registry
from kernel.results.output import OutputChunk
from kernel.sampling_params import SamplingParams
from plugins.http.chat import ChatRequest
from plugins.http.choice import Choice
from plugins.http.tool_reply import ToolChatReply
from plugins.http.tools import ToolUse, parse_tool_use

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "add"}},
]
CALL_TEXT = ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')


def use(**body: Any) -> ToolUse:
    return parse_tool_use({"tools": TOOLS, **body})


def reply(tools: ToolUse) -> ToolChatReply:
    engine: Any = SimpleNamespace(tokenizer=None, info=SimpleNamespace(model_name="m"))
    req = ChatRequest([1], 1, SamplingParams(), False, True, False, tools)
    return ToolChatReply(engine, req, registry.lookup("tool_parser", "hermes"))


def chunk(text: str, finished: bool = False, reason: str | None = None) -> OutputChunk:
    return OutputChunk(text, [], [], [], finished, reason, None, 1, 1, 0, {})


def whole(tools: ToolUse, text: str, reason: str = "stop") -> tuple[dict[str, Any], str | None]:
    r = reply(tools)
    choice = Choice(text=text, finish_reason=reason)
    body = {**r.head(r.whole_object), "choices": [r.whole_choice(choice)]}
    parsed = ChatCompletion.model_validate(body)  # the client's own model of the response
    return body["choices"][0]["message"], parsed.choices[0].finish_reason


def streamed(tools: ToolUse, pieces: list[str], reason: str = "stop") -> tuple[dict[str, Any], str | None]:
    """The stream's deltas added up (content joined; calls by index: id, name, arguments)."""
    r = reply(tools)
    deltas = []
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        deltas += r.delta_choices(0, chunk(piece, last, reason if last else None))
    content, calls, finish = "", {}, None
    for d in deltas:
        choice = ChatCompletionChunk.model_validate(r.chunk(d)).choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            slot = calls.setdefault(call.index, {"id": None, "type": None, "function": {"name": None, "arguments": ""}})
            assert call.function is not None
            if call.id is not None:  # only the opening delta names the call
                assert slot["id"] is None
                slot.update(id=call.id, type=call.type)
                slot["function"]["name"] = call.function.name
            slot["function"]["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    message: dict[str, Any] = {"role": "assistant", "content": content or None, "refusal": None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    message = copy.deepcopy(message)
    for call in message.get("tool_calls", []):
        assert call["id"].startswith("call_") and len(call["id"]) == 29
        call["id"] = "-"
    return message


def same(tools: ToolUse, text: str, reason: str = "stop") -> tuple[dict[str, Any], str | None]:
    """The whole reply, checked against streams of it split at every boundary."""
    message, finish = whole(tools, text, reason)
    for cut in range(len(text) + 1):
        got, got_finish = streamed(tools, [text[:cut], text[cut:]], reason)
        assert (without_ids(got), got_finish) == (without_ids(message), finish), cut
    return without_ids(message), finish


def test_auto_reads_hermes_calls_alike_whole_and_streamed() -> None:
    message, finish = same(use(), CALL_TEXT)
    assert finish == "tool_calls" and message["content"] == "I will look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1})]
    assert all(c["type"] == "function" for c in message["tool_calls"])


def test_auto_without_calls_is_plain_content() -> None:
    message, finish = same(use(tool_choice="auto"), "Just text.")
    assert message == {"role": "assistant", "content": "Just text.", "refusal": None} and finish == "stop"


def test_a_call_of_a_function_not_offered_stays_content() -> None:
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    message, finish = same(use(), text)
    assert message["content"] == text and "tool_calls" not in message and finish == "stop"


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    message, _ = same(use(parallel_tool_calls=False), CALL_TEXT)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]


def test_a_reply_cut_by_max_tokens_keeps_length() -> None:
    message, finish = same(use(), CALL_TEXT, reason="length")
    assert finish == "length" and len(message["tool_calls"]) == 2


def test_named_choice_streams_the_arguments_as_generated() -> None:
    named = use(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    args = '{"city": "Lyon"}'
    message, finish = same(named, args)
    assert finish == "tool_calls" and message["content"] is None
    assert message["tool_calls"] == [{"id": "-", "type": "function",
                                      "function": {"name": "get_weather", "arguments": args}}]
    r = reply(named)  # the call opens with the first piece, before its arguments are complete
    first = r.delta_choices(0, chunk('{"ci'))
    assert first[0]["delta"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[1]["delta"]["tool_calls"][0]["function"] == {"arguments": '{"ci'}


def test_required_choice_reads_one_call_object() -> None:
    message, finish = same(use(tool_choice="required"), '{"name": "add", "arguments": {"a": 2, "b": 3}}')
    assert finish == "tool_calls" and message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("add", {"a": 2, "b": 3})]


@pytest.mark.parametrize("text", ['{"name": "add", "argu', '{"name": "nope", "arguments": {}}'])
def test_required_text_that_is_no_offered_call_is_content(text: str) -> None:
    message, finish = same(use(tool_choice="required"), text, reason="length")
    assert message["content"] == text and "tool_calls" not in message and finish == "length"
