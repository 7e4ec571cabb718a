"""AsyncEngine: admission, the step loop and per-request output streams on one event loop.

The loop plans step N+1 as soon as step N's tokens are applied, submits it to the
device thread, and only then detokenizes and streams step N's tokens, so text work
overlaps the forward pass. Only token ids cross back from the device thread.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, NamedTuple

import structlog

from gpu.device_thread import DeviceThread
from gpu.forward_batch import ForwardBatch, SamplingRow
from kernel import registry
from kernel.components import Components, build_components, pick_device
from kernel.config import Config, load_config
from kernel.detokenizer import IncrementalDetokenizer
from kernel.events import EventBus
from kernel.logging_setup import setup_logging
from kernel.request import Request, Status
from kernel.sampling_params import SamplingParams
from kernel.scheduler import StepPlan

log = structlog.get_logger("tierserve")


class RequestError(ValueError):
    """A request the engine refuses; nothing about the engine's state changed."""


class OutputChunk(NamedTuple):
    """What one step adds to a request's output (deltas), plus its state after it."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finished: bool
    finish_reason: str | None
    matched_stop: str | int | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class EngineInfo(NamedTuple):
    """What the engine serves, fixed once it is built."""

    model_name: str
    context_length: int
    num_pages: int
    page_size: int
    pool_tokens: int  # tokens the KV pool can hold (the reserved page excluded)
    vocab_size: int


class PolicyError(ValueError):
    """`set_policy` with an unknown kind or name; nothing changed."""


POLICY_KINDS = ("evict", "schedule")


class _Stream:
    """Per-request output state: where emission stands, detokenizer, consumer queue."""

    def __init__(self, req: Request, detok: IncrementalDetokenizer | None) -> None:
        self.req = req
        self.detok = detok
        self.emitted = 0
        self.admitted = False
        self.finish_published = False
        self.queue: asyncio.Queue[OutputChunk | BaseException] = asyncio.Queue()


class AsyncEngine:
    """Create inside a running event loop with `await AsyncEngine.create(...)`."""

    def __init__(self, config: Config, parts: Components, device: DeviceThread) -> None:
        self.config = config
        self.parts = parts
        self.scheduler = parts.scheduler
        self.tokenizer = parts.tokenizer
        self.device = device
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._rng = random.Random(config.seed)
        self._closed = False
        self.counters = {"steps": 0, "prompt_tokens": 0, "generation_tokens": 0}
        self.events = EventBus()  # request lifecycle, for metrics and the admin socket
        self.halt_reason: str | None = None  # set when the step loop stopped for good
        page_size = config.cache.page_size
        self.info = EngineInfo(
            model_name=parts.model_name, context_length=parts.context_length, num_pages=parts.num_pages,
            page_size=page_size, pool_tokens=(parts.num_pages - 1) * page_size,
            vocab_size=parts.runner.vocab_size,
        )
        self._loop_task = asyncio.get_running_loop().create_task(self._run())

    @classmethod
    async def create(
        cls, config: Config | str | None = None, overrides: Mapping[str, Any] | None = None
    ) -> AsyncEngine:
        if not isinstance(config, Config):
            config = load_config(config, overrides)
        setup_logging(config.logging.level, config.logging.json)
        device = DeviceThread(num_threads=config.model.num_threads)
        torch_device = pick_device(config)
        parts = await asyncio.get_running_loop().run_in_executor(
            None, lambda: device.call(lambda: build_components(config, torch_device))
        )
        log.info("engine_ready", pages=parts.num_pages, context=parts.context_length)
        return cls(config, parts, device)

    # ---- admission ------------------------------------------------------------
    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | Mapping[str, Any] | None = None,
        rid: str | None = None, priority: int = 0, namespace: str | None = None,
    ) -> str:
        """Validate and queue a request; raises RequestError without side effects."""
        if self._closed:
            raise RequestError("engine is shut down (or halted by a failed integrity check)")
        if not isinstance(params, SamplingParams):
            params = SamplingParams.from_dict(params)
        ids = self._tokenize(prompt)
        self._check_fits(ids, params)
        rid = rid or uuid.uuid4().hex
        if rid in self._streams:
            raise RequestError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(rid=rid, prompt_ids=ids, params=params, seed=seed, priority=priority, namespace=namespace)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop)
        self._streams[rid] = _Stream(req, detok)
        if params.max_new_tokens == 0:  # nothing to generate: done without a step
            req.finish("length")
            self._streams[rid].queue.put_nowait(_chunk(req, "", [], 0))
            return rid
        self.scheduler.add(req)
        self.counters["prompt_tokens"] += len(ids)
        log.debug("request_queued", rid=rid, prompt_tokens=len(ids))
        if self.events.active:
            self.events.publish("queued", rid, prompt_tokens=len(ids))
        self._wake.set()
        return rid

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: send token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.parts.runner.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                raise RequestError(f"prompt token ids must be integers in [0, {vocab})")
        if not ids:
            raise RequestError("prompt is empty")
        return ids

    def _check_fits(self, ids: list[int], params: SamplingParams) -> None:
        ctx = self.parts.context_length
        if len(ids) + params.max_new_tokens > ctx:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the context length {ctx}"
            )
        pool_tokens = (self.parts.num_pages - 1) * self.config.cache.page_size
        if len(ids) + params.max_new_tokens > pool_tokens:
            raise RequestError(
                f"prompt + max_new_tokens ({len(ids) + params.max_new_tokens}) exceeds the KV pool "
                f"({pool_tokens} tokens)"
            )

    # ---- consumption ----------------------------------------------------------
    async def stream(self, rid: str) -> AsyncIterator[OutputChunk]:
        """Output chunks of `rid` until it finishes; leaving early aborts it."""
        st = self._streams[rid]
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
            self._streams.pop(rid, None)

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams | Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """One request to completion: {text, output_ids, meta_info} like the offline Engine."""
        rid = self.add_request(prompt, params)
        return await self.collect(rid)

    async def collect(self, rid: str) -> dict[str, Any]:
        req = self._streams[rid].req
        text: list[str] = []
        last: OutputChunk | None = None
        async for chunk in self.stream(rid):
            text.append(chunk.text)
            last = chunk
        assert last is not None
        return _result(req, "".join(text), last)

    def abort(self, rid: str) -> None:
        """Stop `rid`; a consumer of its stream gets a final chunk (finish_reason "abort")."""
        st = self._streams.get(rid)
        if st is not None and not st.req.finished:
            self.scheduler.abort(st.req)
            log.debug("request_aborted", rid=rid)
            self._publish_finished(st.req)
            if not st.req.inflight:  # an in-flight one ends through its step's output
                st.queue.put_nowait(_chunk(st.req, "", [], st.emitted))

    def is_idle(self) -> bool:
        return not self.scheduler.has_work()

    def flush_cache(self) -> tuple[bool, str]:
        """Empty the prefix cache. Only when idle: running requests hold cached nodes."""
        if not self.is_idle():
            n = len(self.scheduler.running) + len(self.scheduler.waiting)
            return False, f"cannot flush the cache while {n} requests are in flight"
        self.scheduler.cache.reset()
        log.info("cache_flushed")
        return True, "flushed"

    def cache_stats(self) -> dict[str, int]:
        """Engine-wide prefix-cache counters, in tokens (rates are for the reader)."""
        cache = self.scheduler.cache
        return {
            "prefix_query_tokens": cache.query_tokens,
            "prefix_hit_tokens": cache.hit_tokens,
            "cached_pages": cache.tree_pages,
            "evictable_pages": cache.evictable_pages,
        }

    # ---- public surface for plugins (admin socket, metrics, HTTP) ---------------
    def num_requests(self) -> int:
        """Requests queued or running (what a queue limit counts)."""
        return len(self.scheduler.waiting) + len(self.scheduler.running)

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
            "requests": {"waiting": len(sched.waiting), "running": len(sched.running)},
            "idle": self.is_idle(),
            "counters": dict(self.counters),
            "cache": cache,
            "num_retractions": sched.num_retractions,
            "policies": self.policies(),
            "halt_reason": self.halt_reason,
        }

    def snapshot(self) -> list[dict[str, Any]]:
        """Every node of the prefix tree (empty without a radix cache)."""
        tree = self._tree()
        return tree.snapshot() if tree is not None else []

    def subscribe_kv_events(self, callback: Callable[[list[Any]], None]) -> Callable[[], None] | None:
        """Follow the prefix tree's KV events; None when there is no tree."""
        tree = self._tree()
        return tree.subscribe(callback) if tree is not None else None

    def check(self) -> str | None:
        """Run the integrity check now; the failure message, or None when it holds."""
        try:
            self.scheduler.check_integrity()
        except AssertionError as exc:
            return str(exc)
        return None

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
            tree = self._tree()
            if tree is None:
                raise PolicyError("no prefix cache (cache.prefix is none), nothing to evict")
            tree.set_policy(registry.lookup("evict", name)())
        else:
            fallback = self.config.scheduler.lpm_fallback_queue
            self.scheduler.policy = registry.lookup("schedule", name)(lpm_fallback_queue=fallback)

    def policies(self) -> dict[str, str | None]:
        """The registry names of the policies in use now."""
        tree = self._tree()
        return {
            "schedule": registry.name_of("schedule", self.scheduler.policy),
            "evict": registry.name_of("evict", tree.policy) if tree is not None else None,
        }

    def _tree(self) -> Any:
        return getattr(self.scheduler.cache, "tree", None)

    async def shutdown(self) -> None:
        self._closed = True
        self._loop_task.cancel()
        try:
            await self._loop_task
        except asyncio.CancelledError:
            pass
        for st in list(self._streams.values()):
            st.queue.put_nowait(RequestError("engine shut down"))
        self.device.shutdown()

    # ---- the step loop --------------------------------------------------------
    async def _run(self) -> None:
        pending: list[Request] = []
        while True:
            plan = self.scheduler.schedule() if self.scheduler.has_work() else None
            fut = None
            if plan is not None and self.events.active:
                self._publish_scheduling(plan)
            if plan is not None and plan.chunks:
                batch = self._build_batch(plan)
                fut = self.device.submit(lambda b=batch: self.parts.runner.run(b))  # type: ignore[misc]
            if pending:
                self._emit(pending)  # overlaps with the step in flight
                pending = []
            if fut is None:
                if plan is not None and self.scheduler.has_work():
                    await asyncio.sleep(0.001)  # nothing runnable yet; do not spin hot
                    continue
                self._wake.clear()
                await self._wake.wait()
                continue
            assert plan is not None
            try:
                sampled = await fut
            except Exception as exc:  # a failed step fails its requests, not the engine
                log.exception("step_failed")
                self._fail(plan, exc)
                continue
            pending = self.scheduler.apply(plan, sampled)
            produced = {id(r) for r in pending}  # finished without a token: emit their end too
            pending += [c.req for c in plan.chunks if c.req.finished and id(c.req) not in produced]
            self.counters["steps"] += 1
            if self.config.debug.check_invariants:
                try:
                    self.scheduler.check_integrity()
                except AssertionError as exc:
                    # A broken invariant means cached KV can no longer be trusted: stop
                    # serving, and tell every waiting client why instead of hanging.
                    log.error("integrity_check_failed", error=str(exc))
                    self._halt(exc)
                    return

    def _build_batch(self, plan: StepPlan) -> ForwardBatch:
        chunks, sampling = [], []
        for i, ch in enumerate(plan.chunks):
            req = ch.req
            assert req.row is not None
            chunks.append((req.token_slice(ch.start, ch.start + ch.length), req.row, ch.start, ch.length))
            if ch.samples:
                row = SamplingRow(req.params, req.seed, len(req.output_ids), req.prompt_ids, req.output_ids)
                sampling.append((i, row))
        return ForwardBatch.build(chunks, sampling)

    def _emit(self, reqs: list[Request]) -> None:
        for req in reqs:
            st = self._streams.get(req.rid)
            if st is None:
                continue
            new_ids = req.output_ids[st.emitted :]
            start = st.emitted
            st.emitted = len(req.output_ids)
            text = ""
            if st.detok is not None:
                step = st.detok.push(new_ids)
                text = step.text
                if step.stop_hit:
                    self.scheduler.abort(req, "stop", step.matched_stop)
                    req.finish_reason, req.matched_stop = "stop", step.matched_stop
                if req.finished and not step.stop_hit:
                    text += st.detok.finish()
            self.counters["generation_tokens"] += len(new_ids)
            st.queue.put_nowait(_chunk(req, text, new_ids, start))
            if self.events.active:
                self.events.publish("tokens", req.rid, count=len(new_ids), first=start == 0)
                if req.finished:
                    self._publish_finished(req)

    def _publish_scheduling(self, plan: StepPlan) -> None:
        for req in plan.retracted:
            self.events.publish("retracted", req.rid)
        for chunk in plan.chunks:
            st = self._streams.get(chunk.req.rid)
            if st is not None and not st.admitted:
                st.admitted = True
                self.events.publish("admitted", chunk.req.rid, cached_tokens=chunk.req.cached_tokens)

    def _publish_finished(self, req: Request) -> None:
        st = self._streams.get(req.rid)
        if st is None or st.finish_published:
            return
        st.finish_published = True
        if self.events.active:
            self.events.publish(
                "finished", req.rid, reason=req.finish_reason, prompt_tokens=len(req.prompt_ids),
                completion_tokens=len(req.output_ids), cached_tokens=req.cached_tokens,
            )

    def _halt(self, exc: BaseException) -> None:
        self._closed = True
        for st in self._streams.values():
            st.queue.put_nowait(exc)

    def _fail(self, plan: StepPlan, exc: Exception) -> None:
        for ch in plan.chunks:
            req = ch.req
            req.inflight = False
            if not req.finished:
                req.finish("error")
                req.error = str(exc)
            self.scheduler.release(req)
            self._publish_finished(req)
            st = self._streams.get(req.rid)
            if st is not None:
                st.queue.put_nowait(RuntimeError(f"step failed: {exc}"))


def _chunk(req: Request, text: str, new_ids: list[int], start: int) -> OutputChunk:
    return OutputChunk(
        text=text,
        token_ids=new_ids,
        logprobs=req.output_logprobs[start : start + len(new_ids)],
        top_logprobs=req.output_top_logprobs[start : start + len(new_ids)],
        finished=req.status is Status.FINISHED,
        finish_reason=req.finish_reason,
        matched_stop=req.matched_stop,
        prompt_tokens=len(req.prompt_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
    )


def _result(req: Request, text: str, last: OutputChunk) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": req.rid,
        "prompt_tokens": last.prompt_tokens,
        "completion_tokens": last.completion_tokens,
        "cached_tokens": last.cached_tokens,
        "finish_reason": last.finish_reason,
        "matched_stop": last.matched_stop,
    }
    if req.params.return_logprob:
        meta["output_token_logprobs"] = list(zip(req.output_logprobs, req.output_ids))
        if req.params.top_logprobs_num:
            meta["output_top_logprobs"] = req.output_top_logprobs
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}
