"""Tools and tool messages into the chat template (plugins/http/tool_prompt.py): templates
that render `tools` get them as variables; others (SmolLM2's) get tierserve's fallback
format, whose call blocks the Hermes parser reads back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpu.loader import resolve_model_path
from gpu.loader.gguf import load_gguf_tokenizer
from gpu.tokenizer import Tokenizer
from kernel import registry
from kernel.structured.tool_parser import parse_reply
from plugins.http.errors import APIError
from plugins.http.protocol import parse_messages
from plugins.http.tool_prompt import call_block, supports_tools, template_inputs
from plugins.http.tools import parse_tools
from tests.conftest import SMOLLM

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}}
# A conversation with one round trip: the assistant calls, the tool answers.
ROUND_TRIP: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]
# A tools-aware template in the Hugging Face convention (written for this test).
TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}
{% endif %}TOOLS:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'tool' %}<|im_start|>tool {{ message.tool_call_id }}
{{ message.content }}<|im_end|>
{% elif message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}CALL {{ call.id }} {{ call.function.name }} {{ call.function.arguments | tojson }}
{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def smollm_tokenizer() -> Tokenizer:
    tok = load_gguf_tokenizer(resolve_model_path(SMOLLM))
    assert tok is not None and tok.chat_template is not None
    return tok


def with_template(tok: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(tok.backend, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     chat_template=template)


def render(tok: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    chat, extra = template_inputs(tok.chat_template, parse_messages(messages), parse_tools(tools))
    return tok.apply_chat_template(chat, **extra)


def test_smollm_template_gets_the_fallback_format(smollm_tokenizer: Tokenizer) -> None:
    assert not supports_tools(smollm_tokenizer.chat_template)
    text = render(smollm_tokenizer, ROUND_TRIP, [WEATHER])
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Functions")  # appended to the system message
    assert json.dumps(WEATHER) in system and "<tool_call>" in system
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           "</tool_call><|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>tool" not in text


def test_without_a_system_message_the_tools_make_one(smollm_tokenizer: Tokenizer) -> None:
    text = render(smollm_tokenizer, ROUND_TRIP[1:2], [WEATHER])
    assert text.startswith("<|im_start|>system\n# Functions")
    assert "SmolLM" not in text  # the template's default system message gave way
    assert render(smollm_tokenizer, ROUND_TRIP[1:2], []) == smollm_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris?"}])  # no tools: nothing changes


def test_a_tools_aware_template_renders_them_itself(smollm_tokenizer: Tokenizer) -> None:
    tok = with_template(smollm_tokenizer, TOOLS_TEMPLATE)
    assert supports_tools(tok.chat_template)
    text = render(tok, ROUND_TRIP, [WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\nTOOLS:\n" + json.dumps(WEATHER) + "\n<|im_end|>")
    assert 'CALL call_1 get_weather {"city": "Paris"}' in text  # arguments decoded to an object
    assert "<|im_start|>tool call_1\nsunny, 21 C<|im_end|>" in text
    assert "# Functions" not in text and "<tool_call>" not in text
    assert "TOOLS:" not in render(tok, ROUND_TRIP, [])  # tool_choice none / no tools: no tools variable


def test_a_fallback_call_block_parses_back_to_the_same_call() -> None:
    call = parse_messages(ROUND_TRIP)[2]["tool_calls"][0]
    parsed = parse_reply(registry.lookup("tool_parser", "hermes")(), call_block(call))
    assert parsed.content == "" and [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize(("messages", "param"), [
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
    ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
    ([{"role": "tool", "content": "x", "tool_call_id": "call_9"}], "messages[0].tool_call_id"),  # answers nothing
    ([{"role": "assistant", "tool_calls": {"id": "c"}}], "messages[0].tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}],
     "messages[0].tool_calls[0].id"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}],
     "messages[0].tool_calls[0].function"),
    ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}],
     "messages[0].tool_calls[0].function.arguments"),
])
def test_malformed_tool_messages_are_refused_by_field(messages: list[dict[str, Any]], param: str) -> None:
    with pytest.raises(APIError) as info:
        parse_messages(messages)
    assert info.value.status == 400 and info.value.param == param, info.value.message
