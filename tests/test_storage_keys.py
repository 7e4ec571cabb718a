"""Storage keys: chained page hashes plus a page-format suffix (cache/storage/keys.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import re

import pytest

from cache.kv_events import page_hashes
from cache.storage import keys as keys_mod
from cache.storage.keys import (
    KEY_HEX_LEN,
    PageFormat,
    key_page_hash,
    keys_for_hashes,
    page_keys,
    storage_key,
    validate_key,
)

FMT = PageFormat(
    model_id="tiny-llama",
    layout="nhd",
    dtype="bfloat16",
    page_size=4,
    num_kv_layers=2,
    kv_heads=2,
    head_dim=8,
)
TOKENS = list(range(100, 118))  # 18 tokens: 4 whole pages of 4, 2 left over
HEX_KEY = re.compile(rf"[0-9a-f]{{{KEY_HEX_LEN}}}")


def test_same_tokens_same_format_same_keys() -> None:
    a = page_keys(TOKENS, FMT)
    b = page_keys(list(TOKENS), dataclasses.replace(FMT))
    assert a == b
    assert len(a) == 4  # the partial last page has no key
    assert len(set(a)) == 4
    assert all(HEX_KEY.fullmatch(k) for k in a)


def test_key_carries_the_chained_page_hash() -> None:
    """The hash half is exactly what KV events publish, so events and storage agree."""
    for ns in (None, "tenant-a"):
        keys = page_keys(TOKENS, FMT, namespace=ns)
        assert [key_page_hash(k) for k in keys] == page_hashes(TOKENS, FMT.page_size, ns)
        assert keys == keys_for_hashes(page_hashes(TOKENS, FMT.page_size, ns), FMT)


def test_keys_are_stable_across_versions() -> None:
    """Keys name files that outlive the process: a changed scheme would silently orphan
    every stored page, so the scheme is pinned to its definition."""
    fields = [b"tiny-llama", b"nhd", b"bfloat16"]
    h = hashlib.blake2b(b"tierserve.storage.page_format.v1\x00", digest_size=8)
    for f in fields:
        h.update(len(f).to_bytes(4, "little") + f)
    for n in (4, 2, 2, 8):
        h.update(n.to_bytes(8, "little"))
    first_hash = page_hashes(TOKENS, 4)[0]
    assert page_keys(TOKENS, FMT)[0] == f"{first_hash:016x}{h.hexdigest()}"
    # and pinned as a literal, so changing both the scheme and this recipe still goes red
    assert page_keys(TOKENS, FMT)[-1] == "c8918d3ca2a423523c341984f1973fbb"


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other-model"},
        {"layout": "hnd"},
        {"dtype": "float16"},
        {"num_kv_layers": 3},
        {"kv_heads": 4},
        {"head_dim": 16},
    ],
)
def test_a_different_format_gives_disjoint_keys(change: dict[str, object]) -> None:
    other = dataclasses.replace(FMT, **change)  # type: ignore[arg-type]
    assert not set(page_keys(TOKENS, FMT)) & set(page_keys(TOKENS, other))


def test_a_different_page_size_gives_disjoint_keys() -> None:
    # 16 tokens: page size 4 and 8 would even share a token prefix of whole pages
    tokens = TOKENS[:16]
    eight = dataclasses.replace(FMT, page_size=8)
    two = dataclasses.replace(FMT, page_size=2)
    all_keys = [page_keys(tokens, f) for f in (FMT, eight, two)]
    assert sum(len(k) for k in all_keys) == len(set().union(*all_keys))


def test_format_fields_cannot_run_into_each_other() -> None:
    """Length-prefixed fields: "a|b" + "c" is not "a" + "b|c"."""
    one = dataclasses.replace(FMT, model_id="a|b", layout="c")
    two = dataclasses.replace(FMT, model_id="a", layout="b|c")
    assert one.suffix() != two.suffix()


def test_planted_bug_separator_join_collides(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above goes red under a naive `"|".join` suffix."""

    def joined(fmt: PageFormat) -> str:
        text = "|".join(str(getattr(fmt, f.name)) for f in dataclasses.fields(fmt))
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    monkeypatch.setattr(keys_mod, "format_suffix", joined)
    one = dataclasses.replace(FMT, model_id="a|b", layout="c")
    two = dataclasses.replace(FMT, model_id="a", layout="b|c")
    assert one.suffix() == two.suffix()


def test_namespaces_give_disjoint_keys() -> None:
    groups = [page_keys(TOKENS, FMT, ns) for ns in (None, "", "a", "b")]
    assert sum(len(g) for g in groups) == len(set().union(*groups))


def test_keys_of_a_prefix_are_a_prefix_of_the_keys() -> None:
    longer = page_keys(TOKENS + [7, 8, 9, 10, 11, 12], FMT)
    for n in range(len(TOKENS) + 1):
        short = page_keys(TOKENS[:n], FMT)
        assert longer[: len(short)] == short
        assert len(short) == n // FMT.page_size


def test_a_changed_token_changes_every_later_key() -> None:
    """Chained: one key names its whole prefix, not just its own page."""
    changed = list(TOKENS)
    changed[1] += 1  # inside the first page
    assert not set(page_keys(TOKENS, FMT)) & set(page_keys(changed, FMT))


@pytest.mark.parametrize(
    "bad",
    [
        "../" + "0" * (KEY_HEX_LEN - 3),
        "0" * (KEY_HEX_LEN - 1) + "/",
        "a/" + "0" * (KEY_HEX_LEN - 2),
        "..",
        "",
        "0" * (KEY_HEX_LEN - 1),
        "0" * (KEY_HEX_LEN + 1),
        "A" * KEY_HEX_LEN,  # uppercase: two spellings of one key would be two files
        "g" * KEY_HEX_LEN,
        "0" * (KEY_HEX_LEN - 1) + "\n",
        0,
        None,
        b"0" * KEY_HEX_LEN,
    ],
)
def test_malformed_keys_are_rejected(bad: object) -> None:
    with pytest.raises(ValueError):
        validate_key(bad)


def test_storage_key_checks_its_parts() -> None:
    suffix = FMT.suffix()
    assert validate_key(storage_key(0, suffix)) == "0" * 16 + suffix
    assert key_page_hash(storage_key((1 << 64) - 1, suffix)) == (1 << 64) - 1
    for bad_hash in (-1, 1 << 64):
        with pytest.raises(ValueError):
            storage_key(bad_hash, suffix)
    for bad_suffix in ("../../etc/passwd", suffix.upper(), suffix[:-1]):
        with pytest.raises(ValueError):
            storage_key(1, bad_suffix)


@pytest.mark.parametrize(
    "change",
    [{"model_id": ""}, {"dtype": ""}, {"page_size": 0}, {"kv_heads": -1}, {"head_dim": True}],
)
def test_bad_page_formats_are_rejected(change: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(FMT, **change)  # type: ignore[arg-type]
