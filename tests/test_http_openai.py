"""The OpenAI routes through the official `openai` client, against the real server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from openai import AsyncOpenAI, OpenAI
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

from tests.test_http_fixtures import ServerProcess, post

pytest_plugins = ["tests.test_http_fixtures"]

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hi"},
]


def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def model(server: ServerProcess) -> str:
    return client(server).models.list().data[0].id


def complete(server: ServerProcess, prompt: Any, **kw: Any) -> Completion:
    """A greedy 12-token completion (keywords override)."""
    args = {"model": model(server), "prompt": prompt, "temperature": 0, "max_tokens": 12, **kw}
    out: Completion = client(server).completions.create(**args)
    return out


def chat(server: ServerProcess, **kw: Any) -> ChatCompletion:
    args = {"model": model(server), "messages": MESSAGES, "temperature": 0, "max_tokens": 12, **kw}
    out: ChatCompletion = client(server).chat.completions.create(**args)
    return out


def test_models_lists_the_served_model(server: ServerProcess) -> None:
    models = client(server).models.list().data
    assert [m.id for m in models] == [server.info()["model"]]
    assert models[0].object == "model"
    assert client(server).models.retrieve(models[0].id).id == models[0].id


def test_completion_shape_and_usage(server: ServerProcess) -> None:
    out = complete(server, "Once upon a time", extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert len(out.choices) == 1 and out.choices[0].index == 0
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage is not None and out.usage.completion_tokens == 12
    tokens = post(server, "/v1/tokenize", {"prompt": "Once upon a time"}).json()
    assert out.usage.prompt_tokens == tokens["count"]
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_default_max_tokens_is_16(server: ServerProcess) -> None:
    out = client(server).completions.create(model=model(server), prompt="Hi", extra_body={"ignore_eos": True})
    assert out.usage is not None and out.usage.completion_tokens == 16


def test_streamed_completion_equals_non_streamed(server: ServerProcess) -> None:
    whole = complete(server, "The sky is")
    chunks = list(client(server).completions.create(
        model=model(server), prompt="The sky is", stream=True, stream_options={"include_usage": True},
        temperature=0, max_tokens=12,
    ))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_prompt_forms_n_and_choice_order(server: ServerProcess) -> None:
    ids = post(server, "/v1/tokenize", {"prompt": "Good morning"}).json()["tokens"]
    one = complete(server, "Good morning").choices[0].text
    assert complete(server, ids).choices[0].text == one
    out = complete(server, ["Good morning", "Hello"], n=2)
    assert [ch.index for ch in out.choices] == [0, 1, 2, 3]
    assert out.choices[0].text == out.choices[1].text == one  # greedy: both samples agree
    assert [ch.text for ch in complete(server, [ids, ids]).choices] == [one, one]


def test_seeded_sampling_repeats_and_n_differs(server: ServerProcess) -> None:
    a, b = (complete(server, "Tell me", temperature=1.0, seed=7, n=2) for _ in range(2))
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert a.choices[0].text != a.choices[1].text


def test_echo_and_stop(server: ServerProcess) -> None:
    plain = complete(server, "Hello").choices[0].text
    assert complete(server, "Hello", echo=True).choices[0].text == "Hello" + plain
    stop = plain[3:6]
    out = complete(server, "Hello", stop=[stop]).choices[0]
    assert out.finish_reason == "stop" and stop not in out.text and plain.startswith(out.text)


def test_completion_logprobs_legacy_shape(server: ServerProcess) -> None:
    lp = complete(server, "Hi", logprobs=3).choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 3 <= len(top) <= 4 and top[tok] == value
        assert max(top.values()) == pytest.approx(value)  # greedy picks the most likely token
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_completion_shape(server: ServerProcess) -> None:
    out = chat(server)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    choice = out.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("length", "stop") and choice.logprobs is None
    prompt = post(server, "/v1/tokenize", {"messages": MESSAGES}).json()["count"]
    assert out.usage is not None and out.usage.prompt_tokens == prompt


def test_chat_stream_equals_non_streamed(server: ServerProcess) -> None:
    whole = chat(server, extra_body={"ignore_eos": True})
    chunks = list(client(server).chat.completions.create(
        model=model(server), messages=MESSAGES, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}, temperature=0, max_tokens=12,
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].delta.content or "" for ch in body) == whole.choices[0].message.content
    last = body[-1].choices[0]
    assert last.finish_reason == "length" and last.delta.content is None and last.delta.role is None
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_chat_logprobs_shape(server: ServerProcess) -> None:
    out = chat(server, logprobs=True, top_logprobs=2)
    assert out.choices[0].logprobs is not None and out.usage is not None
    content = out.choices[0].logprobs.content
    assert content is not None and len(content) == out.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_max_completion_tokens(server: ServerProcess) -> None:
    out = chat(server, max_tokens=None, max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage is not None and out.usage.completion_tokens == 3


async def test_async_client_concurrent_requests(server: ServerProcess) -> None:
    aclient = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    name = (await aclient.models.list()).data[0].id

    async def text(prompt: str) -> str:
        out = await aclient.completions.create(model=name, prompt=prompt, temperature=0, max_tokens=12)
        return out.choices[0].text

    solo = await text("Rain")
    outs = await asyncio.gather(*(text(p) for p in ["Rain", "Snow", "Rain", "Wind"] * 2))
    assert outs[0] == outs[2] == outs[4] == solo  # batching does not change greedy text
    await aclient.close()


def test_tokenize_detokenize_round_trip(server: ServerProcess) -> None:
    ids = post(server, "/v1/tokenize", {"prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    assert post(server, "/v1/detokenize", {"tokens": ids["tokens"]}).json() == {"prompt": "Hello world"}


def test_repeated_prompt_hits_the_default_radix_cache(server: ServerProcess) -> None:
    """The server runs the default config (no cache.prefix override): reuse is on, and
    the official client sees it in usage.prompt_tokens_details.cached_tokens."""
    assert server.info()["config"]["cache"]["prefix"] == "radix"
    prompt = "A long shared system prompt, repeated word for word by every request of a chat app. " * 2
    first = complete(server, prompt, extra_body={"ignore_eos": True})
    again = complete(server, prompt, extra_body={"ignore_eos": True})
    assert again.choices[0].text == first.choices[0].text
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": prompt},
                                                  {"role": "user", "content": "Say hi"}]
    chat(server, messages=messages)
    warm = chat(server, messages=messages)
    assert warm.usage is not None and warm.usage.prompt_tokens_details is not None
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
