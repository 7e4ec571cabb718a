"""Storage keys: one fixed-length hex string per page, naming a whole prefix in one model's format.

    key = f"{page_hash:016x}" + blake2b(format fields, digest_size=8).hexdigest()

`page_hash` is the chained hash of `cache.kv_events` (namespace seed included), so one
key names the page *and every page before it*: a prompt's keys are a chain, and the
keys of a prefix are a prefix of the keys of any longer prompt. The suffix names what
the bytes mean (model, KV layout, dtype, page size, layers, heads, head dim), so two
models or two dtypes never read each other's pages.

NOTE: keys are built from hashes only, never from request text, and every backend
validates a key (`validate_key`) before it becomes part of a path or a network key:
a key is exactly `KEY_HEX_LEN` lowercase hex characters, so it cannot hold `/`, `..`
or anything else a file system or server would interpret.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from cache.kv_events import chain_hashes, namespace_seed

HASH_HEX_LEN = 16  # a u64 chained page hash
SUFFIX_HEX_LEN = 16  # blake2b digest_size=8 of the page format
KEY_HEX_LEN = HASH_HEX_LEN + SUFFIX_HEX_LEN

# Domain separation: the format digest can never equal a digest of some other field list.
_FORMAT_DOMAIN = b"tierserve.storage.page_format.v1\x00"
_KEY_RE = re.compile(rf"[0-9a-f]{{{KEY_HEX_LEN}}}")
_SUFFIX_RE = re.compile(rf"[0-9a-f]{{{SUFFIX_HEX_LEN}}}")


@dataclass(frozen=True, slots=True)
class PageFormat:
    """What a page's bytes mean: everything that must match for a stored page to be reusable.

    `layout` names the memory layout of one page's KV (e.g. "nhd" or "hnd"; the engine
    picks the words), `dtype` the element type ("bfloat16", ...). Two formats that differ
    in any field get disjoint keys.
    """

    model_id: str
    layout: str
    dtype: str
    page_size: int
    num_kv_layers: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("model_id", "layout", "dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"PageFormat.{name} must be a non-empty string, got {value!r}")
        for name in ("page_size", "num_kv_layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"PageFormat.{name} must be a positive int, got {value!r}")

    def suffix(self) -> str:
        """The format's part of every key (`SUFFIX_HEX_LEN` hex characters)."""
        return format_suffix(self)


def format_suffix(fmt: PageFormat) -> str:
    """blake2b of the format's fields, each length-prefixed.

    NOTE: length prefixes, not a separator: with `"|".join(...)` the model "a|b" with
    layout "c" and the model "a" with layout "b|c" would share one suffix (a test plants
    exactly that pair).
    """
    h = hashlib.blake2b(_FORMAT_DOMAIN, digest_size=SUFFIX_HEX_LEN // 2)
    for text in (fmt.model_id, fmt.layout, fmt.dtype):
        data = text.encode("utf-8")
        h.update(struct.pack("<I", len(data)) + data)
    h.update(struct.pack("<4Q", fmt.page_size, fmt.num_kv_layers, fmt.kv_heads, fmt.head_dim))
    return h.hexdigest()


def storage_key(page_hash: int, suffix: str) -> str:
    """The key of the page whose chained hash is `page_hash`, in the format named by `suffix`."""
    if not 0 <= page_hash < 1 << 64:
        raise ValueError(f"page hash must be an unsigned 64-bit int, got {page_hash!r}")
    if not isinstance(suffix, str) or _SUFFIX_RE.fullmatch(suffix) is None:
        raise ValueError(f"format suffix must be {SUFFIX_HEX_LEN} lowercase hex characters")
    return f"{page_hash:0{HASH_HEX_LEN}x}{suffix}"


def keys_for_hashes(page_hashes: Sequence[int], fmt: PageFormat) -> list[str]:
    """Keys of pages whose chained hashes are known already (the tree has them)."""
    suffix = fmt.suffix()
    return [storage_key(h, suffix) for h in page_hashes]


def page_keys(tokens: Sequence[int], fmt: PageFormat, namespace: str | None = None) -> list[str]:
    """Keys of the whole pages of a prompt (a partial last page has no key)."""
    hashes = chain_hashes(namespace_seed(namespace), tokens, fmt.page_size)
    return keys_for_hashes(hashes, fmt)


def validate_key(key: object) -> str:
    """`key` itself if it is a well-formed storage key; ValueError otherwise.

    Backends call this before a key touches a path or a server: a malformed key is a
    caller's bug, so it raises rather than counting as a missing page.
    """
    if not isinstance(key, str) or _KEY_RE.fullmatch(key) is None:
        raise ValueError(f"not a storage key ({KEY_HEX_LEN} lowercase hex characters): {key!r}")
    return key


def key_page_hash(key: str) -> int:
    """The chained page hash a key carries (to match it against the tree's KV events)."""
    return int(validate_key(key)[:HASH_HEX_LEN], 16)
