"""POST /v1/chat/completions: parse the body, pick the reply (tool-aware when the model
may call tools) and stream or return it."""

from __future__ import annotations

from aiohttp import web

from kernel import registry
from kernel.async_engine import AsyncEngine
from plugins.http.chat import ChatReply, ChatRequest, names_of, parse_chat
from plugins.http.protocol import read_body
from plugins.http.sampling import expand
from plugins.http.state import state_of
from plugins.http.tool_reply import ToolChatReply


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    engine = state.require_engine()
    body = await read_body(request)
    req = parse_chat(body, engine)
    reply = chat_reply(engine, req, state.config.server.tool_parser)
    async with state.generation(expand([req.prompt_ids], req.params, req.n), names_of(body)) as sub:
        return await reply.respond(request, sub, req.stream)


def chat_reply(engine: AsyncEngine, req: ChatRequest, tool_parser: str) -> ChatReply:
    """The reply builder: tool-aware when the model may call tools."""
    if req.tools.mode == "none":
        return ChatReply(engine, req.n, req.include_usage, req.logprobs)
    return ToolChatReply(engine, req, registry.lookup("tool_parser", tool_parser))
