"""OpenAI's `logit_bias`: validated in SamplingParams (ids against the vocabulary at
admission), carried per row to the sampler, added to the logits before sampling (greedy
too); logprobs are of the biased distribution. Through the official `openai` client on
an in-process server, the native /generate route, the offline Engine and the sampler."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
import torch

from gpu.sampling import SamplingBatch, sample
from kernel.sampling_params import MAX_LOGIT_BIAS, SamplingParams, SamplingParamsError
from tests.inprocess import Client, serve_http

PROMPT = [5, 17, 42, 9, 33]
N = 4


def openai_client(http: Client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="x", max_retries=0)


async def greedy_ids(http: Client, **params: Any) -> list[int]:
    """Output ids of a greedy N-token /generate of PROMPT (the native route)."""
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": N, "ignore_eos": True,
                                                      **params}}
    resp = await http.post("/generate", json=body)
    assert resp.status == 200, await resp.text()
    out: list[int] = (await resp.json())["output_ids"]
    return out


async def complete(client: openai.AsyncOpenAI, model: str, **kw: Any) -> str:
    out = await client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=N,
                                          extra_body={"ignore_eos": True}, **kw)
    return out.choices[0].text


def plain_token(vocab: int, avoid: list[int]) -> int:
    """A token that is not the greedy one: the middle of the vocabulary, away from specials."""
    token = vocab // 2
    while token in avoid:
        token += 1
    return token


async def test_bias_steers_greedy_on_every_route_and_leaves_other_requests_alone(tiny_chat_folder: str) -> None:
    async with serve_http(tiny_chat_folder) as (engine, http):
        client, model = openai_client(http), engine.info.model_name
        alone = await greedy_ids(http)
        alone_text = await complete(client, model)
        forced = plain_token(engine.info.vocab_size, alone)
        # +100: the token wins at every position (native route, then both OpenAI routes).
        assert await greedy_ids(http, logit_bias={str(forced): 100}) == [forced] * N
        out = await client.completions.create(
            model=model, prompt=PROMPT, temperature=0, max_tokens=N, logit_bias={str(forced): 100},
            logprobs=1, extra_body={"ignore_eos": True},
        )
        assert engine.tokenizer is not None
        assert out.choices[0].text == engine.tokenizer.decode([forced] * N)
        lps = out.choices[0].logprobs
        assert lps is not None and lps.token_logprobs is not None
        assert all(lp > -1e-3 for lp in lps.token_logprobs)  # logprobs of the biased distribution
        chat = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=N,
            logit_bias={str(forced): 100}, extra_body={"ignore_eos": True},
        )
        assert chat.choices[0].message.content == engine.tokenizer.decode([forced] * N)
        # -100 on the greedy first token: the output differs, from its first token.
        banned = await greedy_ids(http, logit_bias={str(alone[0]): -100})
        assert banned[0] != alone[0]
        assert await complete(client, model, logit_bias={str(alone[0]): -100}) != alone_text
        # A biased request batched with an unbiased one leaves it as it is alone.
        biased, plain, plain_text = await asyncio.gather(
            greedy_ids(http, logit_bias={str(forced): 100}), greedy_ids(http), complete(client, model),
        )
        assert biased == [forced] * N and plain == alone and plain_text == alone_text
        await client.close()


async def test_bad_logit_bias_is_a_400_naming_it_and_a_concurrent_request_is_unaffected(
    tiny_chat_folder: str,
) -> None:
    async with serve_http(tiny_chat_folder) as (engine, http):
        client, model = openai_client(http), engine.info.model_name
        vocab = engine.info.vocab_size
        alone = await complete(client, model)
        bad: list[tuple[dict[str, Any], str]] = [
            ({"7": 101}, "in [-100, 100]"),
            ({"seven": 1}, "token ids"),
            ({"1.5": 1}, "token ids"),
            ({str(vocab): 1}, f"in [0, {vocab})"),
            ({str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}, f"at most {MAX_LOGIT_BIAS} entries"),
        ]
        for bias, words in bad:
            refused, good = await asyncio.gather(
                complete(client, model, logit_bias=bias), complete(client, model), return_exceptions=True,
            )
            assert isinstance(refused, openai.BadRequestError), (bias, refused)
            assert refused.status_code == 400 and "logit_bias" in refused.message and words in refused.message
            body = refused.body
            assert isinstance(body, dict) and body.get("param") == "logit_bias"
            assert good == alone
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2, logit_bias={"7": -101})
        resp = await http.post("/generate", json={"input_ids": PROMPT,
                                                  "sampling_params": {"logit_bias": {str(vocab + 5): 1}}})
        assert resp.status == 400 and "logit_bias" in (await resp.json())["error"]["message"]
        # The same vocabulary check for stop_token_ids (a stop the model can never produce).
        resp = await http.post("/generate", json={"input_ids": PROMPT,
                                                  "sampling_params": {"stop_token_ids": [1, vocab]}})
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["param"] == "stop_token_ids" and f"in [0, {vocab})" in error["message"]
        await client.close()
        assert engine.stats()["requests"] == {"waiting": 0, "running": 0}


def test_offline_engine_generate_takes_logit_bias(tiny_engine: Any) -> None:
    plain = tiny_engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True})
    forced = plain_token(tiny_engine.engine.info.vocab_size, plain["output_ids"])
    out = tiny_engine.generate(PROMPT, {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True,
                                        "logit_bias": {forced: 100.0}})
    assert out["output_ids"] == [forced] * 3
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        tiny_engine.generate(PROMPT, {"logit_bias": {str(10**9): 1}})


@pytest.mark.parametrize(("bias", "words"), [
    ({"3": 100.5}, "in [-100, 100]"), ({"3": float("nan")}, "in [-100, 100]"), ({"3": True}, "in [-100, 100]"),
    ({"-1": 1}, "token ids"), ({" 3": 1}, "token ids"), ({"3": 1, 3: 2}, "twice"), ([1, 2], "object"),
    ("x", "object"),
])
def test_sampling_params_refuse_bad_biases(bias: Any, words: str) -> None:
    with pytest.raises(SamplingParamsError, match="logit_bias") as err:
        SamplingParams.from_dict({"logit_bias": bias})
    assert words in str(err.value) and err.value.param == "logit_bias"


def test_sampling_params_normalize_to_sorted_pairs() -> None:
    p = SamplingParams.from_dict({"logit_bias": {"9": -1, "2": 3}})
    assert p.logit_bias == ((2, 3.0), (9, -1.0))
    assert SamplingParams(logit_bias=p.logit_bias) == p
    assert SamplingParams.from_dict({"logit_bias": None}).logit_bias == ()


def test_sampler_applies_a_bias_to_its_row_only_random_rows_included() -> None:
    vocab = 16
    logits = torch.zeros(3, vocab)
    logits[:, 1] = 5.0
    params = [SamplingParams(temperature=0, logit_bias=((7, 100.0),)), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, logit_bias=((3, 100.0),))]
    batch = SamplingBatch.build(params, [1, 2, 3], [0, 0, 0], [[], [], []], [[], [], []], vocab,
                                torch.device("cpu"))
    before = logits.clone()
    res = sample(logits, batch)
    assert res.token_ids == [7, 1, 3]
    assert torch.equal(logits, before)  # the input is not modified
    assert res.logprobs[0] > -1e-3 and res.logprobs[2] > -1e-3
    unbiased = sample(logits[1:2], SamplingBatch.build(params[1:2], [2], [0], [[]], [[]], vocab, torch.device("cpu")))
    assert unbiased.logprobs[0] == pytest.approx(res.logprobs[1])
