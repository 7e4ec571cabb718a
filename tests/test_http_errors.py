"""Every refusal is an OpenAI error object with the right status, and disturbs nobody."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import requests

from tests.test_http_fixtures import ServerProcess, assert_error, post

pytest_plugins = ["tests.test_http_fixtures"]

C, CHAT, GEN = "/v1/completions", "/v1/chat/completions", "/generate"
USER = [{"role": "user", "content": "hi"}]

# (path, JSON body or raw bytes, status, param the error names or None)
BAD: list[tuple[str, Any, int, str | None]] = [
    (C, b"{not json", 400, None),
    (C, b"", 400, None),
    (C, b"[1, 2]", 400, None),
    (C, {}, 400, "prompt"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": []}, 400, "prompt"),
    (C, {"prompt": 5}, 400, "prompt"),
    (C, {"prompt": [1, "a"]}, 400, "prompt"),
    (C, {"prompt": [999_999]}, 400, "prompt"),
    (C, {"prompt": "x", "model": "no-such-model"}, 400, "model"),
    (C, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (C, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    (C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    (C, {"prompt": "x", "stop": 5}, 400, "stop"),
    (C, {"prompt": "x", "seed": "s"}, 400, "seed"),
    (C, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    (C, {"prompt": "x", "max_tokens": 2048}, 400, None),  # prompt + max_tokens > context
    (C, {"prompt": "x", "n": 0}, 400, "n"),
    (C, {"prompt": "x", "n": 17}, 400, "n"),
    (C, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (C, {"prompt": "x", "logprobs": True}, 400, "logprobs"),
    (C, {"prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    (C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {"prompt": "x", "suffix": "!"}, 400, "suffix"),
    (C, {"prompt": "x", "top_k": "many"}, 400, "top_k"),
    (CHAT, {}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "max_completion_tokens": -5}, 400, "max_completion_tokens"),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
    (CHAT, {"messages": USER, "model": 3}, 400, "model"),
    (GEN, {"sampling_params": {}}, 400, "text"),
    (GEN, {"text": "x", "input_ids": [1]}, 400, "text"),
    (GEN, {"text": "x", "sampling_params": {"bogus": 1}}, 400, None),
    (GEN, {"text": "x", "sampling_params": {"max_new_tokens": 0}}, 400, "max_new_tokens"),
    ("/v1/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/v1/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/v1/no-such-route", {}, 404, None),
]

GOOD = {"prompt": "A long story:", "max_tokens": 40, "temperature": 0, "ignore_eos": True}


async def _send(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        return resp.status, await resp.json(content_type=None)


async def _stream_text(session: aiohttp.ClientSession, url: str) -> str:
    text = []
    async with session.post(url, json={**GOOD, "stream": True}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: {"):
                text += [c["text"] for c in orjson.loads(line[6:])["choices"]]
    return "".join(text)


async def test_bad_requests_are_400s_and_good_ones_unaffected(server: ServerProcess) -> None:
    expected = post(server, C, GOOD).json()["choices"][0]["text"]
    async with aiohttp.ClientSession() as session:
        good = asyncio.ensure_future(_stream_text(session, server.url + C))
        results = await asyncio.gather(*(_send(session, server.url + path, body) for path, body, _, _ in BAD))
        assert await good == expected
    for (path, body, status, param), (got, err) in zip(BAD, results):
        assert got == status, (path, body, err)
        assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, err
        if param is not None:
            assert err["error"]["param"] == param, (body, err)


def test_unknown_model_code_and_wrong_method(server: ServerProcess) -> None:
    err = assert_error(post(server, C, {"prompt": "x", "model": "gpt-4"}), 400, "model")
    assert err["code"] == "model_not_found" and "gpt-4" in err["message"]
    assert_error(requests.get(server.url + C, timeout=5), 405)
    assert_error(requests.get(server.url + "/nowhere", timeout=5), 404)


def test_context_overflow_message_names_max_tokens(server: ServerProcess) -> None:
    err = assert_error(post(server, C, {"prompt": "x", "max_tokens": 2048}), 400)
    assert "max_tokens" in err["message"] and "context" in err["message"]


def test_oversized_body_is_413_before_parsing(server: ServerProcess) -> None:
    big = b"[" + b"1," * (5 * 1024 * 1024) + b"1]"  # 10 MiB, over the 8 MiB limit
    resp = requests.post(server.url + C, data=big, headers={"Content-Type": "application/json"}, timeout=30)
    assert_error(resp, 413)


def test_batch_is_all_or_nothing(server: ServerProcess) -> None:
    """The second prompt does not fit: the first must not run either."""
    before = server.wait_idle()["counters"]["generation_tokens"]
    body = {"prompt": ["Hi", [1] * 2040], "max_tokens": 16}
    assert_error(post(server, C, body), 400)
    assert_error(post(server, C, {"prompt": "Hi", "n": 3, "max_tokens": 2047}), 400)
    assert server.wait_idle()["counters"]["generation_tokens"] == before
