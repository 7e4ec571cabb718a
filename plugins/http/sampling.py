"""OpenAI request fields -> engine `SamplingParams`, one set per choice."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kernel.sampling_params import MAX_NEW_TOKENS_LIMIT, SamplingParams, SamplingParamsError
from plugins.http.errors import sampling_error
from plugins.http.protocol import Prompt, get_int
from plugins.http.response_format import response_schema

# Fields passed through under the engine's own names; top_k, min_p, repetition_penalty,
# ignore_eos, stop_token_ids, skip_special_tokens, regex and ebnf are extensions OpenAI
# lacks (SGLang's); `speculative: false` (ours) opts a request out of speculative decoding.
# A JSON schema comes in as `response_format`.
PASSTHROUGH = (
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "logit_bias", "regex", "ebnf", "speculative",
)


def get_max_tokens(body: dict[str, Any], name: str) -> int | None:
    # At least 1: a chat answer of zero tokens has nothing to return (completions allow 0 with echo).
    return get_int(body, name, 1, MAX_NEW_TOKENS_LIMIT)


def build_params(
    body: dict[str, Any], max_new_tokens: int, top_logprobs: int | None, names: dict[str, str],
    extra: dict[str, Any] | None = None,
) -> SamplingParams:
    fields = {k: body[k] for k in PASSTHROUGH if k in body}
    fields["max_new_tokens"] = max_new_tokens
    schema = response_schema(body)
    if schema is not None:
        fields["json_schema"] = schema
    if top_logprobs is not None:
        fields["return_logprob"] = True
        fields["top_logprobs_num"] = top_logprobs
    fields.update(extra or {})
    try:
        return SamplingParams.from_dict(fields)
    except SamplingParamsError as exc:
        raise sampling_error(exc, names) from None


def expand(prompts: Sequence[Prompt], params: SamplingParams, n: int) -> list[tuple[Prompt, SamplingParams]]:
    """n choices per prompt, choice k*n+j for sample j of prompt k. With a seed, sample j
    uses seed+j: the request stays reproducible without n identical answers."""
    out = []
    for prompt in prompts:
        for j in range(n):
            p = params if j == 0 or params.seed is None else dataclasses.replace(params, seed=params.seed + j)
            out.append((prompt, p))
    return out
