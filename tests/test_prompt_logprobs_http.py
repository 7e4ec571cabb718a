"""Prompt logprobs over HTTP with real clients.

- lm-evaluation-harness's own `LocalCompletionsAPI` (lm-eval 0.4.13, installed without
  its dataset dependencies: the API model needs none) runs its loglikelihood path
  (`batch_loglikelihood_requests` -> `_create_payload`: token-id prompts, `echo: true`,
  `logprobs: 1`, `max_tokens: 1` -> `parse_logprobs`) against the packaged SmolLM2 in
  deterministic mode; per-token loglikelihoods equal transformers' within 1e-3, and a
  second run gives identical numbers (echo scores from token 0, so even with every
  prefix cached the match serves nothing: `cached_tokens` stays 0).
- /generate with logprob_start_len on the same model: a cache hit's values are `==` to a
  cold run's.
- The shapes: the official `openai` client's echo + logprobs (also streamed, and n > 1),
  vLLM's `prompt_logprobs`, SGLang's `input_token_logprobs`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from lm_eval.models.openai_completions import LocalCompletionsAPI

from kernel import Engine
from tests.conftest import FLOAT32, SMOLLM
from tests.inprocess import Client, serve_http

SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "In 1969, astronauts landed on the Moon and walked on its dusty surface.",
]
SMOLLM_DET = {**FLOAT32, "model.path": SMOLLM, "deterministic": True, "cache.prefix": "radix", "cache.num_pages": 512}


def hf_token_logprobs(model: Any, ids: list[int]) -> list[float]:
    """transformers: the logprob of each token after the first, from one full forward."""
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


def lm_eval_model(url: str, model: str, tokenizer: Any) -> LocalCompletionsAPI:
    lm = LocalCompletionsAPI(base_url=url, model=model, tokenizer_backend=None, batch_size=8, max_retries=1)
    # What tokenizer_backend="huggingface" would give, without loading a Hugging Face
    # tokenizer: token-id prompts (its default) and a tokenizer, only checked to be set
    # on this path since the requests carry token ids already.
    lm.tokenizer, lm.tokenized_requests = tokenizer, True
    return lm


def lm_eval_scores(lm: LocalCompletionsAPI, token_lists: list[list[int]]) -> tuple[list[float], list[float]]:
    """(per-token logprobs of every list's tokens 1.., as lm-eval's parser reads them from
    one batched response; its loglikelihoods of two continuations per list, through its
    whole request path)."""
    outputs = lm.model_call(messages=token_lists, generate=False)  # _create_payload inside
    assert outputs is not None and len(outputs["choices"]) == len(token_lists)
    assert outputs["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # scored positions are computed
    per_token = []
    for ids, choice in zip(token_lists, sorted(outputs["choices"], key=lambda c: c["index"]), strict=True):
        # parse_logprobs reads token_logprobs[ctxlen:-1]: the last entry is the generated token.
        assert len(choice["logprobs"]["token_logprobs"]) == len(ids) + 1
        # The parser's loglikelihood of tokens k.. for every k; token k's is the difference.
        sums = [lm.parse_logprobs(outputs={"choices": [choice]}, ctxlens=[k])[0][0] for k in range(1, len(ids))]
        per_token += [a - b for a, b in zip(sums, [*sums[1:], 0.0], strict=True)]
    requests = [((str(i), str(k)), ids[:k], ids[k:]) for i, ids in enumerate(token_lists) for k in (1, len(ids) // 2)]
    results = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert all(isinstance(greedy, bool) for _, greedy in results)
    return per_token, [logprob for logprob, _ in results]


@pytest.fixture(scope="module")
def hf_model(hf_smollm: Any) -> Any:
    return hf_smollm


async def test_lm_eval_loglikelihoods_match_transformers(hf_model: Any) -> None:
    async with serve_http(SMOLLM, SMOLLM_DET) as (engine, http):
        assert engine.tokenizer is not None
        token_lists = [engine.tokenizer.encode(s) for s in SENTENCES]
        url, loop = str(http.make_url("/v1/completions")), asyncio.get_running_loop()

        lm = lm_eval_model(url, engine.info.model_name, engine.tokenizer)
        first = await loop.run_in_executor(None, lm_eval_scores, lm, token_lists)
        again = await loop.run_in_executor(None, lm_eval_scores, lm, token_lists)  # prefixes cached, not matched
    refs = [hf_token_logprobs(hf_model, ids) for ids in token_lists]
    per_token, continuations = first
    flat = [lp for ref in refs for lp in ref]
    assert len(per_token) == len(flat)
    assert max(abs(a - b) for a, b in zip(per_token, flat, strict=True)) < 1e-3
    expected = [sum(ref[k - 1 :]) for ref in refs for k in (1, (len(ref) + 1) // 2)]
    assert max(abs(a - b) for a, b in zip(continuations, expected, strict=True)) < 1e-3 * len(flat)
    assert again == first


@pytest.fixture(scope="module")
def smollm_det() -> Iterator[Engine]:
    engine = Engine(None, {**SMOLLM_DET, "cache.page_size": 4, "scheduler.chunked_prefill_size": 32})
    yield engine
    engine.shutdown()


def test_generate_cache_hit_equals_cold_run_on_smollm(smollm_det: Engine, hf_model: Any) -> None:
    assert smollm_det.tokenizer is not None
    ids = smollm_det.tokenizer.encode(" ".join(SENTENCES))
    params = {"max_new_tokens": 1, "temperature": 0, "return_logprob": True}
    cold = smollm_det.generate(ids, {**params, "logprob_start_len": 0})
    assert isinstance(cold, dict)
    cold_lps = [lp for lp, _ in cold["meta_info"]["input_token_logprobs"]]
    ref = hf_token_logprobs(hf_model, ids)
    assert max(abs(a - b) for a, b in zip(cold_lps[1:], ref, strict=True)) < 1e-3
    start = 17
    warm = smollm_det.generate(ids, {**params, "logprob_start_len": start})
    assert isinstance(warm, dict)
    assert warm["meta_info"]["cached_tokens"] == 16
    assert [lp for lp, _ in warm["meta_info"]["input_token_logprobs"]] == cold_lps[start:]
    assert warm["output_ids"] == cold["output_ids"]


# ---- shapes, on the tiny model -----------------------------------------------------
def openai_client(http: Client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="x", max_retries=0)


async def test_echo_logprobs_shape_stream_and_n(tiny_chat_folder: str) -> None:
    # Deterministic: the three requests below compare values across a cold prefill and
    # prefix hits (other shapes), which only deterministic mode promises to be bit-equal.
    async with serve_http(tiny_chat_folder, {"cache.prefix": "radix", "deterministic": True}) as (engine, http):
        client, model = openai_client(http), engine.info.model_name
        text = "Hello there, my old friend"
        assert engine.tokenizer is not None
        ids = engine.tokenizer.encode(text)
        out = await client.completions.create(model=model, prompt=text, echo=True, logprobs=2, max_tokens=3,
                                              temperature=0, n=2, extra_body={"ignore_eos": True})
        a, b = out.choices
        assert a.text.startswith(text) and a.text == b.text
        lp = a.logprobs
        assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
        assert lp.top_logprobs is not None and lp.text_offset is not None
        assert len(lp.tokens) == len(ids) + 3 and lp == b.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        assert lp.text_offset == sorted(lp.text_offset)
        assert "".join(lp.tokens) == a.text
        assert all(a.text.startswith(t, o) for t, o in zip(lp.tokens, lp.text_offset, strict=True))
        for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
            assert top[token] == value and len(top) in (2, 3) and max(top.values()) >= value
        # max_tokens 0: the prompt scored, nothing generated; the same numbers.
        scored = await client.completions.create(model=model, prompt=ids, echo=True, logprobs=2, max_tokens=0)
        assert scored.choices[0].logprobs is not None
        assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(ids)]
        assert scored.usage is not None and scored.usage.completion_tokens == 0
        # Streamed: the deltas add up to the whole response.
        stream = await client.completions.create(model=model, prompt=text, echo=True, logprobs=2, max_tokens=3,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        tokens: list[str] = []
        values: list[float | None] = []
        async for chunk in stream:
            part = chunk.choices[0].logprobs
            if part is not None and part.tokens:
                tokens += part.tokens
                values += part.token_logprobs or []
        assert tokens == lp.tokens and values == lp.token_logprobs


async def test_vllm_prompt_logprobs_and_native_shape(tiny_chat_folder: str) -> None:
    async with serve_http(tiny_chat_folder) as (_, http):
        ids = [5, 17, 42, 9, 33, 1000, 2000]
        resp = await http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})
        assert resp.status == 200, await resp.text()
        choice = (await resp.json())["choices"][0]
        plps = choice["prompt_logprobs"]
        assert choice["logprobs"] is None and len(plps) == len(ids) and plps[0] is None
        resp = await http.post("/generate", json={"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
                                                  "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 0}})
        meta = (await resp.json())["meta_info"]
        native = meta["input_token_logprobs"]
        assert [t for _, t in native] == ids and native[0][0] is None and meta["input_top_logprobs"][0] is None
        for token, entry, (value, _), top in zip(ids[1:], plps[1:], native[1:], meta["input_top_logprobs"][1:],
                                                 strict=True):
            mine = entry[str(token)]
            assert mine["logprob"] == value and mine["rank"] >= 1
            best = [entry[str(t)] for _, t in top]
            assert [e["rank"] for e in best] == [1, 2] and best[0]["logprob"] == top[0][0] >= value
            assert (mine["rank"] == 1) == (value == top[0][0])
