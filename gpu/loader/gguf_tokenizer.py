"""Rebuild a checkpoint's tokenizer from GGUF metadata (`tokenizer.ggml.*` keys).

A GGUF file carries the vocabulary, merges and token types but not the tokenizer's
pre-tokenizer; llama.cpp names it in `tokenizer.ggml.pre` and keeps the matching split
regexes in its source. We map those names back to the Hugging Face pre-tokenizers that
produce the same splits, because BPE merges are only valid on the pieces they were learned on.

smollm: llama.cpp splits with ["\\p{N}", <GPT-2 regex>], the same rule it uses for StarCoder,
whose tokenizer SmolLM reuses. In Hugging Face terms that is
Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)]
(Digits splits on Unicode numeric chars, i.e. \\p{N}; ByteLevel's built-in regex is GPT-2's),
with a ByteLevel decoder. transformers' own GGUF converter drops the Digits step for smollm,
so it keeps runs of digits together where the original tokenizer does not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import structlog
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from gpu.tokenizer import Tokenizer

log = structlog.get_logger("tierserve")

# llama.cpp token types (gguf.TokenType).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` values grouped by the split rule llama.cpp applies for them.
_GPT2_PRES = frozenset({"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"})
_DIGITS_PRES = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
_LLAMA3_PRES = frozenset({"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"})
_QWEN2_PRES = frozenset({"qwen2", "deepseek-r1-qwen"})


def build_gguf_tokenizer(meta: Mapping[str, Any]) -> Tokenizer | None:
    """The tokenizer described by GGUF metadata, or None when the file has none."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind != "gpt2":
        raise NotImplementedError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
            "load the model's Hugging Face folder (with tokenizer.json) instead"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    merges: list[str] = list(meta.get("tokenizer.ggml.merges") or [])
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    backend = build_byte_level_bpe(tokens, types, merges, pre)
    # llama.cpp turns BOS on for Llama 3 vocabularies unless the file says otherwise.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", pre in _LLAMA3_PRES))
    extra_eos = [
        int(meta[k]) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta
    ]
    return Tokenizer(
        backend,
        bos_token_id=_optional_int(meta.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_optional_int(meta.get("tokenizer.ggml.eos_token_id")),
        add_bos_token=add_bos,
        chat_template=meta.get("tokenizer.chat_template"),
        extra_eos_token_ids=extra_eos,
    )


def build_byte_level_bpe(
    tokens: Sequence[str], types: Sequence[int], merges: Sequence[str], pre: str
) -> BackendTokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` with ids equal to positions in `tokens`."""
    vocab = _vocab_by_spelling(tokens, types)
    pairs = [_split_merge(m) for m in merges]
    bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _LLAMA3_PRES)
    backend = BackendTokenizer(bpe)
    backend.pre_tokenizer = pick_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    # Control and user-defined tokens are matched whole, before pre-tokenization, as llama.cpp
    # does; their text is already in the vocabulary, so they keep their file ids.
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    )
    return backend


def pick_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The Hugging Face pre-tokenizer equivalent to llama.cpp's split rule for `pre`."""
    if pre in _DIGITS_PRES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _LLAMA3_PRES:
        return _split_then_bytes(_LLAMA3_SPLIT)
    if pre in _QWEN2_PRES:
        return _split_then_bytes(_QWEN2_SPLIT)
    if pre not in _GPT2_PRES:
        log.warning("unknown GGUF pre-tokenizer; falling back to GPT-2 byte-level splitting", pre=pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _vocab_by_spelling(tokens: Sequence[str], types: Sequence[int]) -> dict[str, int]:
    """token text -> id, with ordinary tokens in the byte-level alphabet BPE works in.

    Converters store ordinary tokens already spelled that way ("Ġhello"); an odd one stored
    as raw text would never be produced by the merges unless respelled. Control and
    user-defined tokens stay raw: they are matched against raw input text.
    """
    alphabet = set(_byte_alphabet().values())
    vocab: dict[str, int] = {}
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind == _NORMAL and not alphabet.issuperset(tok):
            tok = "".join(_byte_alphabet()[b] for b in tok.encode("utf-8"))
        vocab.setdefault(tok, i)  # a duplicated spelling keeps its first id
    return vocab


def _split_merge(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable-character table used to spell byte-level tokens."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
