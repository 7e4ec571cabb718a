"""The structured-output gate in front of the scheduler: a request whose grammar is not
compiled yet waits here (parked, not queued), so it never holds a batch slot or pages
while a worker thread compiles; once compiled it gets its own matcher and is queued, and
a grammar that fails ends it with the error. `prepare` compiles ahead (the HTTP layer and
the offline Engine await it before queueing), so the usual path never parks at all.
`advance_grammar` is the other end: the scheduler advances a request's matcher by each
token it accepts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from gpu.tokenizer import Tokenizer
from kernel.admission import EngineUnavailable
from kernel.config import StructuredConfig
from kernel.request import Request
from kernel.sampling_params import SamplingParams
from kernel.structured.grammar import GrammarCache, GrammarCompiler, GrammarError, GrammarKey, grammar_key

log = structlog.get_logger("tierserve")


class GrammarGate:
    def __init__(
        self, tokenizer: Tokenizer | None, vocab_size: int, config: StructuredConfig,
        queue: Callable[[Request], None], fail: Callable[[Request, BaseException], None],
    ) -> None:
        self.cache: GrammarCache | None = None  # None: no tokenizer, so no grammar can be matched
        if tokenizer is not None:
            self.cache = GrammarCache(lambda: GrammarCompiler(tokenizer, vocab_size), config.max_grammar_chars,
                                      config.cache_size, config.compile_threads)
        self._queue = queue
        self._fail = fail
        self.parked: dict[str, Request] = {}
        self.closed = False

    def check(self, params: SamplingParams) -> GrammarKey | None:
        """The grammar `params` name, if any, after the checks that need no compiling."""
        key = grammar_key(params)
        if key is not None:
            self._cache(key).check_size(key)
        return key

    async def prepare(self, params: Iterable[SamplingParams]) -> None:
        """Compile the grammars `params` name (on worker threads, cached) so queuing them
        does not wait; raises GrammarError naming the problem."""
        keys = {key for p in params if (key := self.check(p)) is not None}
        # shield: a caller that goes away must not cancel a compilation others share.
        await asyncio.gather(*(asyncio.shield(self._cache(k).compile(k)) for k in keys))

    def admit(self, req: Request, key: GrammarKey) -> None:
        """Queue `req` with its matcher if its grammar is compiled; else park it until it is."""
        cache = self._cache(key)
        compiled = cache.ready(key)
        if compiled is not None:
            req.grammar = cache.matcher(compiled)
            self._queue(req)
            return
        self.parked[req.rid] = req
        cache.compile(key).add_done_callback(lambda fut: self._unpark(req, cache, fut))

    def _unpark(self, req: Request, cache: GrammarCache, fut: asyncio.Future[Any]) -> None:
        self.parked.pop(req.rid, None)
        if req.finished:  # aborted while it waited: its stream has ended
            return
        exc = EngineUnavailable("engine is shut down") if self.closed or fut.cancelled() else fut.exception()
        if exc is not None:
            req.finish("error")
            req.error = str(exc)
            self._fail(req, exc)
            return
        req.grammar = cache.matcher(fut.result())
        self._queue(req)

    def _cache(self, key: GrammarKey) -> GrammarCache:
        if self.cache is None:
            raise GrammarError(f"{key[0]} needs the model's tokenizer, and this model has none", key[0])
        return self.cache

    def shutdown(self) -> None:
        self.closed = True
        if self.cache is not None:
            self.cache.shutdown()


def advance_grammar(req: Request, token_id: int) -> bool:
    """Advance `req`'s matcher by its new token; True if that ended the request: the
    grammar terminated (finish_reason "stop"), or refused the token ("error": the mask
    was not applied, which is a bug worth a loud log line)."""
    assert req.grammar is not None
    if not req.grammar.accept(token_id):
        log.error("grammar_refused_token", rid=req.rid, token_id=token_id)
        req.finish("error")
        req.error = f"token {token_id} is not allowed by the request's grammar"
        return True
    if req.grammar.terminated:
        req.finish("stop", token_id)
        return True
    return False
