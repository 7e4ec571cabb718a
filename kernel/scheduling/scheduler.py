"""Continuous batching: plan each step from request and cache state alone (no tensors
but the request-table rows it writes), and apply the step's sampled tokens.

A step mixes decodes (tail of 1 token) and prefill chunks under the token budget
`max_num_batched_tokens`, at most `chunked_prefill_size` tokens per prefill chunk and
at most `max_running_requests` admitted requests. Running out of pages is a
scheduling event: prefill chunks shrink to an aligned cut or wait; a decode that
cannot get a page retracts the newest running request (pages freed, re-queued, later
recomputed); nothing is lost.
"""

from __future__ import annotations

from collections.abc import Sequence

from cache.allocator import PageAllocator, pages_for
from cache.req_table import ReqToTokenTable
from gpu.forward_batch import SampledToken
from kernel.config import SchedulerConfig
from kernel.request import Request, Status
from kernel.scheduling.chunk_planner import plan_chunk
from kernel.scheduling.decode_runs import DecodeRuns
from kernel.scheduling.policy import SchedulePolicy
from kernel.scheduling.prefix_reuse import PrefixReuse
from kernel.scheduling.step_plan import ScheduledChunk, StepPlan
from kernel.speculative.speculator import Speculator
from kernel.speculative.tree import VerifyTree, free_scratch, main_length, plan_scratch, side_states, walk
from kernel.speculative.tree import depths as tree_depths
from kernel.states.hybrid_state import HybridState
from kernel.structured.grammar_gate import advance_grammar


def live_first(ordered: list[Request]) -> list[Request]:
    """The policy's order with audit replays moved behind every live request (admission
    stops at the first request that does not fit, so a replay never holds one up)."""
    return [r for r in ordered if not r.audit] + [r for r in ordered if r.audit]


def _shared_pages(a: list[int], b: list[int], page_size: int) -> int:
    """Tokens in the whole pages that `a` and `b` share from the start."""
    n, limit = 0, min(len(a), len(b)) // page_size * page_size
    while n < limit and a[n : n + page_size] == b[n : n + page_size]:
        n += page_size
    return n


