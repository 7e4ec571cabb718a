"""Per-choice accumulation of engine chunks, shared by the OpenAI and native APIs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kernel.results.output import Collected

if TYPE_CHECKING:
    from plugins.http.submission import Submission


@dataclass
class Choice(Collected):
    """Everything one engine request has produced so far, and its place in the response
    (`native()` is the engine's own result dict, kernel/results/output.py)."""

    index: int = 0


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
    return [Choice(rid=rid, index=i) for i, rid in enumerate(sub.rids)]


async def collect_choices(sub: Submission) -> list[Choice]:
    """Every choice of `sub`, run to the end (the non-streaming responses)."""
    choices = new_choices(sub)
    async for i, chunk in sub.events():
        choices[i].add(chunk)
    return choices
