"""Storage tier backends: pages of KV bytes by chained-hash key, below the host pool.

`base` holds the interface every backend implements (and its contract), `keys` the
key scheme, `file_backend` the built-in `file` backend (registered as kind `storage`).
Backends that need a server (Redis) live in plugins/.
"""

from __future__ import annotations

from cache.storage.base import FAILURE_REASONS, StorageBackend, StorageCounters, StorageError
from cache.storage.file_backend import FileBackend
from cache.storage.keys import (
    KEY_HEX_LEN,
    PageFormat,
    key_page_hash,
    keys_for_hashes,
    page_keys,
    storage_key,
    validate_key,
)

__all__ = [
    "FAILURE_REASONS",
    "KEY_HEX_LEN",
    "FileBackend",
    "PageFormat",
    "StorageBackend",
    "StorageCounters",
    "StorageError",
    "key_page_hash",
    "keys_for_hashes",
    "page_keys",
    "storage_key",
    "validate_key",
]
