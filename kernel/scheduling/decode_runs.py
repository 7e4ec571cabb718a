"""Decode runs (`scheduler.decode_steps`): several decode steps in one device call.

At batch 1 on CPU a decode step's own work is reading the weights once (~4 ms for the
default model), and what surrounds it costs ~0.5 ms more a token: the loop applying and
streaming the token and planning the next step, the device thread building the step's
inputs, all paid with the caches the step just flushed. So when every running request is
decoding with a plain row (its token is its logits' argmax, or a draw by its temperature
alone; no logprobs, penalty, bias or grammar) and nothing waits to be admitted, the
scheduler plans a run of k steps: the native CPU decode step runs them back to back (a
drawing row with its k steps' Gumbel noise: gpu.sampling.run_draws), each row's token the input of
its next step (gpu/graphs/cpu_step.py `replay_run`), and the loop applies k tokens a
request at once. Like SGLang's `--num-continuous-decode-steps`, with no Python between
the steps.

NOTE: exact by construction: each step of a run is the step plain decoding would run, on
the same inputs, so a run's tokens are the tokens k steps give (tests/test_decode_runs.py).
A request that stops inside a run (a stop token or string, an abort) keeps the tokens up
to its stop; the KV the run wrote past that lies beyond its `kv_len`, is never cached, and
pages holding only that go back, as a rejected draft's do (invariant 9).

A request that arrives during a run does not wait for it: the scheduler's `add` bumps the
step runner's interrupt counter, the run ends after the step under way (after its first,
where the bump came between planning and the device starting it), and the loop applies
the steps it ran (the pages reserved for the rest go back). A run also ends after a step
where a row picks one of its stop tokens (EOS unless ignored, `stop_token_ids`), so that
request's end is reported at once, not a run later. What a run costs is
that its tokens stream together. A run never passes a request's `max_tokens` or the
context, and takes only free pages (it never evicts a cached prefix).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cache.allocator import pages_for
from gpu.graphs.cpu_step import CpuStepRunner
from gpu.sampling import plain_draw, plain_greedy
from kernel.config import ConfigError
from kernel.request import Request
from kernel.scheduling.step_plan import ScheduledChunk

# `auto`: runs of up to 8 steps, and of at most 32 row-steps, so a bigger batch runs shorter
# ones (8 rows: 4 steps; past 16 rows: none): its steps cost more against the Python around
# them, so a run saves it less, and rows that stop inside a run are computed to the run's end
# (README: scheduler.decode_steps).
AUTO_STEPS, AUTO_ROW_STEPS = 8, 32


@dataclass
class DecodeRuns:
    """`scheduler.decode_steps` resolved (> 1), for a runner whose native step takes up to
    `max_rows` decode rows (a bigger batch steps singly)."""

    steps: int
    max_rows: int
    row_steps: int | None = None  # rows x steps a run may have at most (None: any)
    # Ends the run planned last after its current step (CpuStepRunner.interrupt_runs): a
    # request arrived; `planned` marks a new run's start (arrivals before it do not count).
    interrupt: Callable[[], None] = lambda: None
    planned: Callable[[], None] = lambda: None
    runs: int = 0  # runs planned
    tokens: int = 0  # tokens they produced (landed)
    cut: int = 0  # runs that ended early: an arrival, or a row's stop token

    def length(self, chunks: Sequence[ScheduledChunk], running: Sequence[Request], waiting: int,
               free_pages: int, page_size: int, max_context: int,
               quiet: Callable[[Request], int] | None = None) -> int:
        """How many steps the plan `chunks` may run as one (1: a plain step). Every running
        request must be in it, decoding plainly, and none waiting; with speculative decoding,
        at most `quiet(req)` steps for each (those in which it would not draft)."""
        if waiting or not 0 < len(chunks) == len(running) <= self.max_rows:
            return 1
        if not all(c.length == 1 and c.samples and not c.draft and runs_plainly(c.req) for c in chunks):
            return 1
        cap = self.row_steps // len(chunks) if self.row_steps is not None else self.steps
        steps = min(self.steps, cap, *(room(c.req, max_context) for c in chunks))
        if quiet is not None:
            steps = min(steps, *(quiet(c.req) for c in chunks))
        while steps > 1 and pages_wanted(chunks, steps, page_size) > free_pages:
            steps -= 1
        return max(1, steps)

    def stats(self) -> dict[str, int]:
        return {"steps": self.steps, "runs": self.runs, "tokens": self.tokens, "cut": self.cut}


def runs_plainly(req: Request) -> bool:
    """Whether `req`'s next token is all that is read from its logits, and it is their argmax
    or a draw by its temperature alone (gpu.sampling `plain_greedy`, `plain_draw`)."""
    p = req.params
    no_logprobs = not (p.return_logprob or req.audit_logprobs)
    return req.grammar is None and (plain_greedy(p, no_logprobs) or plain_draw(p, no_logprobs))


def room(req: Request, max_context: int) -> int:
    """Tokens `req` may still produce: its max_tokens, then the context, finish it."""
    return min(req.params.max_new_tokens - len(req.output_ids), max_context - req.total_len)


def pages_wanted(chunks: Sequence[ScheduledChunk], steps: int, page_size: int) -> int:
    """Pages the requests need beyond their own for a run of `steps` (KV at kv_len .. kv_len + steps - 1)."""
    return sum(max(0, pages_for(c.req.kv_len + steps, page_size) - len(c.req.pages)) for c in chunks)


def resolve(setting: int | str, graphs: Any, overlap: bool) -> DecodeRuns | None:
    """`scheduler.decode_steps` for this engine: its runs, or None (one step a device call).
    Runs need the native CPU decode step (gpu/graphs/cpu_step.py), and no overlap
    scheduling (its next step is planned before this one's tokens are back). With
    speculative decoding a run takes only steps in which no request would draft
    (kernel/speculative/speculator.py `quiet_steps`)."""
    native = isinstance(graphs, CpuStepRunner) and graphs.decode_rows > 0
    if setting == "auto":
        if not native or overlap:
            return None
        return DecodeRuns(AUTO_STEPS, min(graphs.decode_rows, AUTO_ROW_STEPS // 2), AUTO_ROW_STEPS,
                          graphs.interrupt_runs, graphs.plan_run)
    assert isinstance(setting, int)
    if setting == 1:
        return None
    if not native or overlap:
        raise ConfigError(
            f"scheduler.decode_steps: {setting} needs the native CPU decode step (graphs.mode cpu, or auto on "
            "CPU for a dense Llama-family model) with scheduler.overlap off"
        )
    return DecodeRuns(setting, graphs.decode_rows, interrupt=graphs.interrupt_runs, planned=graphs.plan_run)
