"""Output processing, the one path from sampled tokens to what a consumer reads:
detokenize → cut stop strings → stream chunks → lifecycle events, and the native result
dict (`{text, output_ids, meta_info}`) that the offline engine and the HTTP API return.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kernel.request import Request, Status
from kernel.results.detokenizer import IncrementalDetokenizer
from kernel.results.events import EventBus
from kernel.scheduling.prompt_logprobs import PromptScores, scores


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
    cached_by_tier: dict[str, int]
    prompt: PromptScores | None = None  # prompt logprobs: in the request's first chunk only
    # Speculative decoding so far: (drafted tokens, accepted tokens, verify steps).
    speculative: tuple[int, int, int] = (0, 0, 0)


@dataclass
class Collected:
    """Everything one request has produced so far: chunks added up."""

    rid: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    prompt: PromptScores | None = None
    speculative: tuple[int, int, int] = (0, 0, 0)

    def add(self, chunk: OutputChunk) -> None:
        self.text += chunk.text
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.top_logprobs += chunk.top_logprobs
        self.finish_reason = chunk.finish_reason
        self.matched_stop = chunk.matched_stop
        self.prompt_tokens = chunk.prompt_tokens
        self.completion_tokens = chunk.completion_tokens
        self.cached_tokens = chunk.cached_tokens
        self.cached_by_tier = chunk.cached_by_tier
        self.speculative = chunk.speculative
        if chunk.prompt is not None:
            self.prompt = chunk.prompt

    def native(self, return_logprob: bool, top_logprobs: bool) -> dict[str, Any]:
        """The native result: {text, output_ids, meta_info} (SGLang's shape)."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_tokens_by_tier": dict(self.cached_by_tier),
            "finish_reason": self.finish_reason,
            "matched_stop": self.matched_stop,
        }
        drafted, accepted, verify_steps = self.speculative
        if verify_steps:  # speculative decoding ran for it (SGLang reports spec_verify_ct)
            meta.update(spec_drafted_tokens=drafted, spec_accepted_tokens=accepted, spec_verify_ct=verify_steps,
                        spec_accept_length=accepted / verify_steps + 1)
        if return_logprob:
            meta["output_token_logprobs"] = list(zip(self.logprobs, self.token_ids))
            if top_logprobs:
                meta["output_top_logprobs"] = self.top_logprobs
        if return_logprob and self.prompt is not None:
            # SGLang's shape: (logprob, token id) per prompt token from logprob_start_len
            # (logprob None for token 0), and per token its top (logprob, id) pairs.
            meta["input_token_logprobs"] = list(zip(self.prompt.logprobs, self.prompt.token_ids))
            if self.prompt.top:
                meta["input_top_logprobs"] = self.prompt.top
        return {"text": self.text, "output_ids": list(self.token_ids), "meta_info": meta}


class RequestStream:
    """Per-request output state: where emission stands, detokenizer, consumer queue."""

    def __init__(self, req: Request, detok: IncrementalDetokenizer | None) -> None:
        self.req = req
        self.detok = detok
        self.emitted = 0
        self.admitted = False
        self.finish_published = False
        # A final chunk is queued: nothing more goes out. NOTE: a request that finished
        # while a later step ran it (a stop string, or a look-ahead step with overlap
        # scheduling) comes back from that step again; its stream may not be gone yet.
        self.closed = False
        self.prompt_sent = False  # prompt logprobs go out once, with the first chunk
        self.queue: asyncio.Queue[OutputChunk | BaseException] = asyncio.Queue()

    def chunk(self, text: str, new_ids: list[int], start: int) -> OutputChunk:
        req = self.req
        prompt = None
        if not self.prompt_sent:
            self.prompt_sent = True
            prompt = scores(req)
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
            cached_by_tier=dict(req.cached_by_tier),
            prompt=prompt,
            speculative=(req.spec_drafted, req.spec_accepted, req.spec_steps),
        )

    def end(self) -> None:
        """Queue a final chunk with nothing new (the request ended without a token)."""
        self.put(self.chunk("", [], self.emitted))

    def put(self, chunk: OutputChunk) -> None:
        self.closed = chunk.finished
        self.queue.put_nowait(chunk)


