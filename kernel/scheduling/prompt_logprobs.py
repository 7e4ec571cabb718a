"""Prompt logprobs on the scheduler's side: which positions of each planned chunk the
device scores, how far the prefix match may reach, and recording the results.

A request with `logprob_start_len` k >= 0 wants the logprob of every prompt token
p >= k; token 0 has none (nothing precedes it), so the scored tokens are
[max(k, 1), len(prompt)). Token p's logprob is read from the logits at position p - 1.

NOTE: the match cap. Positions the prefix cache serves are never computed, so the match
may cover at most the tokens before position first - 1 (`match_cap`; kernel/scheduling/prefix_reuse.py
applies it). A cache hit then recomputes exactly the scored positions: in deterministic
mode their logprobs are equal (==) to a cold run's (invariant 7).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from gpu.prompt_logprobs import PromptLogprobs, PromptLogprobSpan
from kernel.request import Request

if TYPE_CHECKING:
    from kernel.scheduling.step_plan import StepPlan


class PromptScores(NamedTuple):
    """What a consumer reads: prompt tokens start.. with their logprobs (None for token 0),
    ranks (None for token 0) and top (logprob, id) pairs (None for token 0)."""

    start: int
    token_ids: list[int]
    logprobs: list[float | None]
    ranks: list[int | None]
    top: list[list[tuple[float, int]] | None]


def first_scored(req: Request) -> int | None:
    """The first prompt token whose logprob is computed, or None (none is)."""
    start = req.params.logprob_start_len
    if start < 0:
        return None
    first = max(start, 1)
    return first if first < len(req.prompt_ids) else None


def match_cap(req: Request) -> int | None:
    """Tokens the prefix match may cover at most (None: no limit)."""
    first = first_scored(req)
    return None if first is None else first - 1


def chunk_span(index: int, req: Request, start: int, length: int) -> PromptLogprobSpan | None:
    """The positions of chunk [start, start + length) whose logits score a prompt token."""
    first = first_scored(req)
    if first is None:
        return None
    lo, hi = max(start, first - 1), min(start + length, len(req.prompt_ids) - 1)
    if lo >= hi:
        return None
    return PromptLogprobSpan(index, lo - start, tuple(req.prompt_ids[lo + 1 : hi + 1]), req.params.prompt_top_n)


def plan_spans(plan: StepPlan) -> tuple[PromptLogprobSpan, ...]:
    spans = (chunk_span(i, c.req, c.start, c.length) for i, c in enumerate(plan.chunks))
    return tuple(s for s in spans if s is not None)


class MissingPromptLogprobs(AssertionError):
    """A scored position was never computed (served from the cache past the match cap)."""


def record(plan: StepPlan, spans: Sequence[PromptLogprobSpan], results: Sequence[PromptLogprobs]) -> None:
    """Append each span's results to its request. A span that starts at the first scored
    position starts the list afresh (a retracted request computes its prompt again)."""
    for span, result in zip(spans, results, strict=True):
        chunk = plan.chunks[span.chunk]
        req, first = chunk.req, first_scored(chunk.req)
        assert first is not None
        done = chunk.start + span.offset + 1 - first  # scored tokens before this span
        if done == 0:
            req.prompt_logprobs, req.prompt_ranks, req.prompt_top_logprobs = [], [], []
        if done != len(req.prompt_logprobs):
            raise MissingPromptLogprobs(
                f"request {req.rid}: prompt logprobs of tokens {first}..{first + done} were never computed"
            )
        req.prompt_logprobs += result.logprobs
        req.prompt_ranks += result.ranks
        if span.top_n:
            req.prompt_top_logprobs += result.top


def scores(req: Request) -> PromptScores | None:
    """The request's prompt logprobs as a consumer reads them (None: none were asked for)."""
    start = req.params.logprob_start_len
    if start < 0:
        return None
    lead: list[None] = [None] if start == 0 else []
    top_n = req.params.prompt_top_n
    tops: list[list[tuple[float, int]] | None] = [[(v, t) for t, v in top] for top in req.prompt_top_logprobs]
    return PromptScores(
        start=start,
        token_ids=req.prompt_ids[start:],
        logprobs=[*lead, *req.prompt_logprobs],
        ranks=[*lead, *req.prompt_ranks],
        top=[*lead, *tops] if top_n else [],
    )
