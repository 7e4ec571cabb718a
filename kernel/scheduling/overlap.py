"""Overlap scheduling (`scheduler.overlap`): step N+1 is planned and submitted while step
N runs, before N's tokens are known, as SGLang does.

Right after N is submitted, `look_ahead` makes each request of N that may go on look as
if N had landed: its `kv_len` moves to the end of its chunk and, if the chunk samples,
its output gets `placeholder(table_row)` for the token N will sample. The scheduler then
plans N+1 from that state as usual (a decode of the placeholder), the device resolves the
placeholder from the token N wrote for that row (gpu/step_inputs.py), and the loop awaits
N, applies it (the placeholder gives way to the real token), emits, and plans N+2.

NOTE: what never goes ahead (it is planned again once N has landed, a step later):
- a request whose next plan depends on N's token on the host: a grammar (the next mask),
  penalties (the token history), prompt logprobs (conservative: they score prefill only);
- a request N's token will surely finish (max_new_tokens, the context length);
- a finished request, and every request of a hybrid model (recurrent state; the engine
  never turns overlap on for one).
A request in flight is never retracted: when the victim would be one, the scheduler
sets `drain` and the loop lands the step in flight before it plans again, so the same
victim is retracted as without overlap. One that finishes at N (a stop token, a stop
string, an abort) while it is in N+1 keeps its pages and row until N+1 lands; N+1's
token is dropped (its stream already has its final chunk: kernel/results/output.py), and
`kv_len` is cut back to the tokens it really has (`Scheduler._computed_len`), so the
prefix cache never takes the KV of a dropped token. Duplicate pages freed when a
request in N+1 joins the cache's copy wait until N+1 lands (`PrefixReuse.deferred`).

On CPU the device thread is a plain thread, so the same mechanism runs there and in the
tests; it overlaps less (the forward and the loop share the cores).
"""

from __future__ import annotations

import torch

from gpu.forward_batch import placeholder
from kernel.scheduling import prompt_logprobs
from kernel.scheduling.step_plan import ScheduledChunk, StepPlan


def resolve_overlap(setting: str, device: torch.device, hybrid: bool, speculative: bool = False) -> bool:
    """auto: on for CUDA; off on CPU, where the device thread computes what the loop
    would overlap with (benchmarks/overlap.py measures both); never for hybrid models,
    nor with speculative decoding (the next step's input is the verify step's last
    accepted token, and its drafts follow from that: nothing to plan ahead with)."""
    if hybrid or speculative:
        return False
    if setting == "auto":
        return device.type == "cuda"
    return setting == "on"


def goes_ahead(chunk: ScheduledChunk, max_context: int) -> bool:
    """Whether `chunk`'s request may be planned for the next step before this one lands."""
    req = chunk.req
    if req.finished or req.grammar is not None:
        return False
    p = req.params
    if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
        return False  # SamplingRow.needs_history: the snapshot would lack N's token
    if p.logprob_start_len >= 0 and prompt_logprobs.first_scored(req) is not None:
        return False
    end = chunk.start + chunk.length
    if not chunk.samples:
        return end < req.total_len  # a prefill that goes on (else: scored only, finishing)
    # N's token surely finishes it when it reaches max_new_tokens or the context.
    return len(req.output_ids) + 1 < p.max_new_tokens and req.total_len + 1 < max_context


def look_ahead(plan: StepPlan, max_context: int) -> int:
    """Advance the requests of the step just submitted that go ahead; how many did."""
    n = 0
    for chunk in plan.chunks:
        if not goes_ahead(chunk, max_context):
            continue
        req = chunk.req
        assert req.row is not None and not req.ahead
        req.kv_len = chunk.start + chunk.length
        if chunk.samples:
            req.output_ids.append(placeholder(req.row))
        req.ahead = True
        n += 1
    return n
