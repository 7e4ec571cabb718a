"""`speculative.method: draft`: a second model proposes the drafts (greedy, k steps).

The draft model has a KV pool of its own with the target's page count and page size, and
reads the target's request-token table: a page id names the same tokens in both pools, so
the draft's KV lives in the pages the target's accounting already gives each request
(invariant 3 needs nothing new), and a prefix the target finds cached has the draft's KV
there wherever a draft job computed it. Drafts only ever cost speed when they are
wrong (the target verifies every one), so draft KV that is missing or stale — a prefix
loaded back from the host tier, positions of rejected drafts — makes a draft worse, never
an output different.

A draft job runs on the device thread before the step that verifies its drafts
(kernel/scheduling/step_loop.py `fill_drafts`): per request one chunk of the tokens the
draft has not seen yet (up to the last one), then k - 1 batched decode steps of its own
greedy picks (under rejection-sampling acceptance, a sampled request's drafts are drawn from
the draft's distribution instead, and the distributions go to the verify step:
gpu/rejection.py), written at the positions the verify step's drafted tokens take.

A hybrid draft model (recurrent state layers) keeps two state slots per request-table
row, fixed by the row (nothing to allocate or free): `base`, the state after the tokens
the last job read, and `scratch`, where its greedy steps run on. The next job resumes
from `base` (the drafted tokens' state is dropped, whatever the verify step accepted).
Where `base` is not the state its start needs (a request's first job), it starts from a
snapshot of the draft's state at a page boundary of its prefix (kernel/speculative/draft_states.py,
one slot per table row more), else from the request's first token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from gpu.draw_keys import draft_uniform
from gpu.forward_batch import ForwardBatch, PrefillChunk, SamplingRow
from gpu.model_runner import ModelRunner
from gpu.sampling import argmax_rows, draw_drafts, is_greedy
from kernel.registry import register
from kernel.request import Request
from kernel.speculative.draft_pages import DraftPages
from kernel.speculative.draft_states import DraftStates
from kernel.speculative.drafter import Drafter
from kernel.speculative.tree import DraftTree

PENDING = -1  # a drafted token the draft job has not produced yet (never a valid placeholder: row 0 is reserved)
_GREEDY = SamplingRow(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, frequency_penalty=0.0, presence_penalty=0.0,
                      repetition_penalty=1.0, top_logprobs_num=0, seed=0, step=0, logprobs=False)


class DraftJob(NamedTuple):
    row: int  # the request's table row (shared with the target)
    start: int  # tokens the draft's KV covers already
    tokens: tuple[int, ...]  # the request's tokens from `start` to its end
    wanted: int  # drafts wanted
    others: int = 0  # token trees: next-best tokens wanted beside each draft
    resume: int = 0  # a hybrid draft: the snapshot slot its `base` starts from (0: base as it is)
    track: tuple[tuple[int, int], ...] = ()  # a hybrid draft: (tokens, snapshot slot) the chunk keeps
    # Rejection-sampling acceptance (gpu/rejection.py): how the drafts are drawn (the request's
    # temperature and truncation, its first draft's step); None: greedy.
    draws: SamplingRow | None = None


class Drafts(NamedTuple):
    """A draft job's result: its tokens, and where they were drawn at random the
    distributions they were drawn from, one [V] float32 tensor a token (else None)."""

    tokens: list[int]
    dists: tuple[torch.Tensor, ...] | None = None


def base_slot(row: int) -> int:
    """A hybrid draft's state after the tokens its last job read, for table row `row`."""
    return 2 * row - 1


def scratch_slot(row: int) -> int:
    """Where a hybrid draft's greedy steps for row `row` run (dropped after the job)."""
    return 2 * row


def snapshot_slots(num_rows: int) -> tuple[int, int]:
    """(first, count): the snapshot slots of a hybrid draft's pool (draft_states.py)."""
    return 2 * num_rows, num_rows


def state_slots(num_rows: int) -> int:
    """Slots a hybrid draft's state pool needs for `num_rows` table rows (row 0 included):
    two a row, then one a row for snapshots."""
    first, count = snapshot_slots(num_rows)
    return first + count


