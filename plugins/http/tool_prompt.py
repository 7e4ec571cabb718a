"""Tools and tool messages into the chat template's input.

A template that mentions `tools` (the Hugging Face convention: Qwen 2.5/3, Hermes,
Llama 3.1, ...) renders them itself: it gets `tools=[{"type": "function", "function":
{...}}]` and the messages as they are, `tool_calls` and `role: "tool"` included. Any other
template (SmolLM2's) gets only roles every template knows, in tierserve's fallback format:

- the functions go into the system message (appended to the first one, or a new one at
  the front), described in `TOOLS_PROMPT` with the Hermes call syntax;
- an assistant message's calls become its text, one `<tool_call>{"name", "arguments"}</tool_call>`
  block each, after its content;
- a `tool` message becomes a user message holding `<tool_response>...</tool_response>`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from handlers.tool_parsers.hermes import CLOSE, OPEN
from plugins.http.tools import Function

TOOLS_PROMPT = """# Functions

You can call functions to answer. They are listed below, one JSON object per line:
<tools>
{tools}
</tools>

To call a function, reply with a JSON object holding its name and arguments, inside tags:
{open}
{{"name": "<function name>", "arguments": {{<arguments as the function's parameters describe>}}}}
{close}
Write one such block per call. Each call's result comes back in a <tool_response></tool_response> block."""


def supports_tools(template: str | None) -> bool:
    """Whether the template renders tools itself (it reads a `tools` variable)."""
    return template is not None and "tools" in template


def template_inputs(
    template: str | None, messages: list[dict[str, Any]], functions: Sequence[Function],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for rendering `messages` with `functions` shown."""
    if supports_tools(template):
        return messages, ({"tools": [f.as_tool() for f in functions]} if functions else {})
    plain = [_plain(m) for m in messages]
    if functions:
        text = tools_prompt(functions)
        if plain and plain[0]["role"] == "system":
            plain[0] = {**plain[0], "content": f"{plain[0]['content']}\n\n{text}"}
        else:
            plain.insert(0, {"role": "system", "content": text})
    return plain, {}


def tools_prompt(functions: Sequence[Function]) -> str:
    lines = "\n".join(json.dumps(f.as_tool(), ensure_ascii=False) for f in functions)
    return TOOLS_PROMPT.format(tools=lines, open=OPEN, close=CLOSE)


def call_block(call: dict[str, Any]) -> str:
    """One call of an assistant message in the syntax the model is asked to write."""
    function = call["function"]
    body = json.dumps({"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """A message in roles any template knows (the fallback format)."""
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return message
    parts = ([message["content"]] if message["content"] else []) + [call_block(c) for c in calls]
    return {"role": message["role"], "content": "\n".join(parts)}
