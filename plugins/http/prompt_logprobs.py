"""Prompt logprobs on /v1/completions: the request fields that ask for them and the two
response shapes that carry them.

- OpenAI legacy `echo: true` with `logprobs: N`: the choice's logprobs cover the prompt
  and then the completion (`tokens`, `token_logprobs` with `null` for the first prompt
  token, `top_logprobs` with `null` there too, `text_offset` into the returned text,
  which starts with the prompt). This is what lm-evaluation-harness's
  `local-completions` loglikelihood requests read; `max_tokens: 0` scores a prompt
  without generating.
- vLLM's `prompt_logprobs: N`: a `prompt_logprobs` list per choice, `null` for the first
  token, then per token a {token id: {logprob, rank, decoded_token}} object holding the
  prompt token and the N most likely tokens.
"""

from __future__ import annotations

from typing import Any

from kernel.results.output import PromptScores
from kernel.sampling_params import MAX_TOP_LOGPROBS
from plugins.http.errors import bad_request
from plugins.http.logprobs import TokenNames
from plugins.http.protocol import get_int


def prompt_logprob_fields(body: dict[str, Any], echo: bool, top_n: int | None, stream: bool) -> dict[str, Any]:
    """The SamplingParams fields that make the engine score the prompt (none if not asked)."""
    vllm_n = get_int(body, "prompt_logprobs", 0, MAX_TOP_LOGPROBS)
    if vllm_n is not None and stream:
        raise bad_request("prompt_logprobs is not supported with stream", param="prompt_logprobs")
    if vllm_n is None and not (echo and top_n is not None):
        return {}
    n = vllm_n if vllm_n is not None else top_n
    return {"return_logprob": True, "logprob_start_len": 0, "prompt_top_logprobs_num": n}


def echo_logprobs(names: TokenNames, scores: PromptScores) -> dict[str, Any]:
    """The legacy logprobs of the echoed prompt; offsets count from the start of the text."""
    tokens = [names(t) for t in scores.token_ids]
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for k, (token, logprob) in enumerate(zip(tokens, scores.logprobs)):
        offsets.append(offset)
        offset += len(token)
        if logprob is None:
            tops.append(None)
            continue
        top = {names(t): v for v, t in _top(scores, k)}
        top.setdefault(token, logprob)  # the prompt token is always listed, as OpenAI does
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": list(scores.logprobs), "top_logprobs": tops, "text_offset": offsets}


def _top(scores: PromptScores, k: int) -> list[tuple[float, int]]:
    """Token k's most likely (logprob, id) pairs (none when no top-N was asked for)."""
    return (scores.top[k] or []) if scores.top else []


def join_logprobs(prompt: dict[str, Any], completion: dict[str, Any]) -> dict[str, Any]:
    """Legacy logprobs of the prompt followed by those of the completion."""
    return {key: prompt[key] + completion[key] for key in prompt}


def vllm_prompt_logprobs(names: TokenNames, scores: PromptScores) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` of a choice."""
    out: list[dict[str, Any] | None] = []
    for k, (token, logprob, rank) in enumerate(zip(scores.token_ids, scores.logprobs, scores.ranks)):
        if logprob is None or rank is None:
            out.append(None)
            continue
        entry: dict[str, Any] = {}
        for r, (v, t) in enumerate(_top(scores, k)):
            entry[str(t)] = {"logprob": v, "rank": r + 1, "decoded_token": names(t)}
        entry[str(token)] = {"logprob": logprob, "rank": rank, "decoded_token": names(token)}
        out.append(entry)
    return out
