"""Logprobs in OpenAI's two formats: legacy completions and chat `content` entries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpu.tokenizer import Tokenizer


class TokenNames:
    """Printable text of single token ids (what OpenAI calls a token's `token`)."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        name = self._cache.get(token_id)
        if name is None:
            if self._tokenizer is None:
                name = f"token_id:{token_id}"  # token-id-only model: no text to show
            else:
                name = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = name
        return name


def completion_logprobs(
    names: TokenNames, ids: Sequence[int], logprobs: Sequence[float],
    tops: Sequence[Sequence[tuple[int, float]]], offset: int,
) -> dict[str, Any]:
    """Legacy format: tokens, token_logprobs, top_logprobs (top-N plus the sampled token,
    as OpenAI documents) and text_offset (characters into the choice's text)."""
    tokens = [names(t) for t in ids]
    top_dicts: list[dict[str, float]] = []
    offsets: list[int] = []
    for k, (tok, lp) in enumerate(zip(tokens, logprobs)):
        top = {names(t): v for t, v in (tops[k] if k < len(tops) else ())}
        top.setdefault(tok, lp)
        top_dicts.append(top)
        offsets.append(offset)
        offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": list(logprobs),
        "top_logprobs": top_dicts,
        "text_offset": offsets,
    }


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(
    names: TokenNames, ids: Sequence[int], logprobs: Sequence[float],
    tops: Sequence[Sequence[tuple[int, float]]],
) -> dict[str, Any]:
    content = []
    for k, (tid, lp) in enumerate(zip(ids, logprobs)):
        entry = _entry(names(tid), lp)
        entry["top_logprobs"] = [_entry(names(t), v) for t, v in (tops[k] if k < len(tops) else ())]
        content.append(entry)
    return {"content": content, "refusal": None}
