from __future__ import annotations

import functools
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kernel.results.detokenizer import IncrementalDetokenizer

CORPUS = [
    "héllo wörld 日本語 🙂",
    "the quick brown fox jumps over the lazy dog",
    "STOP here. Stop there! naïve café, Ærøskøbing",
    "日本語のテキスト 🙂🙂 émoji 👍🏽 and ümlauts",
]
EOS = "<|eos|>"


class Wrapped:
    """The decode() surface the engine's tokenizer wrapper exposes; counts window sizes."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.longest_call = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.longest_call = max(self.longest_call, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@functools.cache
def trained() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 5, trainer)
    return tok


def encode(text: str) -> list[int]:
    return list(trained().encode(text).ids)


def stream(ids: list[int], cuts: list[int], stop: tuple[str, ...] = (),
           skip: bool = True) -> tuple[list[str], IncrementalDetokenizer]:
    """Push ids in chunks split at `cuts`; stop pushing at a stop hit; finish otherwise."""
    detok = IncrementalDetokenizer(Wrapped(trained()), skip_special_tokens=skip, stop=stop)
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    pieces = []
    for a, b in itertools.pairwise(bounds):
        step = detok.push(ids[a:b])
        pieces.append(step.text)
        if step.stop_hit:
            return pieces, detok
    pieces.append(detok.finish())
    return pieces, detok


def first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Reference rule: the stop string that completes first, earliest start on ties."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    return (min(found)[1], min(found)[2]) if found else None


token_ids = st.lists(st.integers(0, trained().get_vocab_size() - 1), max_size=40)
cut_points = st.lists(st.integers(0, 60), max_size=12)


@settings(max_examples=300, deadline=None)
@given(ids=token_ids, cuts=cut_points, skip=st.booleans())
def test_stream_concatenates_to_full_decode(ids: list[int], cuts: list[int], skip: bool) -> None:
    full = trained().decode(ids, skip_special_tokens=skip)
    pieces, detok = stream(ids, cuts, skip=skip)
    assert "".join(pieces) == full == detok.text
    if "\ufffd" not in full:
        assert all("\ufffd" not in p for p in pieces)


@settings(max_examples=300, deadline=None)
@given(ids=token_ids, cuts=cut_points, data=st.data())
def test_stop_strings_cut_like_reference(ids: list[int], cuts: list[int], data: st.DataObject) -> None:
    full = trained().decode(ids)
    stops = tuple(data.draw(st.lists(st.sampled_from(["é", "the", "日本", "🙂", "o w", "xyz", "e "]),
                                     max_size=3, unique=True)))
    if len(full) > 2:  # also a stop string taken from the text itself
        a = data.draw(st.integers(0, len(full) - 2))
        piece = full[a:a + data.draw(st.integers(1, 4))]
        if "\ufffd" not in piece:
            stops += (piece,)
    pieces, detok = stream(ids, cuts, stop=stops)
    hit = first_stop(full, stops)
    expected = full if hit is None else full[:hit[0]]
    assert "".join(pieces) == expected == detok.text


def test_stop_spanning_tokens_is_cut() -> None:
    ids = encode("héllo wörld 日本語")
    detok = IncrementalDetokenizer(Wrapped(trained()), stop=["lo wö"])
    steps = [detok.push([t]) for t in ids[:2]]
    assert len(ids) > 2 and not steps[0].stop_hit and steps[-1].stop_hit
    assert steps[-1].matched_stop == "lo wö"
    assert "".join(s.text for s in steps) == detok.text == "hél"
    with pytest.raises(RuntimeError):
        detok.push([ids[2]])


def test_stop_inside_one_token() -> None:
    [token] = encode("héllo")
    step = IncrementalDetokenizer(Wrapped(trained()), stop=["éll"]).push([token])
    assert step == ("h", True, "éll")


def test_held_back_text_released_by_finish() -> None:
    detok = IncrementalDetokenizer(Wrapped(trained()), stop=["the lazy cat"])
    step = detok.push(encode("the quick brown fox jumps over the lazy"))
    assert step.text == "the quick brown fox jumps over " and not step.stop_hit
    assert detok.finish() == "the lazy"
    assert detok.text == "the quick brown fox jumps over the lazy"
    assert detok.finish() == ""


def test_earliest_stop_wins() -> None:
    ids = encode("the quick brown fox jumps")
    cases = [(("fox", "quick"), "the ", "quick"),
             (("brown fox", "quick"), "the ", "quick"),
             (("fox", "brown fox"), "the quick ", "brown fox"),  # same end: earlier start
             (("jumps", "own"), "the quick br", "own"),
             (("quick brown", "ick"), "the qu", "ick")]  # first to complete, not first to start
    for stops, text, matched in cases:
        for cuts in ([], list(range(len(ids)))):  # one push, and one token per push
            pieces, detok = stream(ids, cuts, stop=stops)
            assert "".join(pieces) == text and detok.text == text


def test_multibyte_character_never_split() -> None:
    ids = encode("日本語のテキスト 🙂🙂 👍🏽")
    pieces, _ = stream(ids, list(range(len(ids))))
    assert "".join(pieces) == "日本語のテキスト 🙂🙂 👍🏽"
    assert all("\ufffd" not in p for p in pieces)


def test_window_stays_small() -> None:
    wrapped = Wrapped(trained())
    detok = IncrementalDetokenizer(wrapped, stop=["never appears"])
    ids = encode(" ".join(CORPUS * 20))
    for t in ids:
        detok.push([t])
    detok.finish()
    assert detok.text == trained().decode(ids)
    assert len(ids) > 500 and wrapped.longest_call <= 8


def test_invalid_bytes_do_not_grow_the_window() -> None:
    tok = trained()
    # A lone UTF-8 continuation byte: every prefix of a run of them ends in U+FFFD.
    lone = next(i for i in range(tok.get_vocab_size())
                if tok.decode([i]) == "\ufffd" and tok.decode([i] * 3) == "\ufffd" * 3)
    wrapped = Wrapped(tok)
    detok = IncrementalDetokenizer(wrapped)
    ids = [lone] * 200 + encode(" ok")
    pieces = [detok.push([t]).text for t in ids] + [detok.finish()]
    assert "".join(pieces) == tok.decode(ids)
    assert wrapped.longest_call <= 40


def byte_token(b: int) -> int:
    """Id of the single-byte token for byte b (GPT-2 byte-to-character mapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    char = chr(b) if b in printable else chr(256 + [x for x in range(256) if x not in printable].index(b))
    token = trained().token_to_id(char)
    assert token is not None
    return token


@pytest.mark.parametrize("garbage", range(26, 40))
def test_character_after_long_invalid_run_is_not_split(garbage: int) -> None:
    tok = trained()
    lone = byte_token(0x80)
    ids = [lone] * garbage + [byte_token(b) for b in "日本 ok".encode()]
    pieces, _ = stream(ids, list(range(len(ids))))
    assert "".join(pieces) == tok.decode(ids) == "\ufffd" * garbage + "日本 ok"


class SentencePieceLike:
    """Decoder that drops the leading space of the decoded text, as SentencePiece does."""

    vocab = ("▁hello", "▁world", "!", "▁a", "b")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 4), max_size=20))
def test_context_dependent_decoder_keeps_spaces(ids: list[int]) -> None:
    detok = IncrementalDetokenizer(SentencePieceLike())
    pieces = [detok.push([t]).text for t in ids] + [detok.finish()]
    assert "".join(pieces) == SentencePieceLike().decode(ids)


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(ValueError):
        IncrementalDetokenizer(Wrapped(trained()), stop=[""])
