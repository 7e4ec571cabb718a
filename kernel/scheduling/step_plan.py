"""What the scheduler plans for one step: the chunks to run and the requests retracted.

Its own module so that everything reading a plan (prompt logprobs, overlap, the step
loop) depends on the plan's shape, not on the scheduler that makes it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernel.request import Request
from kernel.speculative.tree import VerifyTree


class ScheduledChunk(NamedTuple):
    req: Request
    start: int
    length: int
    state_src: int = 0  # hybrid models: the slots this chunk reads / writes its state,
    state_dst: int = 0
    state_track: tuple[tuple[int, int], ...] = ()  # and (length, slot) checkpoints inside it
    # A chunk that reaches the end of the known tokens produces the next token (unless
    # nothing is to be generated: a prompt scored for its logprobs only). NOTE: fixed
    # when planned: with overlap scheduling the request's length moves before it lands.
    samples: bool = False
    # Speculative decoding: tokens drafted after the decode's input token, verified in
    # this step (a decode of 1 + len(draft) rows: gpu sees one row per position).
    draft: tuple[int, ...] = ()
    # A token tree (speculative.topk > 1): `draft` is its nodes, main chain first; None: a chain.
    tree: VerifyTree | None = None
    # speculative.acceptance rejection, for a request that samples at random: each drafted
    # token is kept by the rejection rule (gpu/rejection.py), not by equality with the draw;
    # draft_probs: the distributions a draft model drew them from (None: guesses, point masses).
    rejection: bool = False
    draft_probs: tuple[torch.Tensor, ...] | None = None
    # A decode run (kernel/scheduling/decode_runs.py): this many greedy decode steps in one
    # device call, each producing a token (every chunk of a run has the same count).
    steps: int = 1
    run_stops: tuple[int, ...] = ()  # a run's: the ids that end the request (its run ends there too)


class StepPlan(NamedTuple):
    chunks: list[ScheduledChunk]
    retracted: list[Request]
