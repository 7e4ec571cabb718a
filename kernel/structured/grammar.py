"""Structured outputs: grammars compiled off the event loop, cached by their text, and
the per-request matcher that constrains sampling (xgrammar, chosen by measuring:
benchmarks/grammar_engines.py).

A request names at most one grammar in its SamplingParams: `json_schema`, `regex` or
`ebnf` (xgrammar's GBNF dialect). `GrammarCache.compile` checks it (size, JSON, JSON
Schema) and compiles it on a worker thread; concurrent requests for the same text share
one compilation, and an LRU keeps the compiled grammars by (kind, text). Each request
gets its own `RequestGrammar` (so each of `n` choices has one): the device thread reads
it to fill the allowed-token bitmask (gpu/grammar_mask.py), the loop advances it with
every token the request accepts.

NOTE: the matcher is touched by one thread at a time. The loop advances it only when
applying a step's tokens, and a request is in at most one step in flight, so the device
thread's mask fill for step N+1 never overlaps the loop's advance for step N.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import jsonschema
import torch

from gpu.tokenizer import Tokenizer
from kernel.sampling_params import GRAMMAR_FIELDS, SamplingParams, SamplingParamsError

if TYPE_CHECKING:
    import xgrammar


GrammarKey = tuple[str, str]  # (kind, text): kind is a SamplingParams field name
_ENGINE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")  # xgrammar's "[time] file.cc:line: "


class GrammarError(SamplingParamsError):
    """A grammar that cannot be used (too large, malformed, unsupported); `param` names it."""


def grammar_key(params: SamplingParams) -> GrammarKey | None:
    for kind in GRAMMAR_FIELDS:
        text = getattr(params, kind)
        if text is not None:
            return kind, text
    return None


class GrammarCompiler:
    """xgrammar over one tokenizer: checks and compiles a (kind, text). Thread-safe."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        # NOTE: vocab_size is the model's (lm_head rows); ids past the tokenizer's are
        # never allowed by the mask xgrammar fills.
        info = xgrammar.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend), vocab_size=vocab_size,
            stop_token_ids=sorted(tokenizer.eos_token_ids),
        )
        self._xgr = xgrammar
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, key: GrammarKey) -> xgrammar.CompiledGrammar:
        kind, text = key
        if kind == "json_schema":
            check_json_schema(text)
        try:
            if kind == "json_schema":
                # No free whitespace: a small model could otherwise pad forever.
                return self._compiler.compile_json_schema(text, any_whitespace=False)
            if kind == "regex":
                return self._compiler.compile_regex(text)
            return self._compiler.compile_grammar(text)
        except (RuntimeError, ValueError) as exc:
            raise GrammarError(f"{kind} cannot be compiled: {_engine_message(exc)}", kind) from None

    def matcher(self, compiled: xgrammar.CompiledGrammar) -> RequestGrammar:
        return RequestGrammar(self._xgr.GrammarMatcher(compiled))


def check_json_schema(text: str) -> None:
    """A clear 400 for text that is not JSON, or JSON that is not a JSON Schema."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"json_schema is not valid JSON: {exc}", "json_schema") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"json_schema must be a JSON object, got {type(schema).__name__}", "json_schema")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "the top level"
        raise GrammarError(f"json_schema is not a valid JSON Schema (at {where}): {exc.message}",
                           "json_schema") from None


def _engine_message(exc: Exception) -> str:
    """The compiler's first line without its source location."""
    text = str(exc).strip()
    return _ENGINE_PREFIX.sub("", text.splitlines()[0]) if text else type(exc).__name__


class RequestGrammar:
    """One request's matcher: fills its row of the bitmask, advances with its tokens."""

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self._matcher = matcher

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 [B, ceil(V/32)] bitmask."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar refuses it (a masking bug)."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        """The grammar has ended (it accepted a stop token): the request is done."""
        return bool(self._matcher.is_terminated())

    def legal_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar allows in a row from here, short of one that
        terminates it (no position after that has a mask: the request ends there, and the
        row before samples that token anyway); the matcher is left as it was."""
        accepted, ends = 0, False
        for token in tokens:
            if not self._matcher.accept_token(token):
                break
            accepted += 1
            if self._matcher.is_terminated():
                ends = True
                break
        if accepted:
            self._matcher.rollback(accepted)
        return accepted - 1 if ends else accepted

    def ahead(self, tokens: tuple[int, ...]) -> AheadMask:
        """The masker of the position after `tokens` (speculative decoding: a verify row)."""
        return AheadMask(self._matcher, tokens)


class AheadMask:
    """Fills the mask of the position after `tokens`: advances the matcher by them, fills,
    rolls back. NOTE: called on the device thread while the step runs, like fill_mask; the
    loop advances the matcher only once the step's tokens are back."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, tokens: tuple[int, ...]) -> None:
        self._matcher = matcher
        self._tokens = tokens

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        accepted = 0
        try:
            for token in self._tokens:
                if not self._matcher.accept_token(token):
                    raise RuntimeError(f"draft token {token} is not allowed by the grammar (drafts are checked first)")
                accepted += 1
            self._matcher.fill_next_token_bitmask(bitmask, row)
        finally:
            if accepted:
                self._matcher.rollback(accepted)


class GrammarCache:
    """Compiled grammars by (kind, text), LRU, compiled on worker threads (never the loop).

    The compiler itself (xgrammar's tokenizer tables, ~0.5 s) is built on first use, so
    engines that never see a grammar never pay for it.
    """

    def __init__(self, make_compiler: Callable[[], GrammarCompiler], max_chars: int, capacity: int,
                 threads: int) -> None:
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self.max_chars = max_chars
        self.capacity = capacity
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tierserve-grammar")
        self._entries: OrderedDict[GrammarKey, asyncio.Future[Any]] = OrderedDict()
        self.compiles = 0  # compilations started (a hit starts none)

    def check_size(self, key: GrammarKey) -> None:
        kind, text = key
        if len(text) > self.max_chars:
            raise GrammarError(
                f"{kind} is {len(text)} characters, over the limit of {self.max_chars} "
                "(structured.max_grammar_chars)", kind,
            )

    def compile(self, key: GrammarKey) -> asyncio.Future[Any]:
        """The compiled grammar of `key` (a future: shared while compiling, kept once done);
        it raises GrammarError for a grammar that cannot be used."""
        self.check_size(key)
        fut = self._entries.get(key)
        if fut is not None:
            self._entries.move_to_end(key)
            return fut
        loop = asyncio.get_running_loop()
        fut = asyncio.ensure_future(loop.run_in_executor(self._pool, self._compile, key))
        self.compiles += 1
        self._entries[key] = fut
        fut.add_done_callback(lambda f: self._settle(key, f))
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return fut

    def ready(self, key: GrammarKey) -> Any | None:
        """The compiled grammar if it is done and good (no wait), else None."""
        fut = self._entries.get(key)
        if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None:
            return None
        self._entries.move_to_end(key)
        return fut.result()

    def matcher(self, compiled: Any) -> RequestGrammar:
        assert self._compiler is not None  # something was compiled
        return self._compiler.matcher(compiled)

    def _compile(self, key: GrammarKey) -> Any:
        with self._compiler_lock:  # on a worker thread: built once, by the first compilation
            if self._compiler is None:
                self._compiler = self._make_compiler()
        return self._compiler.compile(key)

    def _settle(self, key: GrammarKey, fut: asyncio.Future[Any]) -> None:
        # A failed compilation is not kept: the error goes to those waiting now.
        if (fut.cancelled() or fut.exception() is not None) and self._entries.get(key) is fut:
            del self._entries[key]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
