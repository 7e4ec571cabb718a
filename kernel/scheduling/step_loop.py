"""The step loop: plan, submit, emit the previous step, await, apply — forever.

Step N+1 is planned and submitted as soon as step N's tokens are applied, and only
then is step N's output detokenized and streamed, so text work overlaps the forward.
Planning waits for N's ids because a finish or a retraction changes the next plan.
On CPU (`text_first`) the order is the other way round: the forward's threads take every
core, and text work run beside them (the loop's Python, the streams' writes) stalls the
whole team at its next barrier, which costs more than the text work itself; so N's output is
emitted and its streams get a turn of the loop before N+1 is submitted.
With `scheduler.overlap` on it does not (kernel/scheduling/overlap.py): N+1 is planned and
submitted while N runs, its decode rows reading N's tokens on the device, and the loop
applies and emits N while N+1 runs.

NOTE: the loop must never die silently. A failed device step fails only its own
requests; anything else that raises here (a planner bug, a double free, a broken
invariant) halts the engine: every client gets the error, new work is refused, and
`halt_reason` says why (the HTTP layer turns it into 503s and a health gauge).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import structlog

from gpu.device_thread import DeviceThread
from gpu.forward_batch import ForwardBatch, PrefillChunk, SamplingRow
from gpu.model_runner import ModelRunner, StepFatal, StepOutput
from kernel.request import Request
from kernel.results.output import OutputProcessor
from kernel.scheduling import prompt_logprobs
from kernel.scheduling.overlap import look_ahead
from kernel.scheduling.scheduler import Scheduler
from kernel.scheduling.step_plan import ScheduledChunk, StepPlan
from kernel.speculative import tree
from kernel.speculative.draft_model import PENDING, ModelDrafter

log = structlog.get_logger("tierserve")

class StepLoop:
    def __init__(
        self, scheduler: Scheduler, device_thread: DeviceThread, runner: ModelRunner, output: OutputProcessor,
        check_invariants: bool, halt: Callable[[BaseException], None], overlap: bool = False,
        text_first: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.device_thread = device_thread
        self.runner = runner
        self.output = output
        self.check_invariants = check_invariants
        self.halt = halt
        self.wake = asyncio.Event()
        self.steps = 0
        # Overlap scheduling; it needs dense models (kernel/overlap.resolve_overlap).
        self.overlap = overlap and scheduler.hybrid is None
        self.overlapped = 0  # steps submitted while the previous one was still in flight
        self.text_first = text_first  # emit before submitting (CPU: see the module docstring)

    async def run(self) -> None:
        try:
            await (self._overlap_loop() if self.overlap else self._loop())
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("step_loop_died")
            self.halt(exc)

    async def _loop(self) -> None:
        emit_next: list[Request] = []
        while True:
            if self.text_first and emit_next:
                self.output.emit(emit_next)
                emit_next = []
                await asyncio.sleep(0)  # the streams write now, not beside the next forward
            plan = self.plan()
            if plan is not None and drafts_pending(plan):
                plan = await self.fill_drafts(plan)  # a draft model's drafts (kernel/speculative/draft_model.py)
            step = self.submit(plan)
            self.output.emit(emit_next)  # overlaps with the step in flight
            emit_next = []
            if step is None:
                # NOTE: after an await here, plan again before idling: a request that
                # arrived meanwhile set `wake` already, and idle would clear it.
                if not await self.flush_state_copies():
                    await self.idle(plan)
                continue
            assert plan is not None
            emit_next = await self.land(plan, step)

    async def _overlap_loop(self) -> None:
        """Plan and submit N+1, then await, apply and emit N while N+1 runs."""
        inflight: tuple[StepPlan, asyncio.Future[Any]] | None = None
        while True:
            if self.scheduler.drain:  # a retraction waits for the step in flight:
                self.scheduler.drain = False  # land it, then plan as without overlap
                if inflight is not None:
                    self.output.emit(await self.land(*inflight))
                    inflight = None
            plan = self.plan()
            step = self.submit(plan)
            if inflight is not None:
                self.overlapped += step is not None
                self.output.emit(await self.land(*inflight))
            elif step is None:
                if not await self.flush_state_copies():
                    await self.idle(plan)
                continue
            inflight = None
            if step is not None:
                assert plan is not None
                look_ahead(plan, self.scheduler.max_context)  # what N+2 is planned from
                inflight = plan, step

    async def land(self, plan: StepPlan, step: asyncio.Future[Any]) -> list[Request]:
        """Await a step and apply it: the requests whose output to emit ([] if it failed)."""
        sampled = await self.await_step(plan, step)
        if sampled is None:
            return []
        moves = tree_moves(plan, sampled, self.scheduler.page_size) if self.scheduler.speculator else []
        if moves:  # before anything reads the accepted path's KV (kernel/speculative/tree.py)
            await self.device_thread.submit(lambda: self.runner.move_kv(moves))
        produced = self.apply(plan, sampled)
        self.check()
        return produced

    def plan(self) -> StepPlan | None:
        if not self.scheduler.has_work():
            return None
        plan = self.scheduler.schedule()
        if self.output.events.active:
            for req in plan.retracted:
                self.output.events.emit("retracted", req.rid)
            self.output.publish_admitted(c.req for c in plan.chunks)
        return plan

    def submit(self, plan: StepPlan | None) -> asyncio.Future[Any] | None:
        if plan is None or not plan.chunks:
            return None
        hybrid = self.scheduler.hybrid
        batch = build_forward_batch(plan, hybrid.take_copies() if hybrid is not None else ())
        trees = [ch.tree for ch in plan.chunks if ch.tree is not None] if self.scheduler.speculator else []
        copies = [c for t in trees for c in t.copies]
        runner = self.runner

        def job() -> Any:
            if copies:  # token trees: their branches' pages before the step (kernel/speculative/tree.py)
                runner.move_kv(copies)
            return runner.run(batch)

        return self.device_thread.submit(job)

    async def fill_drafts(self, plan: StepPlan) -> StepPlan:
        """Run the draft model for the plan's PENDING drafts (device thread), then put its
        tokens in the plan; a plan with no chunks if the draft job failed (its requests
        are failed, like a failed step's)."""
        spec = self.scheduler.speculator
        assert spec is not None and isinstance(spec.drafter, ModelDrafter) and spec.drafter.model is not None
        drafter, model = spec.drafter, spec.drafter.model
        pending = [i for i, c in enumerate(plan.chunks) if c.draft and c.draft[0] == PENDING]
        jobs = [drafter.job(plan.chunks[i].req, *tree_shape(plan.chunks[i]), draws=draws(plan.chunks[i]))
                for i in pending]
        try:
            drafts = await self.device_thread.submit(lambda: model.draft(jobs))
        except Exception as exc:
            log.exception("draft_failed")
            drafter.settle(written=False)
            self.fail(plan, exc)
            return plan._replace(chunks=[])
        drafter.settle()
        chunks = list(plan.chunks)
        for i, draft in zip(pending, drafts):
            chunks[i] = chunks[i]._replace(draft=tuple(draft.tokens), draft_probs=draft.dists)
        return plan._replace(chunks=chunks)

    async def flush_state_copies(self) -> bool:
        """No step to carry them: run queued state copies on the device thread now, so
        cached states are complete (the storage tier reads them), then let the host tier
        copy what waited for them. False if there were none."""
        hybrid = self.scheduler.hybrid
        if hybrid is None or not hybrid.copies:
            return False
        copies = hybrid.take_copies()
        await self.device_thread.submit(lambda: self.runner.copy_states(copies))
        if self.scheduler.prefix.host is not None:
            self.scheduler.prefix.host.copy_deferred()
        return True

    async def idle(self, plan: StepPlan | None) -> None:
        if plan is not None and self.scheduler.has_work():
            await asyncio.sleep(0.001)  # nothing runnable yet; do not spin hot
            return
        self.wake.clear()
        await self.wake.wait()

    async def await_step(self, plan: StepPlan, step: asyncio.Future[Any]) -> StepOutput | None:
        """The step's tokens; None if it failed (its requests are failed, the engine goes on)."""
        try:
            return await step  # type: ignore[no-any-return]
        except StepFatal:
            raise  # the engine halts (`run`)
        except Exception as exc:
            log.exception("step_failed")
            self.fail(plan, exc)
            return None

    def apply(self, plan: StepPlan, sampled: StepOutput) -> list[Request]:
        """Record the step; returns the requests whose output to emit next."""
        if sampled.prompt_logprobs:  # the batch's spans, made again from the same plan
            prompt_logprobs.record(plan, prompt_logprobs.plan_spans(plan), sampled.prompt_logprobs)
        produced = self.scheduler.apply(plan, sampled.tokens)
        seen = {id(r) for r in produced}  # finished without a token: emit their end too
        produced += [c.req for c in plan.chunks if c.req.finished and id(c.req) not in seen]
        self.steps += 1
        return produced

    def check(self) -> None:
        if self.check_invariants:
            # A broken invariant means cached KV can no longer be trusted: raising here
            # halts the engine loudly (see `run`).
            self.scheduler.check_integrity()

    def fail(self, plan: StepPlan, exc: Exception) -> None:
        self.scheduler.prefix.free_deferred()
        for chunk in plan.chunks:
            req = chunk.req
            req.inflight -= 1
            req.settle()
            if not req.finished:
                req.finish("error")
                req.error = str(exc)
            if not req.inflight:  # else: when the look-ahead step that has it lands
                self.scheduler.release(req)
            self.output.fail(req, RuntimeError(f"step failed: {exc}"))


def tree_moves(plan: StepPlan, sampled: StepOutput, page_size: int) -> list[tuple[int, int]]:
    """The KV copies that put each token tree's accepted side nodes at their own slots."""
    moves: list[tuple[int, int]] = []
    row = 0
    for ch in plan.chunks:
        rows = 1 + len(ch.draft) if ch.draft else int(ch.samples)
        if ch.tree is not None and not ch.req.finished:
            ids = [t.token_id for t in sampled.tokens[row : row + rows]]
            moves += tree.kv_moves(ch.req, ch.start, ch.draft, ch.tree, ids, page_size)
        row += rows
    return moves


def tree_shape(ch: ScheduledChunk) -> tuple[int, int]:
    """A draft model's chain length and next-best tokens a position (ModelDrafter.propose_tree)."""
    if ch.tree is None:
        return len(ch.draft), 0
    main = ch.tree.main
    return main, (len(ch.draft) - main) // main


def drafts_pending(plan: StepPlan) -> bool:
    return any(c.draft and c.draft[0] == PENDING for c in plan.chunks)


def build_forward_batch(plan: StepPlan, state_copies: tuple[tuple[int, int], ...] = ()) -> ForwardBatch:
    """The device's copy of a plan: token ids, state slots and sampling settings as
    plain values, and the state copies to make before the forward.

    A verify step (a decode with drafts) goes to the device as one decode row per
    position, all on the request's table row: row j feeds token j at position start + j
    and samples as plain decoding would after the drafts before it (step, history). The
    attention backends write a step's KV before they read it, so row j sees rows < j:
    each row is the decode step that position would have had without speculation. A
    token tree's side nodes run on their branches' scratch rows, with the branches' extra
    rows (not sampled: kernel/speculative/tree.py). A
    hybrid model's verify step is one chunk instead (the recurrent state runs through
    its positions, each written to a slot of its own: `HybridState.plan_verify`), every
    position sampled (`sample_back`); in deterministic mode a position's logits do not
    depend on whether it was reached in a chunk or a decode (invariant 7)."""
    chunks: list[PrefillChunk] = []
    sampling: list[tuple[int, SamplingRow]] = []
    back: list[int] = []  # per sampling row: tokens before its chunk's last one
    moved: dict[int, int] = {}  # plan chunk index -> batch chunk index, where they differ
    for i, ch in enumerate(plan.chunks):
        req = ch.req
        assert req.row is not None
        if i != len(chunks):
            moved[i] = len(chunks)
        ids = tuple(req.token_slice(ch.start, ch.start + ch.length))
        if ch.draft and not ch.state_dst:
            for token, table_row, position, before in verify_rows(req, ch):
                sampling.append((len(chunks), before))
                back.append(0)
                chunks.append(PrefillChunk((token,), table_row, position))
            tokens = ids + ch.draft
            for node, table_row, position in ch.tree.extra if ch.tree is not None else ():
                chunks.append(PrefillChunk((tokens[node + 1],), table_row, position))  # not sampled
            continue
        main = ch.tree.main if ch.tree is not None else len(ch.draft)
        chunks.append(PrefillChunk(ids + ch.draft[:main], req.row, ch.start, ch.state_src, ch.state_dst,
                                   ch.state_track))
        if ch.draft:  # hybrid: one chunk (its recurrent state runs through it), every position sampled
            row = sampling_row(req)
            for j in range(main + 1):
                sampling.append((len(chunks) - 1, draft_test(verify_row(row, req, ch.draft[:j]), ch, j)))
                back.append(main - j)
            for index, back_of, before in side_rows(req, ch, row, chunks):
                sampling.append((index, before))
                back.append(back_of)
        elif ch.samples:
            sampling.append((len(chunks) - 1, sampling_row(req)))
            back.append(0)
    spans = prompt_logprobs.plan_spans(plan)
    if moved:
        spans = tuple(s._replace(chunk=moved.get(s.chunk, s.chunk)) for s in spans)
    steps = {ch.steps for ch in plan.chunks} or {1}
    if len(steps) > 1:
        raise ValueError(f"a step's chunks disagree on its decode run: {sorted(steps)} steps")
    run = steps.pop()
    return ForwardBatch.build(chunks, sampling, state_copies, spans, tuple(back), steps=run,
                              run_stops=tuple(ch.run_stops for ch in plan.chunks) if run > 1 else ())


def side_rows(req: Request, ch: ScheduledChunk, row: SamplingRow,
              chunks: list[PrefillChunk]) -> list[tuple[int, int, SamplingRow]]:
    """A hybrid token tree's side branches, each appended to `chunks` as a chunk of its own
    on its scratch row: its extra rows' tokens, then its side nodes' — from the request's
    state at the input token, the state after each side node to its slot
    (kernel/speculative/tree.py). Returns (batch chunk, tokens before the chunk's last,
    how it samples) per side node, in node order."""
    if ch.tree is None:
        return []
    tokens = req.token_slice(ch.start, ch.start + 1) + list(ch.draft)
    on_row: dict[int, list[int]] = {}  # scratch row -> its branch's side nodes
    for node in range(ch.tree.main, len(ch.draft)):
        on_row.setdefault(ch.tree.rows[node], []).append(node)
    placed: dict[int, tuple[int, int]] = {}  # side node -> (batch chunk, tokens before the chunk's last)
    for table_row, nodes in on_row.items():
        ids = [tokens[node + 1] for node, r, _ in ch.tree.extra if r == table_row] + [tokens[n + 1] for n in nodes]
        ends = [ch.start + len(ids) - len(nodes) + 1 + k for k in range(len(nodes))]
        slots = [ch.tree.states[n - ch.tree.main] for n in nodes]
        chunks.append(PrefillChunk(tuple(ids), table_row, ch.start, ch.state_src, slots[-1],
                                   tuple(zip(ends[:-1], slots[:-1]))))
        placed.update({n: (len(chunks) - 1, len(nodes) - 1 - k) for k, n in enumerate(nodes)})
    return [(*placed[i], verify_row(row, req, tuple(ch.draft[n] for n in tree.path(ch.tree.parents, i))))
            for i in range(ch.tree.main, len(ch.draft))]


def verify_rows(req: Request, ch: ScheduledChunk) -> list[tuple[int, int, int, SamplingRow]]:
    """A dense verify step's decode rows: (token, table row, position, how it samples) for
    the input token, then each drafted token — a chain's on the request's row, a tree's
    side nodes on their scratch rows, each after the drafts on its path."""
    assert req.row is not None
    row = sampling_row(req)
    out = [(req.token_slice(ch.start, ch.start + 1)[0], req.row, ch.start, draft_test(row, ch, 0))]
    if ch.tree is None:
        for j, token in enumerate(ch.draft):
            testing = draft_test(verify_row(row, req, ch.draft[: j + 1]), ch, j + 1)
            out.append((token, req.row, ch.start + 1 + j, testing))
        return out
    depth = tree.depths(ch.tree.parents)
    for i, token in enumerate(ch.draft):
        on_path = tuple(ch.draft[n] for n in tree.path(ch.tree.parents, i))
        out.append((token, ch.tree.rows[i], ch.start + depth[i], verify_row(row, req, on_path)))
    return out


def sampling_row(req: Request) -> SamplingRow:
    p = req.params
    row = SamplingRow(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        frequency_penalty=p.frequency_penalty, presence_penalty=p.presence_penalty,
        repetition_penalty=p.repetition_penalty, top_logprobs_num=p.top_logprobs_num,
        seed=req.seed, step=len(req.output_ids), logit_bias=p.logit_bias, grammar=req.grammar,
        logprobs=p.return_logprob or p.top_logprobs_num > 0 or req.audit_logprobs,
    )
    if not row.needs_history:
        return row
    # A snapshot: the loop appends to output_ids while this step may still be running.
    return dataclasses.replace(row, prompt_ids=tuple(req.prompt_ids), output_ids=tuple(req.output_ids))


def draft_test(row: SamplingRow, ch: ScheduledChunk, j: int) -> SamplingRow:
    """Row j of a chain's verify step (the one that samples the token after j drafts), with
    the draft it tests under rejection-sampling acceptance: draft j and the distribution it
    was drawn from (gpu/rejection.py). The last row, past every draft, draws as usual."""
    if not ch.rejection or j >= len(ch.draft):
        return row
    q = ch.draft_probs[j] if ch.draft_probs is not None else None
    return dataclasses.replace(row, draft_token=ch.draft[j], draft_q=q)


def draws(ch: ScheduledChunk) -> SamplingRow | None:
    """How a draft model draws `ch`'s drafts: the request's temperature and truncation at
    the step of its first draft under rejection-sampling acceptance, else None (greedy)."""
    return sampling_row(ch.req) if ch.rejection else None


def verify_row(row: SamplingRow, req: Request, accepted: tuple[int, ...]) -> SamplingRow:
    """How the position after `accepted` drafts samples: the draw of that step, the
    history with those drafts in it and its grammar's mask after them (the only case in
    which its token is used)."""
    if not accepted:
        return row
    grammar = req.grammar.ahead(accepted) if req.grammar is not None else None
    step = dataclasses.replace(row, step=row.step + len(accepted), grammar=grammar)
    if not row.needs_history:
        return step
    return dataclasses.replace(step, output_ids=row.output_ids + accepted)
