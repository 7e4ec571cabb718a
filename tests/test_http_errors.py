"""Every refusal is an OpenAI error object with the right status, and disturbs nobody."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import requests

from tests.inprocess import serve_http
from tests.test_http_fixtures import GOOD, MAX_QUEUED, InFlight, ServerProcess, assert_error, post

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
    (C, {"prompt": "x", "echo": True, "logprobs": 21}, 400, "logprobs"),
    (C, {"prompt": "x", "echo": True, "logprobs": 1, "best_of": 2}, 400, "best_of"),
    (C, {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    (C, {"prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    (C, {"prompt": "x", "prompt_logprobs": True}, 400, "prompt_logprobs"),
    (C, {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
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
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    (CHAT, {"messages": USER, "model": 3}, 400, "model"),
    (GEN, {"sampling_params": {}}, 400, "text"),
    (GEN, {"text": "x", "input_ids": [1]}, 400, "text"),
    (GEN, {"text": "x", "sampling_params": {"bogus": 1}}, 400, None),
    (GEN, {"text": "x", "sampling_params": {"max_new_tokens": 0}}, 400, "max_new_tokens"),
    (GEN, {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 2}, 400, "logprob_start_len"),
    (GEN, {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": -2}, 400, "logprob_start_len"),
    (GEN, {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": "0"}, 400, "logprob_start_len"),
    (GEN, {"input_ids": [5, 6], "logprob_start_len": 0}, 400, "logprob_start_len"),  # without return_logprob
    (GEN, {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 21}, 400,
     "top_logprobs_num"),
    (GEN, {"input_ids": [5, 6], "return_logprob": True, "logprob_start_len": 0,
           "sampling_params": {"prompt_top_logprobs_num": 21}}, 400, "prompt_top_logprobs_num"),
    ("/v1/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/v1/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/v1/no-such-route", {}, 404, None),
]

ERROR_FIELDS = {"message", "type", "param", "code"}
KEY = "sekret"


async def _send(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_bad_requests_are_400s_and_good_ones_unaffected(server: ServerProcess) -> None:
    expected = post(server, C, GOOD).json()["choices"][0]["text"]
    async with aiohttp.ClientSession() as session, InFlight(server.url + C) as good:
        results = await asyncio.gather(*(_send(session, server.url + path, body) for path, body, _, _ in BAD))
        # Every refusal was answered while the good request was still generating.
        assert server.info()["pool"]["running"] == 1 and not good.finished
        assert await good.text() == expected
    for (path, body, status, param), (got, err) in zip(BAD, results):
        assert got == status, (path, body, err)
        assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}, err
        if param is not None:
            assert err["error"]["param"] == param, (body, err)


def assert_openai_error(exc: openai.APIStatusError, status: int, code: str, kind: str) -> None:
    """What the official client parsed out of one of our error objects."""
    assert exc.status_code == status and exc.code == code and exc.type == kind, (exc.status_code, exc.body)
    assert isinstance(exc.body, dict) and set(exc.body) == ERROR_FIELDS, exc.body
    assert exc.body["message"] and exc.body["message"] in exc.message


async def test_status_errors_parse_in_the_openai_client_while_one_generates(server: ServerProcess) -> None:
    """Context overflow, unknown model and route, wrong method, full queue, oversized
    body: each an OpenAI error the client maps to its type, none disturbing a request
    that is generating meanwhile."""
    expected = post(server, C, GOOD).json()["choices"][0]["text"]
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    async with InFlight(server.url + C) as good:
        name = (await client.models.list()).data[0].id
        with pytest.raises(openai.BadRequestError) as overflow:
            await client.completions.create(model=name, prompt="x", max_tokens=2048)
        assert_openai_error(overflow.value, 400, "context_length_exceeded", "invalid_request_error")
        assert overflow.value.param == "prompt" and "max_tokens" in overflow.value.message
        with pytest.raises(openai.NotFoundError) as no_model:
            await client.models.retrieve("no-such-model")
        assert_openai_error(no_model.value, 404, "model_not_found", "invalid_request_error")
        assert no_model.value.param == "model"
        with pytest.raises(openai.NotFoundError) as no_route:
            await client.post("/no-such-route", cast_to=object, body={})
        assert_openai_error(no_route.value, 404, "not_found", "invalid_request_error")
        with pytest.raises(openai.APIStatusError) as wrong_method:
            await client.get("/completions", cast_to=object)
        assert_openai_error(wrong_method.value, 405, "method_not_allowed", "invalid_request_error")
        with pytest.raises(openai.RateLimitError) as full:  # the good one + MAX_QUEUED > the limit
            await client.completions.create(model=name, prompt=["x"] * MAX_QUEUED, max_tokens=1)
        assert_openai_error(full.value, 429, "queue_full", "rate_limit_error")
        assert full.value.response.headers["Retry-After"] == "1"
        with pytest.raises(openai.APIStatusError) as too_big:
            await client.completions.create(model=name, prompt="x" * (9 << 20), max_tokens=1)
        assert_openai_error(too_big.value, 413, "request_too_large", "invalid_request_error")
        assert server.info()["pool"]["running"] == 1 and not good.finished
        assert await good.text() == expected
    await client.close()


async def test_wrong_api_key_is_401_while_a_keyed_request_generates(tiny_chat_folder: str) -> None:
    async with serve_http(tiny_chat_folder, {"server.api_key": KEY}) as (engine, http):
        base = str(http.make_url("/v1"))
        auth = {"Authorization": f"Bearer {KEY}"}
        expected = (await (await http.post(C, json=GOOD, headers=auth)).json())["choices"][0]["text"]
        wrong = openai.AsyncOpenAI(base_url=base, api_key="wrong", max_retries=0)
        name = engine.info.model_name
        async with InFlight(base + "/completions", headers=auth) as good:
            with pytest.raises(openai.AuthenticationError) as denied:
                await wrong.completions.create(model=name, prompt="x", max_tokens=1)
            assert_openai_error(denied.value, 401, "invalid_api_key", "invalid_request_error")
            with pytest.raises(openai.AuthenticationError):
                await wrong.models.list()
            bare = await http.post(C, json={"prompt": "x"})  # no header at all
            assert bare.status == 401 and set((await bare.json())["error"]) == ERROR_FIELDS
            assert engine.stats()["requests"]["running"] == 1 and not good.finished
            assert await good.text() == expected
        await wrong.close()


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
