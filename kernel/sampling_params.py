"""Per-request sampling parameters, validated once when the request arrives.

Field names follow the OpenAI / SGLang APIs so request bodies map onto them directly.
Every bad value raises `SamplingParamsError` naming the parameter, so the HTTP layer can
answer 400 with a useful message instead of failing later inside a batched step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_NEW_TOKENS_LIMIT = 1_000_000
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries per request (OpenAI documents no number; 300 is what we allow)
LOGIT_BIAS_LIMIT = 100.0  # each bias lies in [-100, 100], as OpenAI's
_TOKEN_KEY = re.compile(r"[0-9]+")  # a JSON object key naming a token id
_ALIASES = {"max_tokens": "max_new_tokens"}


class SamplingParamsError(ValueError):
    """A sampling parameter that cannot be used; `param` names it (None: the whole object)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    skip_special_tokens: bool = True
    # OpenAI's logit_bias: (token id, bias) pairs, ids increasing, added to the logits
    # before anything else (greedy too); a {"id": bias} mapping is accepted and normalized.
    # Ids are checked against the vocabulary at admission (kernel/admission.py).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Prompt logprobs (SGLang's names): the logprobs of prompt tokens logprob_start_len..
    # (-1: none; checked against the prompt length at admission; needs return_logprob),
    # with prompt_top_logprobs_num most likely tokens each (None: top_logprobs_num, as
    # SGLang uses one number for both; vLLM's prompt_logprobs sets it apart).
    logprob_start_len: int = -1
    prompt_top_logprobs_num: int | None = None
    # Structured output, at most one: a JSON Schema (its JSON text; an object is serialized),
    # a regular expression, or an EBNF grammar (xgrammar's GBNF dialect, rule `root`).
    # Compiled and checked by kernel/structured/grammar.py when the request is queued.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # Speculative decoding (the server's `speculative` config): false opts this request
    # out. Its output is the same either way; only its speed differs.
    speculative: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        # Validating here (not only in from_dict) keeps direct construction just as safe.
        for name in _FLOAT_FIELDS:  # an int where a float belongs is fine (temperature=0)
            value = getattr(self, name)
            if _is_int(value):
                object.__setattr__(self, name, float(value))
        _check_types(self)
        _check_ranges(self)

    @property
    def prompt_top_n(self) -> int:
        """Most likely tokens reported per prompt position."""
        n = self.prompt_top_logprobs_num
        return self.top_logprobs_num if n is None else n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SamplingParams:
        """Build from a user's dict; a None value means "use the default" (OpenAI clients send nulls)."""
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise SamplingParamsError(f"sampling params must be an object, got {type(d).__name__}")
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            name = _canonical_name(key)
            if name in kwargs:
                raise SamplingParamsError(f"{key}: given twice (max_tokens is an alias of max_new_tokens)", str(key))
            if value is not None:
                kwargs[name] = _coerce(name, value)
        try:
            return cls(**kwargs)
        except SamplingParamsError as e:
            aliases = [f"{a} is an alias of {n}" for a, n in _ALIASES.items() if a in d]
            if aliases:  # name the key the user actually wrote
                raise SamplingParamsError(f"{e} ({'; '.join(aliases)})", e.param) from None
            raise


_FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}
_FLOAT_FIELDS = frozenset(n for n, f in _FIELDS.items() if f.type == "float")
_INT_FIELDS = frozenset(n for n, f in _FIELDS.items() if f.type == "int")
_BOOL_FIELDS = frozenset(n for n, f in _FIELDS.items() if f.type == "bool")
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")


def _canonical_name(key: object) -> str:
    if not isinstance(key, str):
        raise SamplingParamsError(f"unknown sampling parameter {key!r}")
    name = _ALIASES.get(key, key)
    if name not in _FIELDS:
        raise SamplingParamsError(f"unknown sampling parameter {key!r}")
    return name


def _is_int(value: object) -> bool:
    # bool is a subclass of int, but `"top_k": true` is a client bug, not a number.
    return isinstance(value, int) and not isinstance(value, bool)


