"""The Hermes tool-call parser (registry kind `tool_parser`): whole replies, and streams
split at every character boundary, which must give exactly what the whole reply gives."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel import registry
from kernel.structured.tool_parser import (
    ParsedReply,
    Piece,
    ToolCall,
    ToolParser,
    call_from_json,
    parse_reply,
)

CALL_A = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
CALL_B = '{"name": "add", "arguments": {"a": 1, "b": 2.5}}'


def hermes() -> ToolParser:
    parser: ToolParser = registry.lookup("tool_parser", "hermes")()
    return parser


def parse(text: str) -> ParsedReply:
    return parse_reply(hermes(), text)


def streamed(chunks: list[str]) -> ParsedReply:
    """The reply fed piece by piece, the pieces added up as a stream client would."""
    parser = hermes()
    pieces: list[Piece] = []
    for chunk in chunks:
        pieces += parser.feed(chunk)
    pieces += parser.finish()
    assert all(p != "" for p in pieces), "no empty content pieces"
    return ParsedReply("".join(p for p in pieces if isinstance(p, str)),
                       tuple(p for p in pieces if isinstance(p, ToolCall)))


def named(reply: ParsedReply) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in reply.calls]


def test_single_call() -> None:
    out = parse(f"<tool_call>\n{CALL_A}\n</tool_call>")
    assert out.content == ""
    assert named(out) == [("get_weather", {"city": "Paris", "days": 3})]
    assert out.calls[0].raw == f"<tool_call>\n{CALL_A}\n</tool_call>"


def test_multiple_calls_and_the_content_before_them() -> None:
    out = parse(f"Let me check.\n\n<tool_call>\n{CALL_A}\n</tool_call>\n<tool_call>{CALL_B}</tool_call>\n")
    assert out.content == "Let me check."  # the separators next to calls are dropped
    assert named(out) == [("get_weather", {"city": "Paris", "days": 3}), ("add", {"a": 1, "b": 2.5})]


def test_text_without_calls_is_all_content() -> None:
    text = "a < b, and <tool is not a tag; trailing space kept  \n"
    assert parse(text) == ParsedReply(text, ())


@pytest.mark.parametrize("block", [
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>["f"]</tool_call>',
])
def test_a_malformed_block_stays_content_with_its_spacing(block: str) -> None:
    text = f"Hi \n{block} then {'<tool_call>' + CALL_B + '</tool_call>'}"
    out = parse(text)
    assert out.content == f"Hi \n{block} then"
    assert named(out) == [("add", {"a": 1, "b": 2.5})]


def test_an_unclosed_block_stays_content() -> None:
    text = 'ok <tool_call>{"name": "f", "arguments": {'
    assert parse(text) == ParsedReply(text, ())


def test_arguments_as_a_json_string_and_parameters_synonym() -> None:
    assert call_from_json('{"name": "f", "arguments": "{\\"x\\": 1}"}') == ToolCall("f", '{"x": 1}',
                                                                                   '{"name": "f", "arguments": "{\\"x\\": 1}"}')
    call = call_from_json('{"name": "f", "parameters": {"x": 1}}')
    assert call is not None and json.loads(call.arguments) == {"x": 1}
    no_args = call_from_json('{"name": "f"}')
    assert no_args is not None and no_args.arguments == "{}"
    assert call_from_json('{"name": "f", "arguments": "[1]"}') is None


REPLIES = [
    f"Let me check.\n\n<tool_call>\n{CALL_A}\n</tool_call>\n<tool_call>{CALL_B}</tool_call>\n",
    f"<tool_call>{CALL_A}</tool_call>",
    "x <tool_call>{oops}</tool_call> y <tool_c",
    f"a<tool_call>{CALL_B}</tool_call>b<<tool_call>{CALL_A}</tool_call>  <tool_call>{{",
    "plain text with a </tool_call> stray close",
]


@pytest.mark.parametrize("text", REPLIES)
def test_a_stream_split_at_every_boundary_gives_the_whole_result(text: str) -> None:
    whole = parse(text)
    for cut in range(len(text) + 1):
        assert streamed([text[:cut], text[cut:]]) == whole, cut
    assert streamed(list(text)) == whole  # one character at a time


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["<tool_call>", "</tool_call>", CALL_A, CALL_B, " ", "\n", "x", "<", "{"]),
                max_size=12), st.data())
def test_any_chunking_of_any_mix_gives_the_whole_result(parts: list[str], data: st.DataObject) -> None:
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert streamed(chunks) == parse(text)


def test_content_streams_before_the_reply_ends() -> None:
    """Content goes out as it comes; only a possible tag start (and trailing space) waits."""
    parser = hermes()
    assert parser.feed("Hello wor") == ["Hello wor"]
    assert parser.feed("ld <tool") == ["ld"]
    assert parser.feed("_call>" + CALL_B) == []
    pieces = parser.feed("</tool_call>")
    assert len(pieces) == 1 and isinstance(pieces[0], ToolCall) and pieces[0].name == "add"


def test_the_parser_is_registered_by_name() -> None:
    assert "hermes" in registry.names("tool_parser")


def test_planted_bug_not_holding_back_a_tag_start_breaks_the_split_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split check is not vacuous: a parser that gives out a possible tag start
    ("<tool") as content cannot take it back once the tag completes."""
    from handlers.tool_parsers import hermes as module

    text = REPLIES[0]
    whole = parse(text)
    monkeypatch.setattr(module, "held_prefix", lambda text, tag: 0)
    assert any(streamed([text[:cut], text[cut:]]) != whole for cut in range(len(text) + 1))