StopText = Callable[[Request, str], None]  # finish a request whose text hit a stop string


class OutputProcessor:
    """Turns the requests a step gave tokens to into chunks on their streams.

    `emit` runs on the event loop while the next step is in flight; it may finish a
    request (a stop string in its text) through `stop_text`, never anything else.
    """

    def __init__(self, events: EventBus, stop_text: StopText) -> None:
        self.streams: dict[str, RequestStream] = {}
        self.events = events
        self.stop_text = stop_text
        self.generation_tokens = 0
        self.on_finished: Callable[[Request], None] | None = None  # the audit's sampling (kernel/audit.py)

    def open(self, req: Request, detok: IncrementalDetokenizer | None) -> RequestStream:
        stream = RequestStream(req, detok)
        self.streams[req.rid] = stream
        return stream

    def emit(self, reqs: Iterable[Request]) -> None:
        for req in reqs:
            st = self.streams.get(req.rid)
            if st is not None and not st.closed:
                self._emit_one(st)

    def _emit_one(self, st: RequestStream) -> None:
        req = st.req
        start = st.emitted
        new_ids = req.output_ids[start:]
        text = self._detokenize(st, new_ids) if st.detok is not None else ""
        new_ids = req.output_ids[start:]  # a stop string may have cut them
        st.emitted = len(req.output_ids)
        st.put(st.chunk(text, new_ids, start))
        if req.audit:  # a replay is no served traffic: no counter, no event
            if req.finished:
                st.finish_published = True
            return
        self.generation_tokens += len(new_ids)
        if self.events.active:
            self.events.emit("tokens", req.rid, count=len(new_ids), first=start == 0)
        if req.finished:
            self.publish_finished(req)

    def _detokenize(self, st: RequestStream, new_ids: list[int]) -> str:
        """The text `new_ids` release, pushed one token at a time as plain decoding does.
        NOTE: a verify step (speculative decoding) brings several tokens at once; a stop
        string completed by one of them ends the request there: the tokens after it are
        dropped (`Request.cut_output`), as if they had never been sampled."""
        assert st.detok is not None
        req, pieces = st.req, []
        for i, piece in enumerate([(t,) for t in new_ids] or [()]):
            step = st.detok.push(piece)
            pieces.append(step.text)
            if step.stop_hit:
                assert step.matched_stop is not None
                if i + 1 < len(new_ids):
                    req.cut_output(len(req.output_ids) - len(new_ids) + i + 1)
                    if req.finished:  # by a dropped token (max_tokens, a stop token): never produced
                        req.finish_reason, req.matched_stop = "stop", step.matched_stop
                self.stop_text(req, step.matched_stop)
                return "".join(pieces)
        if req.finished:
            pieces.append(st.detok.finish())
        return "".join(pieces)

    def publish_admitted(self, reqs: Iterable[Request]) -> None:
        for req in reqs:
            st = self.streams.get(req.rid)
            if st is not None and not st.admitted and not req.audit:
                st.admitted = True
                if self.events.active:
                    self.events.emit("admitted", req.rid, cached_tokens=req.cached_tokens)

    def publish_finished(self, req: Request) -> None:
        """Once per request, whichever path ended it."""
        st = self.streams.get(req.rid)
        if st is None or st.finish_published:
            return
        st.finish_published = True
        if req.audit:
            return
        if self.on_finished is not None:
            self.on_finished(req)
        if self.events.active:
            self.events.emit(
                "finished", req.rid, reason=req.finish_reason, prompt_tokens=len(req.prompt_ids),
                completion_tokens=req.num_generated, cached_tokens=req.cached_tokens,
            )

    def fail(self, req: Request, exc: BaseException) -> None:
        """Deliver `exc` to the request's consumer (its stream raises it)."""
        self.publish_finished(req)
        st = self.streams.get(req.rid)
        if st is not None:
            st.queue.put_nowait(exc)

    def fail_all(self, exc: BaseException) -> None:
        for st in self.streams.values():
            self.publish_finished(st.req)
            st.queue.put_nowait(exc)
