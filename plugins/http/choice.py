"""Per-choice accumulation of engine chunks, shared by the OpenAI and native APIs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kernel.async_engine import OutputChunk

if TYPE_CHECKING:
    from plugins.http.submission import Submission


@dataclass
class Choice:
    """Everything one engine request has produced so far."""

    index: int
    rid: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, chunk: OutputChunk) -> None:
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.top_logprobs += chunk.top_logprobs
        self.finish_reason = chunk.finish_reason
        self.matched_stop = chunk.matched_stop
        self.prompt_tokens = chunk.prompt_tokens
        self.completion_tokens = chunk.completion_tokens
        self.cached_tokens = chunk.cached_tokens

    def native(self, return_logprob: bool, top_logprobs: bool) -> dict[str, Any]:
        """The shape of `AsyncEngine.collect()`: {text, output_ids, meta_info}."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "matched_stop": self.matched_stop,
        }
        if return_logprob:
            meta["output_token_logprobs"] = list(zip(self.logprobs, self.token_ids))
            if top_logprobs:
                meta["output_top_logprobs"] = self.top_logprobs
        return {"text": self.text, "output_ids": list(self.token_ids), "meta_info": meta}


def usage(choices: Sequence[Choice], n: int) -> dict[str, Any]:
    """OpenAI usage. A prompt sampled n times is counted once (choices k*n .. k*n+n-1
    share prompt k); completion tokens count every choice."""
    firsts = choices[::n]
    prompt = sum(c.prompt_tokens for c in firsts)
    completion = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in firsts)},
    }



def new_choices(sub: Submission) -> list[Choice]:
    """One empty choice per engine request of `sub`, in choice order."""
    return [Choice(i, rid) for i, rid in enumerate(sub.rids)]


async def collect_choices(sub: Submission) -> list[Choice]:
    """Every choice of `sub`, run to the end (the non-streaming responses)."""
    choices = new_choices(sub)
    async for i, chunk in sub.events():
        choices[i].add(chunk)
    return choices