class DraftModel:
    """Owned by the device thread: the draft model's runner (its model, pool, attention,
    and for a hybrid draft its state pool, two slots a row)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @property
    def recurrent(self) -> bool:
        return self.runner.states is not None

    def _chunk(self, tokens: tuple[int, ...], row: int, start: int, step: int,
               track: tuple[tuple[int, int], ...] = ()) -> PrefillChunk:
        """A job's chunk (step 0: its known tokens, from `base` back to `base`, keeping the
        job's snapshots) or one of its greedy steps (from `base`, then `scratch`, into `scratch`)."""
        if not self.recurrent:
            return PrefillChunk(tokens, row, start)
        src = base_slot(row) if step <= 1 else scratch_slot(row)
        return PrefillChunk(tokens, row, start, src, base_slot(row) if step == 0 else scratch_slot(row), track)

    @torch.inference_mode()
    def draft(self, jobs: Sequence[DraftJob]) -> list[Drafts]:
        """The drafts of every job, in order (device thread): greedy, or drawn as the job's
        `draws` says; a job with `others` also gets, after its drafts, the next-best tokens
        at each of their positions (`others` a position, best first: the side nodes of
        `ModelDrafter.propose_tree`)."""
        resumes = [(job.resume, base_slot(job.row)) for job in jobs if job.resume]
        if resumes:  # NOTE: before the forward, which may write a snapshot slot another job resumes from
            self.runner.run_state_copies(resumes)
        chunks = [self._chunk(job.tokens, job.row, job.start, 0, job.track) for job in jobs]
        others = max(job.others for job in jobs)
        picks, alts, dists = self._pick(chunks, [job.draws for job in jobs], others)
        drafts = [[t] for t in picks]
        beside = [[a] for a in alts]
        drawn = [[d] for d in dists]
        for step in range(1, max(job.wanted for job in jobs)):
            live = [i for i, job in enumerate(jobs) if job.wanted > step]
            chunks = [self._chunk((drafts[i][-1],), jobs[i].row, jobs[i].start + len(jobs[i].tokens) + step - 1, step)
                      for i in live]
            draws = [_at_step(jobs[i].draws, step) for i in live]
            picks, alts, dists = self._pick(chunks, draws, others)
            for i, token, alt, dist in zip(live, picks, alts, dists):
                drafts[i].append(token)
                beside[i].append(alt)
                drawn[i].append(dist)
        return [Drafts(d + [t for alt in b for t in alt[: job.others]], _dists(q))
                for d, b, q, job in zip(drafts, beside, drawn, jobs)]

    def _pick(self, chunks: list[PrefillChunk], draws: Sequence[SamplingRow | None],
              others: int = 0) -> tuple[list[int], list[list[int]], list[torch.Tensor | None]]:
        """Each row's pick (greedy, or drawn as its `draws` says, with the distribution it
        was drawn from), and its `others` next-best tokens (best first)."""
        batch = ForwardBatch.build(chunks, [(i, _GREEDY) for i in range(len(chunks))])
        graphs = self.runner.graphs
        graph = graphs.bucket_for(batch) if graphs is not None else None
        logits = self.runner.forward(batch) if graph is None or graphs is None else graphs.replay(graph, batch)
        picks = [int(t) for t in argmax_rows(logits.float(), self.runner.native_argmax).tolist()]
        dists: list[torch.Tensor | None] = [None] * len(picks)
        drawing = [(i, d) for i, d in enumerate(draws) if d is not None and not is_greedy(d)]
        if drawing:
            settings = [d for _, d in drawing]
            uniforms = [draft_uniform(d.seed, d.step) for d in settings]
            tokens, probs = draw_drafts(logits.float()[[i for i, _ in drawing]], settings, uniforms)
            for (i, _), token, prob in zip(drawing, tokens, probs):
                picks[i], dists[i] = token, prob
        if not others:
            return picks, [[] for _ in picks], dists
        ranked = torch.topk(logits.float(), others + 1, dim=-1).indices.tolist()
        return picks, [[t for t in row if t != pick][:others] for row, pick in zip(ranked, picks)], dists


def _at_step(draws: SamplingRow | None, step: int) -> SamplingRow | None:
    """A job's draw settings for its `step`-th draft."""
    return None if draws is None else dataclasses.replace(draws, step=draws.step + step)


