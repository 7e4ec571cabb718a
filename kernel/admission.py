"""Admission: turn a prompt and its parameters into a validated Request, or refuse it.

A refusal raises a `RequestError` subclass before anything changes, so a caller may
queue several requests and roll back the ones already queued if a later one fails.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from gpu.tokenizer import Tokenizer
from kernel.request import Request
from kernel.sampling_params import SamplingParams, SamplingParamsError


class RequestError(ValueError):
    """A request the engine refuses; nothing about the engine's state changed."""


class BadPrompt(RequestError):
    """The prompt cannot be used (empty, out-of-vocabulary ids, text without a tokenizer)."""


class ContextOverflow(RequestError):
    """Prompt + max_new_tokens exceed the context length or the KV pool."""


class EngineUnavailable(RequestError):
    """The engine is shut down or halted; it takes no new work."""


class Admission:
    def __init__(
        self, tokenizer: Tokenizer | None, vocab_size: int, context_length: int, pool_tokens: int, seed: int
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.pool_tokens = pool_tokens
        self._rng = random.Random(seed)

    def build(
        self, prompt: str | Sequence[int], params: SamplingParams | Mapping[str, Any] | None,
        rid: str | None, priority: int, namespace: str | None,
    ) -> Request:
        """A new Request; raises RequestError (or SamplingParamsError) and changes nothing."""
        if not isinstance(params, SamplingParams):
            params = SamplingParams.from_dict(params)
        ids = self.tokenize(prompt)
        self.check_fits(ids, params)
        self.check_vocab(params)
        check_logprob_start(ids, params)
        # Unseeded requests draw a seed here, so a retracted request repeats its draws.
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        return Request(rid=rid or uuid.uuid4().hex, prompt_ids=ids, params=params, seed=seed,
                       priority=priority, namespace=namespace)

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise BadPrompt("this model has no tokenizer: send token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
                raise BadPrompt(f"prompt token ids must be integers in [0, {vocab})")
        if not ids:
            raise BadPrompt("prompt is empty")
        return ids

    def check_vocab(self, params: SamplingParams) -> None:
        """The vocabulary-dependent parameter checks SamplingParams cannot make alone."""
        vocab = self.vocab_size
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise SamplingParamsError(f"logit_bias token ids must be in [0, {vocab}), got {bad[0]}", "logit_bias")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:  # a token the model can never produce: a typo or another model's id, not a stop
            raise SamplingParamsError(f"stop_token_ids must be in [0, {vocab}), got {bad[0]}", "stop_token_ids")

    def check_fits(self, ids: list[int], params: SamplingParams) -> None:
        need = len(ids) + params.max_new_tokens
        if need > self.context_length:
            raise ContextOverflow(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the context length {self.context_length}"
            )
        if need > self.pool_tokens:
            raise ContextOverflow(
                f"prompt + max_new_tokens ({need}) exceeds the KV pool ({self.pool_tokens} tokens)"
            )


def check_logprob_start(ids: list[int], params: SamplingParams) -> None:
    """Prompt logprobs start inside the prompt (a start past it would return nothing)."""
    if params.logprob_start_len >= len(ids):
        raise SamplingParamsError(
            f"logprob_start_len must be below the prompt length ({len(ids)} tokens), "
            f"got {params.logprob_start_len}", "logprob_start_len",
        )
