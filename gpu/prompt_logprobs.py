"""Prompt logprobs on the device: the log-probability of prompt tokens under the model,
computed only at the prompt positions a request asks for.

The logprob of prompt token p is read from the logits at position p - 1, so a span names
the positions of one prefill chunk whose logits are read and, for each, the token that
follows it (possibly the first token of the next chunk: the loop knows the whole prompt).
Only those rows of the final hidden states go through the lm_head, in slices of
`SLICE_ROWS`, so memory stays at SLICE_ROWS x vocab floats however long the prompt.

The distribution is the model's own (float32 log_softmax of the raw logits: no
logit_bias, penalties or temperature), as vLLM and SGLang report prompt logprobs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from gpu.ranked_top import ranked_top

SLICE_ROWS = 128  # rows of logits materialized at once (each row is vocab_size floats)


class PromptLogprobSpan(NamedTuple):
    """Positions [start + offset, start + offset + len(targets)) of chunk `chunk` (start:
    the chunk's prefix_len) have their logits read; targets[i] is the token after the
    i-th of them. top_n: how many most likely tokens to report per position."""

    chunk: int
    offset: int
    targets: tuple[int, ...]
    top_n: int = 0


class PromptLogprobs(NamedTuple):
    """One span's result, per position: the target's logprob and rank (1 = most likely),
    and the top_n (token id, logprob) pairs, most likely first."""

    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]]


def span_rows(spans: Sequence[PromptLogprobSpan], extend_lens: Sequence[int]) -> list[int]:
    """Flat indices (into the batch's flattened tokens) of every span's positions, in order."""
    starts = [0]
    for n in extend_lens:
        starts.append(starts[-1] + n)
    rows: list[int] = []
    for span in spans:
        if span.offset < 0 or span.offset + len(span.targets) > extend_lens[span.chunk]:
            raise ValueError(f"prompt logprob span {span.offset}+{len(span.targets)} outside its chunk")
        first = starts[span.chunk] + span.offset
        rows.extend(range(first, first + len(span.targets)))
    return rows


def prompt_logprobs(
    logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
    spans: Sequence[PromptLogprobSpan], extend_lens: Sequence[int],
) -> list[PromptLogprobs]:
    """Each span's logprobs, from `hidden` (all tokens' final hidden states) and
    `logits_of` (hidden rows -> float32 logits), SLICE_ROWS positions at a time."""
    rows = span_rows(spans, extend_lens)
    targets = [t for s in spans for t in s.targets]
    most = max((s.top_n for s in spans), default=0)
    values: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_values: list[list[float]] = []
    index = torch.tensor(rows, dtype=torch.int64, device=hidden.device)
    wanted = torch.tensor(targets, dtype=torch.int64, device=hidden.device)
    for lo in range(0, len(rows), SLICE_ROWS):
        logprobs = torch.log_softmax(logits_of(hidden.index_select(0, index[lo : lo + SLICE_ROWS])).float(), -1)
        chosen = logprobs.gather(1, wanted[lo : lo + SLICE_ROWS].unsqueeze(1))
        values += chosen.squeeze(1).tolist()
        ranks += ((logprobs > chosen).sum(dim=1) + 1).tolist()
        if most:
            top_value, top_id = ranked_top(logprobs, min(most, logprobs.shape[1]))  # the same lists whatever `most`
            top_ids += top_id.tolist()
            top_values += top_value.tolist()
    return _split(spans, values, ranks, top_ids, top_values)


def _split(
    spans: Sequence[PromptLogprobSpan], values: list[float], ranks: list[int],
    top_ids: list[list[int]], top_values: list[list[float]],
) -> list[PromptLogprobs]:
    out, at = [], 0
    for span in spans:
        end = at + len(span.targets)
        top = [list(zip(top_ids[i][: span.top_n], top_values[i][: span.top_n])) if span.top_n else []
               for i in range(at, end)]
        out.append(PromptLogprobs(values[at:end], ranks[at:end], top))
        at = end
    return out