def _coerce(name: str, value: Any) -> Any:
    """Turn JSON shapes into field types: ints into floats, str/list into tuples."""
    if name in _FLOAT_FIELDS and _is_int(value):
        return float(value)
    if name == "stop":
        if isinstance(value, str):
            return (value,)
        if isinstance(value, list | tuple):
            return tuple(value)
        raise SamplingParamsError(f"stop must be a string or a list of strings, got {type(value).__name__}", "stop")
    if name == "json_schema" and isinstance(value, dict | bool):
        return json.dumps(value)
    if name == "stop_token_ids":
        if isinstance(value, list | tuple):
            return tuple(value)
        raise SamplingParamsError(
            f"stop_token_ids must be a list of integers, got {type(value).__name__}", "stop_token_ids"
        )
    return value


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (id, bias) pairs, from a {"id": bias} mapping or pairs."""
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, list | tuple) and all(isinstance(i, list | tuple) and len(i) == 2 for i in value):
        items = [tuple(i) for i in value]
    else:
        raise SamplingParamsError(
            f"logit_bias must be an object mapping token ids to biases, got {type(value).__name__}", "logit_bias"
        )
    if len(items) > MAX_LOGIT_BIAS:
        raise SamplingParamsError(
            f"logit_bias must have at most {MAX_LOGIT_BIAS} entries, got {len(items)}", "logit_bias"
        )
    out: dict[int, float] = {}
    for key, bias in items:
        if _is_int(key) or isinstance(key, str) and _TOKEN_KEY.fullmatch(key):
            token = int(key)
        else:
            raise SamplingParamsError(
                f"logit_bias keys must be token ids (non-negative integers), got {key!r}", "logit_bias"
            )
        if token < 0:
            raise SamplingParamsError(f"logit_bias keys must be non-negative token ids, got {token}", "logit_bias")
        if not (_is_int(bias) or isinstance(bias, float)) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise SamplingParamsError(
                f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}", "logit_bias"
            )
        if token in out:
            raise SamplingParamsError(f"logit_bias names token {token} twice", "logit_bias")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _check_types(p: SamplingParams) -> None:
    for name in _FIELDS:
        value = getattr(p, name)
        if name in _FLOAT_FIELDS:
            if not isinstance(value, float) or not math.isfinite(value):
                raise SamplingParamsError(f"{name} must be a finite number, got {value!r}", name)
        elif name in _INT_FIELDS and not _is_int(value):
            raise SamplingParamsError(f"{name} must be an integer, got {value!r}", name)
        elif name in _BOOL_FIELDS and not isinstance(value, bool):
            raise SamplingParamsError(f"{name} must be a boolean, got {value!r}", name)
    if p.seed is not None and not _is_int(p.seed):
        raise SamplingParamsError(f"seed must be an integer, got {p.seed!r}", "seed")
    if p.prompt_top_logprobs_num is not None and not _is_int(p.prompt_top_logprobs_num):
        raise SamplingParamsError(
            f"prompt_top_logprobs_num must be an integer, got {p.prompt_top_logprobs_num!r}",
            "prompt_top_logprobs_num",
        )
    if not isinstance(p.stop, tuple) or not all(isinstance(s, str) for s in p.stop):
        raise SamplingParamsError(f"stop must be a string or a list of strings, got {p.stop!r}", "stop")
    if not isinstance(p.stop_token_ids, tuple) or not all(_is_int(t) for t in p.stop_token_ids):
        raise SamplingParamsError(
            f"stop_token_ids must be a list of integers, got {p.stop_token_ids!r}", "stop_token_ids"
        )
    _check_grammar(p)


def _check_grammar(p: SamplingParams) -> None:
    given = [name for name in GRAMMAR_FIELDS if getattr(p, name) is not None]
    for name in given:
        value = getattr(p, name)
        if not isinstance(value, str) or not value:
            what = "a JSON Schema (an object, or its JSON text)" if name == "json_schema" else "a non-empty string"
            raise SamplingParamsError(f"{name} must be {what}, got {value!r}", name)
    if len(given) > 1:
        raise SamplingParamsError(f"give at most one of json_schema, regex and ebnf, got {given}", given[1])


def _check_ranges(p: SamplingParams) -> None:
    _require(0 <= p.max_new_tokens <= MAX_NEW_TOKENS_LIMIT, "max_new_tokens",
             f"in [0, {MAX_NEW_TOKENS_LIMIT}]", p.max_new_tokens)
    _require(p.temperature >= 0.0, "temperature", ">= 0", p.temperature)
    _require(0.0 < p.top_p <= 1.0, "top_p", "in (0, 1]", p.top_p)
    _require(p.top_k >= -1, "top_k", ">= -1 (-1 or 0 disables it)", p.top_k)
    _require(0.0 <= p.min_p <= 1.0, "min_p", "in [0, 1]", p.min_p)
    _require(-2.0 <= p.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]", p.frequency_penalty)
    _require(-2.0 <= p.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]", p.presence_penalty)
    _require(p.repetition_penalty > 0.0, "repetition_penalty", "> 0", p.repetition_penalty)
    _require(0 <= p.top_logprobs_num <= MAX_TOP_LOGPROBS, "top_logprobs_num",
             f"in [0, {MAX_TOP_LOGPROBS}]", p.top_logprobs_num)
    _require(p.logprob_start_len >= -1, "logprob_start_len", ">= 0 (or -1: no prompt logprobs)",
             p.logprob_start_len)
    _require(p.logprob_start_len < 0 or p.return_logprob, "logprob_start_len",
             "-1 unless return_logprob is true", p.logprob_start_len)
    _require(0 <= p.prompt_top_n <= MAX_TOP_LOGPROBS, "prompt_top_logprobs_num",
             f"in [0, {MAX_TOP_LOGPROBS}]", p.prompt_top_n)
    _require(all(p.stop), "stop", "made of non-empty strings", list(p.stop))
    _require(all(t >= 0 for t in p.stop_token_ids), "stop_token_ids", "non-negative", list(p.stop_token_ids))


def _require(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise SamplingParamsError(f"{name} must be {rule}, got {value!r}", name)
