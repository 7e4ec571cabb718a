"""AsyncEngine: the engine's face on the event loop.

It wires three parts, each in its own file: admission (kernel/admission.py: validate
and build requests), the step loop (kernel/scheduling/step_loop.py: plan, submit, emit, await,
apply) and output processing (kernel/results/output.py: tokens → text → stream chunks →
lifecycle events). Plugins (HTTP, admin socket, metrics) use only the public methods
below; they never reach into the scheduler or the pools.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import structlog
import torch

from gpu.cpu_threads import share_cpus
from gpu.device_thread import DeviceThread
from kernel import registry
from kernel.admission import Admission, BadPrompt, ContextOverflow, EngineUnavailable, RequestError
from kernel.audit import Auditor, Replayed, Served
from kernel.components import Components, build_components, pick_device
from kernel.config import Config, load_config
from kernel.logging_setup import setup_logging
from kernel.parallel.workers import TensorParallelRunner
from kernel.request import Request
from kernel.results.detokenizer import IncrementalDetokenizer
from kernel.results.events import EventBus
from kernel.results.output import Collected, OutputChunk, OutputProcessor
from kernel.sampling_params import SamplingParams
from kernel.scheduling.step_loop import StepLoop
from kernel.structured.grammar import GrammarError
from kernel.structured.grammar_gate import GrammarGate
from kernel.tiers.storage_tier import StorageTier

__all__ = [
    "AsyncEngine", "BadPrompt", "ContextOverflow", "EngineInfo", "EngineUnavailable", "GrammarError",
    "OutputChunk", "PolicyError", "RequestError",
]

log = structlog.get_logger("tierserve")

POLICY_KINDS = ("evict", "schedule")


class EngineInfo(NamedTuple):
    """What the engine serves, fixed once it is built."""

    model_name: str
    context_length: int
    num_pages: int
    page_size: int
    pool_tokens: int  # tokens the KV pool can hold (the reserved page excluded)
    vocab_size: int
    architecture: str  # the registry name of the model's architecture ("llama", "qwen3_5_text", ...)


class PolicyError(ValueError):
    """`set_policy` with an unknown kind or name; nothing changed."""


class AsyncEngine:
    """Create inside a running event loop with `await AsyncEngine.create(...)`."""

    def __init__(self, config: Config, parts: Components, device_thread: DeviceThread) -> None:
        self.config = config
        self.parts = parts
        self.scheduler = parts.scheduler
        self.tokenizer = parts.tokenizer
        self.device_thread = device_thread
        page_size = config.cache.page_size
        self.info = EngineInfo(
            model_name=parts.model_name, context_length=parts.context_length, num_pages=parts.num_pages,
            page_size=page_size, pool_tokens=(parts.num_pages - 1) * page_size,
            vocab_size=parts.runner.vocab_size, architecture=parts.runner.model.arch.architecture,
        )
        self.halt_reason: str | None = None  # set when the step loop stopped for good
        self._closed = False
        self.prompt_tokens = 0
        self.events = EventBus(strict=config.debug.check_invariants)  # for metrics, admin, logs
        self.admission = Admission(
            parts.tokenizer, self.info.vocab_size, parts.context_length, self.info.pool_tokens, config.seed
        )
        self.output = OutputProcessor(self.events, self._stop_by_text)
        self.grammars = GrammarGate(parts.tokenizer, self.info.vocab_size, config.structured, self._queue,
                                    self.output.fail)
        self.loop = StepLoop(
            self.scheduler, device_thread, parts.runner, self.output,
            check_invariants=config.debug.check_invariants, halt=self._halt, overlap=parts.overlap,
            text_first=parts.runner.device.type == "cpu",
        )
        self.host = self.scheduler.prefix.host  # the host tier, when hicache is on
        if self.host is not None:
            self.host.wake = self.loop.wake.set  # a finished load makes a request runnable
            if self.host.storage is not None:
                self.host.storage.wake = self.loop.wake.set
        self._loop_task = asyncio.get_running_loop().create_task(self.loop.run())
        self.auditor: Auditor | None = None
        if config.audit.sample_rate > 0:
            self.auditor = Auditor(config.audit, config.deterministic, self._replay, self._live_waiting)
            self.output.on_finished = self.auditor.offer

    @classmethod
    async def create(
        cls, config: Config | str | None = None, overrides: Mapping[str, Any] | None = None
    ) -> AsyncEngine:
        if not isinstance(config, Config):
            config = load_config(config, overrides)
        setup_logging(config.logging.level, config.logging.json)
        torch_device = pick_device(config)
        # On CUDA the device thread runs every step on a stream of its own.
        streams = (lambda: torch.cuda.Stream(torch_device)) if torch_device.type == "cuda" else None
        # Tensor parallelism: each rank keeps to its share of the cores (rank 0: this device thread).
        shares = share_cpus(config.parallel.tp_size, config.parallel.cpus_per_rank) if config.parallel.tp_size > 1 else None
        device_thread = DeviceThread(num_threads=config.model.num_threads, stream_factory=streams,
                                     cpus=shares[0] if shares else None)
        parts = await asyncio.get_running_loop().run_in_executor(
            None, lambda: device_thread.call(lambda: build_components(config, torch_device, shares, device_thread.post))
        )
        log.info(
            "engine_ready", pages=parts.num_pages, context=parts.context_length,
            intra_op_threads=device_thread.threads.intra_op, cpus=len(device_thread.threads.cpus),
        )
        return cls(config, parts, device_thread)

    # ---- requests ---------------------------------------------------------------
    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | Mapping[str, Any] | None = None,
        rid: str | None = None, priority: int = 0, namespace: str | None = None,
    ) -> str:
        """Validate and queue a request; raises RequestError without side effects."""
        return self._add(prompt, params, rid, priority, namespace).rid

    def _add(
        self, prompt: str | Sequence[int], params: SamplingParams | Mapping[str, Any] | None, rid: str | None,
        priority: int, namespace: str | None, audit: bool = False,
    ) -> Request:
        if self._closed:
            why = f"engine halted: {self.halt_reason}" if self.halt_reason else "engine is shut down"
            raise EngineUnavailable(why)
        if rid is not None and rid in self.output.streams:
            raise RequestError(f"request id {rid!r} is already in use")
        req = self.admission.build(prompt, params, rid, priority, namespace)
        req.audit = audit
        req.audit_logprobs = audit or (self.auditor is not None and self.auditor.draw())
        key = self.grammars.check(req.params)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, req.params.skip_special_tokens, req.params.stop)
        stream = self.output.open(req, detok)
        if req.params.max_new_tokens == 0 and req.params.logprob_start_len < 0:  # done without a step
            req.finish("length")
            stream.end()
            return req
        if key is not None:
            self.grammars.admit(req, key)  # queued now, or parked until its grammar is compiled
        else:
            self._queue(req)
        return req

    def _queue(self, req: Request) -> None:
        self.scheduler.add(req)
        self.loop.wake.set()
        if req.audit:  # no served traffic
            return
        self.prompt_tokens += len(req.prompt_ids)
        log.debug("request_queued", rid=req.rid, prompt_tokens=len(req.prompt_ids))
        if self.events.active:
            self.events.emit("queued", req.rid, prompt_tokens=len(req.prompt_ids))

    async def prepare_grammars(self, params: Iterable[SamplingParams]) -> None:
        """Compile the grammars `params` name (off the loop, cached; kernel/structured/grammar_gate.py);
        raises GrammarError naming the problem. The HTTP layer awaits this before it
        answers, so a bad grammar is a 400, never a broken stream."""
        await self.grammars.prepare(params)

    async def stream(self, rid: str) -> AsyncIterator[OutputChunk]:
        """Output chunks of `rid` until it finishes; leaving early aborts it."""
        st = self.output.streams[rid]
        try:
            while True:
                item = await st.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            self.abort(rid)
            self.output.streams.pop(rid, None)

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams | Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """One request to completion: {text, output_ids, meta_info} like the offline Engine."""
        return await self.collect(self.add_request(prompt, params))

    async def collect(self, rid: str) -> dict[str, Any]:
        params = self.output.streams[rid].req.params
        result = Collected(rid)
        async for chunk in self.stream(rid):
            result.add(chunk)
        return result.native(params.return_logprob, params.top_logprobs_num > 0)

    async def _replay(self, job: Served) -> Replayed:
        """The auditor's cold run of a served request (kernel/audit.py)."""
        req = self._add(job.prompt_ids, job.params, None, 0, job.namespace, audit=True)
        async for _ in self.stream(req.rid):
            pass
        return Replayed(list(req.output_ids), list(req.output_logprobs))

    def _live_waiting(self) -> bool:
        """Whether a live (not audit) request waits for admission or its grammar."""
        return bool(self.grammars.parked) or any(not r.audit for r in self.scheduler.waiting)

    def abort(self, rid: str) -> None:
        """Stop `rid`; a consumer of its stream gets a final chunk (finish_reason "abort")."""
        st = self.output.streams.get(rid)
        if st is not None and not st.req.finished:
            self.scheduler.abort(st.req)
            log.debug("request_aborted", rid=rid)
            self.output.publish_finished(st.req)
            if not st.req.inflight:  # an in-flight one ends through its step's output
                st.end()

    def _stop_by_text(self, req: Request, matched: str) -> None:
        self.scheduler.abort(req, "stop", matched)

    # ---- public surface for plugins (admin socket, metrics, HTTP) ---------------
    def is_idle(self) -> bool:
        """No request queued or running, no tier copy in flight and no audit replay due."""
        idle = not self.scheduler.has_work() and not self.grammars.parked
        idle = idle and (self.auditor is None or not self.auditor.pending())
        return idle and (self.host is None or not self.host.busy)

    def num_requests(self) -> int:
        """Requests queued or running (what a queue limit counts; an audit replay is not one)."""
        sched = self.scheduler
        live = sum(not r.audit for r in sched.waiting) + sum(not r.audit for r in sched.running)
        return live + len(self.grammars.parked)

    def cache_stats(self) -> dict[str, int]:
        """Engine-wide prefix-cache counters, in tokens (rates are for the reader)."""
        reuse = self.scheduler.prefix
        return {
            "prefix_query_tokens": reuse.query_tokens,
            "prefix_hit_tokens": reuse.hit_tokens,
            # Hybrid models: cached KV a hit could not use for want of a state at its end.
            "prefix_truncated_tokens": reuse.truncated_tokens,
            "cached_pages": reuse.cache.total_pages,
            "evictable_pages": reuse.cache.evictable_pages,
            "cached_states": reuse.cache.total_states,
        }

    def stats(self) -> dict[str, Any]:
        """Pool, request and cache accounting, computed here and nowhere else."""
        sched = self.scheduler
        alloc = sched.allocator
        cache = self.cache_stats()
        return {
            "pages": {
                "usable": alloc.num_usable,
                "free": alloc.num_free,
                "cached": cache["cached_pages"],
                "evictable": cache["evictable_pages"],
                # Pages requests own outright (not shared through the tree).
                "held": alloc.num_usable - alloc.num_free - cache["cached_pages"],
            },
            "rows": {"usable": sched.req_table.num_rows - 1, "free": sched.req_table.num_free,
                     # token trees' side rows (kernel/speculative/tree.py), lent one step at a time
                     "scratch": sched.req_table.num_scratch, "scratch_free": sched.req_table.num_scratch_free},
            "states": self._state_stats(),
            "host": self.host.stats() if self.host is not None else None,
            "storage": self.storage.stats() if self.storage is not None else None,
            "requests": {"waiting": len(sched.waiting), "running": len(sched.running)},
            "idle": self.is_idle(),
            "counters": {
                "steps": self.loop.steps,
                "prompt_tokens": self.prompt_tokens,
                "generation_tokens": self.output.generation_tokens,
            },
            "cache": cache,
            "num_retractions": sched.num_retractions,
            "speculative": sched.speculator.stats() if sched.speculator is not None else None,
            "decode_runs": sched.runs.stats() if sched.runs is not None else None,
            "audit": self.auditor.stats() if self.auditor is not None else None,
            # Mixture-of-experts models: tokens routed to each expert, per sparse layer.
            "moe": self.loop.runner.model.expert_tokens() if hasattr(self.loop.runner.model, "expert_tokens") else None,
            "policies": self.policies(),
            "parallel": self._parallel_stats(),
            "halt_reason": self.halt_reason,
        }

    def _parallel_stats(self) -> dict[str, Any] | None:
        """Tensor parallelism's ranks: alive, cores, each rank's pool bytes (None at tp_size 1)."""
        runner = self.loop.runner
        if not isinstance(runner, TensorParallelRunner):
            return None
        alloc, host = self.scheduler.allocator, self.host
        states = self._state_stats()
        return runner.rank_stats(alloc.num_usable - alloc.num_free,
                                 states["usable"] - states["free"] if states is not None else 0,
                                 host.host_pool if host is not None else None,
                                 host.host_pool.num_usable - host.host_pool.num_free if host is not None else 0)

    def _state_stats(self) -> dict[str, int] | None:
        """State slots of a hybrid model (None for dense models)."""
        hybrid = self.scheduler.hybrid
        if hybrid is None:
            return None
        cached = self.scheduler.prefix.cache.total_states
        return {"usable": hybrid.pool.num_usable, "free": hybrid.pool.num_free, "cached": cached,
                "held": hybrid.pool.num_usable - hybrid.pool.num_free - cached}

    def snapshot(self) -> list[dict[str, Any]]:
        """Every node of the prefix tree, root first (empty without a radix cache)."""
        return self.scheduler.prefix.cache.snapshot()

    def subscribe_kv_events(self, callback: Callable[[list[Any]], None]) -> Callable[[], None] | None:
        """Follow the prefix cache's KV events; None when it publishes none."""
        return self.scheduler.prefix.cache.subscribe(callback)

    def kv_snapshot_events(self) -> list[Any]:
        """The prefix cache as KV events a new follower applies (AllBlocksCleared, then
        what is cached); on the event loop, like every cache operation."""
        return self.scheduler.prefix.cache.snapshot_events()

    def check(self) -> str | None:
        """Run the integrity check now; the failure message, or None when it holds."""
        try:
            self.scheduler.check_integrity()
        except AssertionError as exc:
            return str(exc)
        return None

    async def settle_copies(self, timeout_s: float = 10.0) -> None:
        """Wait (bounded) until no host-tier copy is in flight."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.host is not None and self.host.busy and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.002)

    def flush_cache(self) -> tuple[bool, str]:
        """Empty the prefix cache. Only when idle: running requests hold cached nodes."""
        if not self.is_idle():
            copies = "" if self.host is None or not self.host.busy else " (or host-tier copies)"
            return False, f"cannot flush the cache while {self.num_requests()} requests{copies} are in flight"
        self.scheduler.prefix.cache.reset()
        log.info("cache_flushed")
        return True, "flushed"

    def set_policy(self, kind: str, name: str) -> None:
        """Switch the eviction or scheduling policy to a registered name."""
        if kind not in POLICY_KINDS:
            raise PolicyError(f"'kind' must be one of {list(POLICY_KINDS)}, got {kind!r}")
        known = registry.names(kind)
        # Registered names only: a dotted `pkg.module:Class` path would let a remote
        # caller import arbitrary code into the server.
        if name not in known:
            raise PolicyError(f"unknown {kind} policy {name!r}; known: {known}")
        if kind == "evict":
            cache = self.scheduler.prefix.cache
            if not cache.reuses:
                raise PolicyError("no prefix cache (cache.prefix is none), nothing to evict")
            cache.set_policy(registry.lookup("evict", name)())
        else:
            fallback = self.config.scheduler.lpm_fallback_queue
            self.scheduler.policy = registry.lookup("schedule", name)(lpm_fallback_queue=fallback)

    @property
    def storage(self) -> StorageTier | None:
        """The storage tier, when hicache.storage is set."""
        return self.host.storage if self.host is not None else None

    def set_storage(self, enabled: bool) -> None:
        """Switch the storage tier on (after it was switched off for failing) or off."""
        if self.storage is None:
            raise PolicyError("no storage tier (hicache.storage is none)")
        self.storage.set_enabled(enabled)

    def policies(self) -> dict[str, str | None]:
        """The registry names of the policies in use now."""
        cache = self.scheduler.prefix.cache
        evict = getattr(cache, "policy", None)
        return {
            "schedule": registry.name_of("schedule", self.scheduler.policy),
            "evict": registry.name_of("evict", evict) if evict is not None else None,
        }

    # ---- stopping ---------------------------------------------------------------
    async def shutdown(self) -> None:
        self._closed = True
        if self.auditor is not None:
            self.auditor.close()
        self._loop_task.cancel()
        await asyncio.gather(self._loop_task, return_exceptions=True)  # a dead loop's error was reported
        for st in list(self.output.streams.values()):
            st.queue.put_nowait(EngineUnavailable("engine shut down"))
        self.grammars.shutdown()
        if self.host is not None:
            await self._flush_tiers()
        self.device_thread.shutdown()
        await asyncio.get_running_loop().run_in_executor(None, self.parts.runner.close)

    async def _flush_tiers(self) -> None:
        """Shutdown: copies in flight land, then the storage writes queued (those of the
        copies too) finish, within `hicache.storage_flush_timeout_s`; nothing new starts."""
        assert self.host is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.hicache.storage_flush_timeout_s
        while self.host.copying and loop.time() < deadline:
            await asyncio.sleep(0.002)
        worker = self.host.worker
        await loop.run_in_executor(None, lambda: worker.shutdown(wait=True, timeout=max(deadline - loop.time(), 0.1)))
        if self.storage is not None:
            storage, left = self.storage, max(deadline - loop.time(), 0.1)  # one budget for both
            flushed = await loop.run_in_executor(None, lambda: storage.close(left))
            log.info("storage_flushed", complete=flushed, pages_written=self.storage.counters.written_pages)

    def _halt(self, exc: BaseException) -> None:
        """The step loop died: fail every client with the reason and take no new work."""
        self._closed = True
        self.halt_reason = f"{type(exc).__name__}: {exc}"
        log.error("engine_halted", reason=self.halt_reason)
        self.output.fail_all(exc)
        # Tensor-parallel workers left in a failed step are stopped (or killed) and reaped,
        # on the device thread: after any step still queued there, never beside one (a stop's
        # collectives and a step's on one group from two threads would hang both).
        self.device_thread.post(self.parts.runner.close)