class IntegrityError(AssertionError):
    """An invariant of the architecture page does not hold."""


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        page_size: int,
        allocator: PageAllocator,
        req_table: ReqToTokenTable,
        policy: SchedulePolicy,
        eos_ids: frozenset[int],
        max_context: int,
        prefix: PrefixReuse,
        hybrid: HybridState | None = None,
        speculator: Speculator | None = None,
        runs: DecodeRuns | None = None,
    ) -> None:
        self.config = config
        self.page_size = page_size
        self.allocator = allocator
        self.req_table = req_table
        self.policy = policy
        self.eos_ids = eos_ids
        self.max_context = max_context
        self.prefix = prefix
        self.hybrid = hybrid
        self.speculator = speculator  # speculative decoding (kernel/speculative/)
        self.runs = runs  # decode runs (kernel/scheduling/decode_runs.py); None: one step a call
        # Where non-final prefill chunks may end (invariant 1): pages, and for hybrid
        # models that checkpoint also the state grid (a multiple of the page size).
        self.grid = hybrid.interval if hybrid is not None and hybrid.checkpoints else page_size
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admitted (hold a table row), oldest first
        self.num_retractions = 0
        self.drain = False  # overlap: a retraction waits for the steps in flight (see _newest)

    # ---- queue ------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)
        if self.runs is not None:
            self.runs.interrupt()  # a decode run under way ends after its step: admit `req` next

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, req: Request, reason: str = "abort", matched: str | int | None = None) -> None:
        """Finish `req` early (abort, or a stop string seen in its text); its pages
        return now, or when the step it is part of lands."""
        if req.finished:
            return
        req.finish(reason, matched)
        if req in self.waiting:
            self.waiting.remove(req)
        elif not req.inflight:
            self.release(req)

    # ---- planning ---------------------------------------------------------------
    def schedule(self) -> StepPlan:
        retracted: list[Request] = []
        if self.prefix.host is not None:
            self.prefix.host.before_plan()  # deferred copies, write-back victims
        if self.speculator is not None:
            self.speculator.begin_step(sum(1 for r in self.running if r.total_len - r.kv_len == 1))
        while True:
            chunks = self._plan(retracted)
            # A request waiting for its prefix to load is not blocked: do not retract it.
            victim = None
            if not chunks and self.running and not any(r.loading is not None for r in self.running):
                # Every admitted request is blocked on pages the others hold: give the
                # newest one's pages back so the older ones can move.
                victim = self._newest(exclude=())
            if victim is None:
                chunks = self._decode_run(chunks)
                for chunk in chunks:
                    chunk.req.inflight += 1
                return StepPlan(chunks, retracted)
            retracted.append(self._retract(victim))

    def _plan(self, retracted: list[Request]) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        planned: set[int] = set()
        for req in list(self.running):
            if req.status is not Status.RUNNING or req.total_len - req.kv_len != 1 or budget == 0:
                continue
            if req.inflight and not req.ahead:
                continue  # overlap: its step in flight decides what comes next
            if not self._reserve_decode(req, planned, retracted):
                continue
            draft, tree = self._draft(req, budget - 1)
            chunk = self._chunk(req, 1, draft, tree)
            if draft and self.speculator is not None and self.speculator.rejects(req):
                chunk = chunk._replace(rejection=True)
            chunks.append(chunk)
            planned.add(id(req))
            budget -= 1 + len(draft) + (len(tree.extra) if tree is not None else 0)
        for req in list(self.running):
            if req.loading is not None and self.prefix.host is not None:
                self.prefix.host.expire(req)
            if req.loading is not None:
                continue  # its prefix is being loaded back from the host tier
            if req.inflight and not req.ahead:
                continue
            if req.status is Status.RUNNING and req.total_len - req.kv_len > 1 and budget > 0:
                length = self._plan_prefill(req, budget)
                if length:
                    chunks.append(self._chunk(req, length))
                    budget -= length
        for req in live_first(self.policy.order(self.waiting, self.prefix)):
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if self.req_table.num_free == 0:
                break
            if self.hybrid is not None and not self.hybrid.can_admit():
                break  # out of state slots: a scheduling event, the request waits
            if self.prefix.storage_wait(req):
                continue  # its prefix is coming in from storage: admit it once it is in the tree
            if self._prefix_in_flight(req):
                continue  # another request is computing its prefix: reuse it next step
            length = self._plan_prefill(req, budget, admitting=True)
            if req.loading is not None:
                continue  # admitted; it computes once its prefix is back from the host tier
            if not length:
                break
            chunks.append(self._chunk(req, length))
            budget -= length
        return chunks

    def _decode_run(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """The plan as one decode run of several steps, where it may be one
        (kernel/scheduling/decode_runs.py): its pages are taken here, free ones only."""
        runs = self.runs
        if runs is None:
            return chunks
        spec = self.speculator
        steps = runs.length(chunks, self.running, len(self.waiting), self.allocator.num_free, self.page_size,
                            self.max_context, spec.quiet_steps if spec is not None else None)
        if steps == 1:
            return chunks
        for chunk in chunks:
            reserved = self._reserve(chunk.req, chunk.req.kv_len + steps, evict=False)
            assert reserved, "free pages promised for the run"
            if spec is not None:
                spec.rest(chunk.req, steps - 1)
        runs.runs += 1
        runs.planned()
        return [c._replace(steps=steps, run_stops=self._stop_ids(c.req)) for c in chunks]

    def _stop_ids(self, req: Request) -> tuple[int, ...]:
        """The token ids that end `req` (as `_append` decides): its stop ids, and EOS unless ignored."""
        eos = () if req.params.ignore_eos else tuple(sorted(self.eos_ids))
        return eos + tuple(req.params.stop_token_ids)

    def _chunk(self, req: Request, length: int, draft: tuple[int, ...] = (),
               tree: VerifyTree | None = None) -> ScheduledChunk:
        samples = req.kv_len + length == req.total_len and req.params.max_new_tokens > 0
        if self.hybrid is None:
            return ScheduledChunk(req, req.kv_len, length, samples=samples, draft=draft, tree=tree)
        if draft:  # the main chain's chunk; a tree's side branches run from its src (tree.py)
            main = tree.main if tree is not None else len(draft)
            src, dst, track = self.hybrid.plan_verify(req, req.kv_len, length + main)
            if tree is not None:
                tree = tree._replace(states=self.hybrid.plan_side(req, len(draft) - main))
            return ScheduledChunk(req, req.kv_len, length, src, dst, track, samples, draft, tree)
        src, dst, track = self.hybrid.plan(req, req.kv_len, length)
        return ScheduledChunk(req, req.kv_len, length, src, dst, track, samples)

    def _draft(self, req: Request, budget: int) -> tuple[tuple[int, ...], VerifyTree | None]:
        """Tokens `req` verifies after its decode token this step (speculative decoding),
        and their tree (None: a chain): within the token budget, its max_new_tokens and
        the context, and the pages that are free now. NOTE: a guess never evicts a cached
        prefix or retracts a request."""
        spec = self.speculator
        if spec is None:
            return (), None
        p = req.params
        room = (len(req.pages) + self.allocator.num_free) * self.page_size - req.total_len
        slots = self.hybrid.spare_slots() - 1 if self.hybrid is not None else 1 << 30
        room = min(room, slots)  # hybrid: a state slot per position of the verify chunk, side nodes too
        depth = min(room, p.max_new_tokens - len(req.output_ids) - 1, self.max_context - req.total_len - 1)
        tree = spec.draft(req, depth, budget)
        if not tree.tokens:
            return (), None
        reserved = self._reserve(req, req.total_len + max(tree_depths(tree.parent_list())), evict=False)
        assert reserved, "free pages promised for the draft"
        if not tree.parents:
            return tree.tokens, None
        draft, planned = plan_scratch(req, tree, self.allocator, self.req_table, self.page_size,
                                      max_rows=min(budget - len(tree.tokens), spec.rows_left),
                                      max_side=slots - main_length(tree.parents))
        spec.rows_left -= len(planned.extra) if planned is not None else 0
        return draft, planned

    def _prefix_in_flight(self, req: Request) -> bool:
        """Whether a prefilling request shares a prefix of >= share_prefix_min_tokens
        with `req` and is still computing part of it that the cache does not hold yet
        (in-batch prefix sharing: wait a step rather than compute it twice)."""
        min_tokens = self.config.share_prefix_min_tokens
        if not min_tokens or not self.prefix.reuses:
            return False
        prefilling = [r for r in self.running if r.total_len - r.kv_len > 1]
        if not prefilling:
            return False
        cached = self.prefix.probe(req).length
        for other in prefilling:
            shared = _shared_pages(req.prompt_ids, other.prompt_ids, self.page_size)
            if shared >= min_tokens and cached < shared and other.kv_len < shared:
                return True
        return False

    def _plan_prefill(self, req: Request, budget: int, admitting: bool = False) -> int:
        if admitting:
            self._admit(req)
            if req.host_wait:  # its prefix is on host and cannot be loaded yet: wait
                req.host_wait = False
                self._unadmit(req)
                return 0
            if req.loading is not None:
                self.prefix.count_admission(req)
                return 0
        length = plan_chunk(
            start=req.kv_len,
            total=req.total_len,
            page_size=self.page_size,
            token_budget=min(budget, self.config.chunked_prefill_size),
            owned_pages=len(req.pages),
            free_pages=self.allocator.num_free + self.prefix.evictable_pages,
            grid=self.grid,
        )
        length = self._checkpoint_cut(req, length)
        if length == 0:
            if admitting:
                self._unadmit(req)
            return 0
        if admitting:
            self.prefix.count_admission(req)
        reserved = self._reserve(req, req.kv_len + length)
        assert reserved, "chunk planner promised pages that are neither free nor evictable"
        return length

    def _checkpoint_cut(self, req: Request, length: int) -> int:
        """A hybrid prompt's final chunk stops at its last checkpoint first, so the state
        there is cached too (the short tail runs in the next step)."""
        if self.grid == self.page_size or req.kv_len + length < req.total_len:
            return length
        last = (req.total_len - 1) // self.grid * self.grid
        return last - req.kv_len if last > req.kv_len else length

    def _reserve_decode(self, req: Request, planned: set[int], retracted: list[Request]) -> bool:
        while not self._reserve(req, req.kv_len + 1):
            victim = self._newest(exclude=planned)
            if victim is None:
                return False  # overlap: only requests in flight are left; wait for them to land
            retracted.append(self._retract(victim))
            if victim is req:
                return False
        return True

    def _reserve(self, req: Request, num_tokens: int, evict: bool = True) -> bool:
        """Make `req` own enough pages for `num_tokens` tokens; False if not free."""
        need = pages_for(num_tokens, self.page_size) - len(req.pages)
        if need <= 0:
            return True
        if evict and not self.allocator.can_allocate(need):
            self.prefix.evict(need - self.allocator.num_free)
        if not self.allocator.can_allocate(need):
            return False
        pages = self.allocator.allocate(need)
        assert req.row is not None
        self.req_table.write_pages(req.row, len(req.pages), pages, self.page_size)
        req.pages.extend(pages)
        return True

    def _admit(self, req: Request) -> None:
        row = self.req_table.allocate()
        assert row is not None
        req.row = row
        req.status = Status.RUNNING
        self.waiting.remove(req)
        self.running.append(req)
        self.running.sort(key=lambda r: r.arrival)
        if self.hybrid is not None:
            admitted = self.hybrid.admit(req)
            assert admitted, "can_admit promised state slots"
        self.prefix.match(req)

    def _unadmit(self, req: Request) -> None:
        """Undo an admission whose first chunk could not be planned."""
        self.release(req)
        req.status = Status.WAITING
        req.kv_len = 0
        self.waiting.append(req)

    def _newest(self, exclude: set[int] | Sequence[int]) -> Request | None:
        """The retraction victim: the newest running request not excluded. NOTE: a
        request in flight (overlap scheduling) is never retracted — its step still
        writes its pages: None then, and `drain` asks the loop to land the steps in
        flight before it plans again, so the same victim is retracted then."""
        candidates = [r for r in self.running if id(r) not in exclude]
        victim = max(candidates, key=lambda r: (r.audit, r.arrival))  # audit replays go first
        if victim.inflight:
            self.drain = True
            return None
        return victim

    def _retract(self, req: Request) -> Request:
        """Free a running request's pages and re-queue it; it recomputes later."""
        self.release(req)
        req.status = Status.WAITING
        req.kv_len = 0
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.append(req)
        return req

    def release(self, req: Request) -> None:
        """Return a request's pages and row (on finish, abort, error or retraction);
        computed whole pages stay in the prefix cache for later requests."""
        self.prefix.release(req)
        if self.speculator is not None:
            self.speculator.forget(req)
            free_scratch(req, self.allocator, self.req_table)
        if self.hybrid is not None:
            self.hybrid.release(req)
        if req.row is not None:
            self.req_table.free(req.row)
            req.row = None
        if req in self.running:
            self.running.remove(req)

    # ---- results ----------------------------------------------------------------
    def apply(self, plan: StepPlan, sampled: Sequence[SampledToken]) -> list[Request]:
        """Record a finished step; returns the requests that got a new token."""
        produced: list[Request] = []
        self.prefix.free_deferred()  # deferred while this step ran (overlap)
        tokens = iter(sampled)
        # A decode run's steps done (every chunk of a run samples each of them; fewer than
        # planned where an arrival or a row's stop token ended it early).
        done = len(sampled) // len(plan.chunks) if plan.chunks and plan.chunks[0].steps > 1 else 0
        if done and done < plan.chunks[0].steps and self.runs is not None:
            self.runs.cut += 1
        for chunk in plan.chunks:
            req = chunk.req
            req.inflight -= 1
            req.settle()
            if chunk.draft:
                verified = [next(tokens) for _ in range(1 + len(chunk.draft))]
                if self._verify(req, chunk, verified):
                    produced.append(req)
                continue
            if chunk.steps > 1:
                if self._land_run(req, chunk, [next(tokens) for _ in range(done)]):
                    produced.append(req)
                continue
            req.kv_len = self._computed_len(req, chunk)
            token = next(tokens) if chunk.samples else None
            if req.finished:  # aborted or stopped by text while this step ran
                self._release_landed(req)
                continue
            self._cache_step(req, chunk)
            if token is None:
                if req.kv_len == req.total_len:  # scored its prompt, generates nothing
                    req.finish("length")
                    self.release(req)
                continue
            self._append(req, token)
            produced.append(req)
            if req.finished:
                self._release_landed(req)
        return produced

    def _verify(self, req: Request, chunk: ScheduledChunk, sampled: list[SampledToken]) -> bool:
        """Apply a verify step (speculative decoding): the token sampled after the input
        token, then after each drafted token that is what was sampled before it (a tree's
        walk: kernel/speculative/tree.py) — exactly the tokens plain decoding would have
        produced, stops included. Whether
        `req` got tokens. NOTE: invariant 9: `kv_len` covers the input token and the
        accepted drafts only; the rejected drafts' KV lies past it (never cached), and
        pages holding nothing but theirs go back."""
        if self._finished_in_flight(req, chunk):
            return False
        parents = chunk.tree.parents if chunk.tree is not None else tuple(range(-1, len(chunk.draft) - 1))
        rows = walk(chunk.draft, parents, [t.token_id for t in sampled])
        appended = self._append_run(req, chunk, [sampled[row] for row in rows])
        assert self.speculator is not None
        main = chunk.tree.main if chunk.tree is not None else len(chunk.draft)
        side = (len(chunk.draft) - main, sum(1 for r in rows[1:appended] if r - 1 >= main))
        self.speculator.record(req, len(chunk.draft), appended - 1, max(tree_depths(parents)), side)
        free_scratch(req, self.allocator, self.req_table)
        if self.hybrid is not None:  # resume from the state after the last accepted token
            self.hybrid.land_verify(req, lambda slot, length: self.prefix.cache_checkpoint(req, slot, length),
                                    side_states(chunk.tree, chunk.start, rows[1:appended]))
        self._end_run(req)
        return True

    def _land_run(self, req: Request, chunk: ScheduledChunk, tokens: list[SampledToken]) -> bool:
        """Apply a decode run (kernel/scheduling/decode_runs.py): its tokens in order, up to
        the first that finishes `req`. Whether `req` got tokens."""
        if self._finished_in_flight(req, chunk):
            return False
        assert self.runs is not None and 0 < len(tokens) <= chunk.steps
        self.runs.tokens += self._append_run(req, chunk, tokens)
        self._end_run(req)
        return True

    def _finished_in_flight(self, req: Request, chunk: ScheduledChunk) -> bool:
        """Whether `req` was aborted or stopped by text while its verify step or run ran:
        then only its input token's KV counts, and it is released (once nothing carries it)."""
        if not req.finished:
            return False
        req.kv_len = min(chunk.start + 1, req.total_len)
        self._release_landed(req)
        return True

    def _append_run(self, req: Request, chunk: ScheduledChunk, tokens: Sequence[SampledToken]) -> int:
        """Append a verify step's accepted tokens or a run's, in order, up to the first that
        finishes `req`; how many. NOTE: invariant 9: `kv_len` then covers the input token
        and the appended ones but the last; KV the step wrote past that is never cached."""
        appended = 0
        for token in tokens:
            self._append(req, token)
            appended += 1
            if req.finished:
                break
        req.kv_len = chunk.start + appended
        return appended

    def _end_run(self, req: Request) -> None:
        """After a verify step or a run: release a finished request, else free the pages
        past what its next decode writes."""
        if req.finished:
            self._release_landed(req)
        else:
            self._trim_pages(req)

    def _trim_pages(self, req: Request) -> None:
        """Free the pages past what the next decode writes (rejected drafts' only)."""
        keep = pages_for(req.total_len, self.page_size)
        if len(req.pages) > keep:
            assert keep >= req.shared_pages
            self.allocator.free(req.pages[keep:])
            del req.pages[keep:]

    @staticmethod
    def _computed_len(req: Request, chunk: ScheduledChunk) -> int:
        """The request's tokens with valid KV once `chunk` has landed. NOTE: never past
        the tokens it has: one aborted while a look-ahead step ran it (overlap) dropped
        the previous step's token, and the KV that step computed for it is not valid."""
        return min(chunk.start + chunk.length, req.total_len)

    def _release_landed(self, req: Request) -> None:
        """Release a finished request once no step in flight carries it any more
        (overlap: the look-ahead step that has it too lands later and releases it)."""
        if not req.inflight:
            self.release(req)

    def _cache_step(self, req: Request, chunk: ScheduledChunk) -> None:
        """Offer what the step computed to the prefix cache: every prefill chunk's whole
        pages (dense), or a checkpoint with its state slot (hybrid)."""
        if self.hybrid is None:
            if chunk.length > 1:  # prefill (a verify step is applied by _verify)
                self.prefix.cache_computed(req)
            return
        for length, tracked in self.hybrid.tracked(req):
            donated = self.prefix.cache_checkpoint(req, tracked, length)
            self.hybrid.after_tracked(req, length, tracked, donated)
        slot = self.hybrid.after_step(req)
        if slot is not None:
            donated = self.prefix.cache_checkpoint(req, slot, req.kv_len)
            self.hybrid.after_insert(req, slot, donated)

    def _append(self, req: Request, token: SampledToken) -> None:
        req.output_ids.append(token.token_id)
        req.output_logprobs.append(token.logprob)
        if req.params.top_logprobs_num:
            req.output_top_logprobs.append(token.top_logprobs)
        params = req.params
        if req.grammar is not None and advance_grammar(req, token.token_id):
            return
        if not params.ignore_eos and token.token_id in self.eos_ids or token.token_id in params.stop_token_ids:
            req.finish("stop", token.token_id)
        elif len(req.output_ids) >= params.max_new_tokens or req.total_len >= self.max_context:
            req.finish("length")

    # ---- invariants -------------------------------------------------------------
    def check_integrity(self) -> None:
        """Invariants 1 and 3: aligned chunk cuts and exact page accounting."""
        held: list[int] = [p for r in self.running for p in r.pages[r.shared_pages :] + r.spec_scratch_pages]
        held += self.prefix.deferred  # duplicates a step in flight may still read
        host = self.prefix.host
        if host is not None:
            held += host.held_pages()  # pages loads in flight are filling
        if len(held) != len(set(held)):
            raise IntegrityError("a page is held by two requests")
        cached = self.prefix.cache.total_pages
        if self.allocator.num_free + len(held) + cached != self.allocator.num_usable:
            raise IntegrityError(
                f"page leak: free {self.allocator.num_free} + held {len(held)} + cached {cached} "
                f"!= usable {self.allocator.num_usable}"
            )
        own_states = self._check_states()
        # Also: no page (or state slot, or host page) both held and owned by the cache.
        self.prefix.cache.check_integrity(held, own_states, self._check_host())
        for req in self.running:
            if pages_for(req.kv_len, self.page_size) > len(req.pages):
                raise IntegrityError(f"request {req.rid} computed past its pages")
            if req.total_len - req.kv_len > 1 and req.kv_len % self.grid:
                raise IntegrityError(f"request {req.rid} was cut at unaligned {req.kv_len}")
        for req in self.waiting:
            if req.pages or req.row is not None or req.state_slot is not None or req.track_slot is not None:
                raise IntegrityError(f"waiting request {req.rid} holds pages, a row or a state slot")

    def _check_host(self) -> list[int]:
        """Host pages: free + cached + being written == usable. Returns those being written."""
        host = self.prefix.host
        if host is None:
            return []
        copying = host.held_host_pages()
        pool, cached = host.host_pool, self.prefix.cache.total_host_pages
        if pool.num_free + cached + len(copying) != pool.num_usable:
            raise IntegrityError(
                f"host page leak: free {pool.num_free} + cached {cached} + copying {len(copying)} "
                f"!= usable {pool.num_usable}"
            )
        return copying

    def _check_states(self) -> list[int]:
        """Invariant 2's accounting side: every state slot has exactly one owner, and
        every checkpoint length is on the grid. Returns the slots requests own."""
        if self.hybrid is None:
            return []
        pool = self.hybrid.pool
        own = self.hybrid.own_slots(self.running)
        if self.prefix.host is not None and self.prefix.host.storage is not None:
            own += self.prefix.host.storage.held_states()  # storage fetches fill them
        if len(own) != len(set(own)):
            raise IntegrityError(f"a state slot is owned by two requests: {sorted(own)}")
        cached = self.prefix.cache.total_states
        if pool.num_free + len(own) + cached != pool.num_usable:
            raise IntegrityError(
                f"state slot leak: free {pool.num_free} + held {len(own)} + cached {cached} "
                f"!= usable {pool.num_usable}"
            )
        for req in self.running:
            if req.checkpoint_len % self.hybrid.interval:
                raise IntegrityError(f"request {req.rid} checkpointed off the grid at {req.checkpoint_len}")
        return own