def _dists(dists: list[torch.Tensor | None]) -> tuple[torch.Tensor, ...] | None:
    """A job's draft distributions, if every draft was drawn (else None: greedy)."""
    drawn = tuple(d for d in dists if d is not None)
    return drawn if dists and len(drawn) == len(dists) else None


@register("drafter", "draft")
class ModelDrafter(Drafter):
    """Plans PENDING drafts; the step loop has the draft model fill them in (`jobs`,
    `fill`) before the verify step is built."""

    deferred = True

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.model: DraftModel | None = None  # attached by the engine builder (`attach`)
        self.pages: DraftPages | None = None
        self.states: DraftStates | None = None  # a hybrid draft's snapshots
        self._seen: dict[str, tuple[int, int]] = {}  # per request: (table row, tokens the draft has read)

    def attach(self, model: DraftModel, page_size: int, num_rows: int) -> None:
        self.model = model
        self.pages = DraftPages(page_size)
        if model.recurrent:
            self.states = DraftStates(*snapshot_slots(num_rows))

    def propose(self, req: Request, max_tokens: int) -> list[int]:
        return [PENDING] * max_tokens

    def propose_tree(self, req: Request, depth: int, topk: int, rows: int) -> DraftTree:
        """A chain and, beside each of its tokens, the draft's topk - 1 next-best tokens
        (leaves): as deep as `rows` allows with every position's leaves."""
        length = min(depth, rows // topk)
        if length == 0:
            return DraftTree.chain([PENDING] * min(depth, rows))
        parents = list(range(-1, length - 1))
        for d in range(length):
            parents += [d - 1] * (topk - 1)
        return DraftTree((PENDING,) * len(parents), tuple(parents))

    def job(self, req: Request, count: int, others: int = 0, draws: SamplingRow | None = None) -> DraftJob:
        """The draft work for `req`'s PENDING drafts: the tokens its KV lacks, then `count`
        picks. A request's first job starts after the leading pages whose draft KV is of
        its own tokens (kernel/speculative/draft_pages.py), later ones after what the
        previous job read (its drafts' positions are redone: they may have been rejected).
        A hybrid draft resumes only where its `base` state is (the same row, the same
        count) or from a snapshot at one of those pages (`_restart`), else from the
        request's first token."""
        assert req.row is not None and self.pages is not None and self.model is not None
        total = req.total_len
        seen = self._seen.get(req.rid)
        resume, track = 0, ()  # type: tuple[int, tuple[tuple[int, int], ...]]
        if self.states is not None:
            if seen is not None and seen[0] == req.row and seen[1] <= min(req.kv_len, total - 1):
                start = seen[1]
            else:
                start, resume = self._restart(req, min(req.kv_len, total - 1))
            track = self._snapshot(req, start, total)
        else:
            start = min(self.pages.trusted(req) if seen is None else seen[1], req.kv_len, total - 1)
        self.pages.written(req, start, total, total + count - 1)
        self._seen[req.rid] = (req.row, total)
        return DraftJob(req.row, start, tuple(req.token_slice(start, total)), count, others, resume, track, draws)

    def _restart(self, req: Request, limit: int) -> tuple[int, int]:
        """A hybrid draft's start without its `base`: (tokens, snapshot slot) of the longest
        prefix of at most `limit` tokens whose pages hold its draft KV and whose state a
        snapshot holds, else (0, 0)."""
        assert self.pages is not None and self.states is not None
        pages = min(self.pages.trusted(req), limit) // self.pages.page_size
        n, slot = self.states.find(self.pages.keys(req, pages))
        return n * self.pages.page_size, slot

    def _snapshot(self, req: Request, start: int, total: int) -> tuple[tuple[int, int], ...]:
        """The chunk [start, total)'s snapshot: the state at the last page boundary strictly
        inside it, kept under that prefix's key."""
        assert self.pages is not None and self.states is not None
        pages = (total - 1) // self.pages.page_size
        end = pages * self.pages.page_size
        slot = self.states.keep(self.pages.keys(req, pages)[-1]) if end > start else 0
        return ((end, slot),) if slot else ()

    def settle(self, written: bool = True) -> None:
        """The planned jobs' draft forward ran (written) or failed."""
        if self.states is not None:
            self.states.settle(written)

    def forget(self, req: Request) -> None:
        self._seen.pop(req.rid, None)
        if self.pages is not None:
            self.pages.forget(req)
