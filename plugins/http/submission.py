"""The engine requests behind one HTTP request, merged into one stream of events.

Every engine request gets a pump task that drains `engine.stream(rid)` into one queue.
The pumps are created before the handler can next be cancelled, so they always start;
cancelling a started pump closes the engine stream, which aborts the request and frees
its pages within one step. That is how a client disconnect (aiohttp cancels the
handler), a drain timeout, a halted engine and a failed batch admission all clean up
the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence

from kernel.async_engine import (
    AsyncEngine,
    ContextOverflow,
    EngineInfo,
    EngineUnavailable,
    OutputChunk,
    RequestError,
)
from kernel.sampling_params import SamplingParams, SamplingParamsError
from plugins.http.errors import APIError, bad_request, client_words, halted, sampling_error
from plugins.http.protocol import Prompt

_SHUTDOWN = "shutdown"

Event = tuple[int, OutputChunk | BaseException | str]


class Submission:
    """Pumps for `rids`; iterate `events()`, and always `close()` (see the module doc)."""

    def __init__(self, engine: AsyncEngine, rids: Sequence[str]) -> None:
        self.engine = engine
        self.rids = list(rids)
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._pumps = [asyncio.create_task(self._pump(i, rid)) for i, rid in enumerate(self.rids)]

    async def _pump(self, index: int, rid: str) -> None:
        try:
            async for chunk in self.engine.stream(rid):
                self._events.put_nowait((index, chunk))
        except Exception as exc:  # noqa: BLE001 - a failed step or halted engine: the handler reports it
            self._events.put_nowait((index, exc))

    async def events(self) -> AsyncIterator[tuple[int, OutputChunk]]:
        """(index, chunk) in arrival order until every request has finished."""
        remaining = len(self.rids)
        while remaining:
            index, item = await self._next()
            if isinstance(item, str):  # _SHUTDOWN
                raise APIError(503, "the server is shutting down; generation was aborted", code="shutdown")
            if isinstance(item, BaseException):
                if self.engine.halt_reason is not None:
                    raise halted(self.engine.halt_reason) from item
                raise APIError(500, f"generation failed: {item}") from item
            if item.finished:
                remaining -= 1
            yield index, item

    async def _next(self) -> Event:
        """The next event. A halting engine fails every stream it had (so a pump
        delivers the error); one that had halted before we looked is a 503 at once."""
        reason = self.engine.halt_reason
        if reason is not None:
            raise halted(reason)
        return await self._events.get()

    def abort(self) -> None:
        """Stop generating now (drain timeout): the handler's `events()` raises 503."""
        for pump in self._pumps:
            pump.cancel()
        self._events.put_nowait((-1, _SHUTDOWN))

    async def close(self) -> None:
        try:
            # Let pumps created just now reach their stream first: a task cancelled
            # before its first step never runs the stream's clean-up.
            await asyncio.sleep(0)
        finally:
            for pump in self._pumps:
                pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)


async def submit(
    engine: AsyncEngine, requests: Sequence[tuple[Prompt, SamplingParams]],
    names: Mapping[str, str], max_queued: int,
) -> Submission:
    """Queue every request or none: a refused one rolls back those already queued."""
    if engine.halt_reason is not None:
        raise halted(engine.halt_reason)
    queued = engine.num_requests()
    if queued + len(requests) > max_queued:
        raise APIError(
            429, f"the server queue is full ({queued} requests, limit {max_queued}); retry later",
            code="queue_full", headers={"Retry-After": "1"},
        )
    try:  # compiled before anything is queued or answered: a bad grammar is a 400
        await engine.prepare_grammars(p for _, p in requests)
    except SamplingParamsError as exc:
        raise sampling_error(exc, names) from None
    rids: list[str] = []
    for prompt, params in requests:
        try:
            rids.append(engine.add_request(prompt, params))
        except (RequestError, SamplingParamsError) as exc:
            for rid in rids:
                engine.abort(rid)  # synchronous: out of the waiting queue before any step
            await Submission(engine, rids).close()
            raise refusal(engine, exc, prompt, params, names) from None
    return Submission(engine, rids)


def refusal(
    engine: AsyncEngine, exc: RequestError | SamplingParamsError, prompt: Prompt, params: SamplingParams,
    names: Mapping[str, str],
) -> APIError:
    """The HTTP answer to a request `add_request` refused, decided by type, not text."""
    if engine.halt_reason is not None:  # halted between the check above and now
        return halted(engine.halt_reason)
    if isinstance(exc, SamplingParamsError):
        return sampling_error(exc, names)
    if isinstance(exc, EngineUnavailable):
        return APIError(503, str(exc), code="engine_stopped")
    code = "context_length_exceeded" if isinstance(exc, ContextOverflow) else None
    return bad_request(client_words(str(exc), names), param="prompt", code=code)


def token_limit(info: EngineInfo) -> int:
    """Prompt + output tokens one request may have: the context, or the KV pool if smaller."""
    return min(info.context_length, info.pool_tokens)

