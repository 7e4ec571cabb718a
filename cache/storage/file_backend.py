"""The `file` storage backend: one verified file per page on a local disk, LRU within a byte budget.

Layout: `<storage_dir>/<key[:2]>/<key>` (256 fan-out directories, so no directory grows
huge); the file format (header with magic, version, key, length, checksum) is
`cache.storage.page_file`.

NOTE (no torn pages): a page is written to a temp file `.<key>.<16 hex>.tmp` in the
same directory and then `os.replace`d onto its key, so a crash mid-write leaves at most
an orphaned temp file (removed at the next start-up), never a partial page under a key.
Without `fsync=True` a power loss can still leave a renamed file with lost contents;
the checksum turns that into a miss.

NOTE (verify every read): magic, version, key, length and checksum are checked on every
`get_pages`; a page that fails is deleted, counted by reason and served as None.

NOTE (index): sizes and recency live in memory (an OrderedDict in LRU order). Start-up
rebuilds it by scanning the directory, oldest write first, so a new backend over the
same directory (after a restart or a `kill -9`) serves what the old one wrote; recency
across a restart is write order. One process owns a directory at a time.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from cache.storage.base import StorageBackend, StorageCounters, StorageError
from cache.storage.keys import KEY_HEX_LEN, validate_key
from cache.storage.page_file import HEADER_SIZE, decode_page, encode_page, write_file
from kernel.registry import register

log = structlog.get_logger("tierserve")

_FANOUT_HEX = 2

_DIR_RE = re.compile(rf"[0-9a-f]{{{_FANOUT_HEX}}}")
_PAGE_RE = re.compile(rf"[0-9a-f]{{{KEY_HEX_LEN}}}")
_TMP_RE = re.compile(rf"\.[0-9a-f]{{{KEY_HEX_LEN}}}\.[0-9a-f]{{16}}\.tmp")


def _unlink_quiet(path: Path | str) -> None:
    """Remove a file; gone already is fine, any other failure is logged, never raised."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("storage_unlink_failed", path=str(path), error=str(exc))


def _prepare_dir(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # FileExistsError too: the path is a file
        raise StorageError(f"storage_dir {str(root)!r} cannot be used as a directory: {exc}") from exc
    if not root.is_dir():
        raise StorageError(f"storage_dir {str(root)!r} is not a directory")
    if not os.access(root, os.W_OK | os.X_OK):
        raise StorageError(f"storage_dir {str(root)!r} is not writable")


@dataclass(slots=True, eq=False)
class _Entry:
    """One stored page. Compared by identity: a rewrite of the key is a new entry."""

    size: int  # bytes on disk, header included


@register("storage", "file")
class FileBackend(StorageBackend):
    """Pages as files under `storage_dir`, at most `max_bytes` on disk (headers included).

    Thread-safe: one lock guards the index, the counters, renames and unlinks; encoding,
    checksums and the file reads and writes themselves run outside it, so calls from
    several executor threads overlap their I/O.
    """

    def __init__(self, storage_dir: str | os.PathLike[str], max_bytes: int, fsync: bool = False) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise StorageError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.root = Path(storage_dir)
        self.max_bytes = max_bytes
        self.fsync = fsync
        self._lock = threading.Lock()
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._counters = StorageCounters()
        _prepare_dir(self.root)
        self._rebuild_index()

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> FileBackend:
        """`hicache.storage_dir` (`~` expanded) and `hicache.storage_max_bytes`."""
        return cls(os.path.expanduser(str(options["storage_dir"])), int(options["storage_max_bytes"]))

    # -- the StorageBackend calls ------------------------------------------------------

    def exists_prefix(self, keys: Sequence[str]) -> int:
        checked = [validate_key(k) for k in keys]
        with self._lock:
            for n, key in enumerate(checked):
                if key not in self._index:
                    return n
        return len(checked)

    def get_pages(self, keys: Sequence[str]) -> list[bytes | None]:
        checked = [validate_key(k) for k in keys]
        return [self._get_one(key) for key in checked]

    def set_pages(self, items: Sequence[tuple[str, bytes]]) -> int:
        # Validate the whole batch first: a malformed key is a bug, and a half-written
        # batch would hide it.
        checked = [(validate_key(key), bytes(payload)) for key, payload in items]
        return sum(self._set_one(key, payload) for key, payload in checked)

    def delete(self, keys: Sequence[str]) -> int:
        checked = [validate_key(k) for k in keys]
        removed = 0
        with self._lock:
            for key in checked:
                entry = self._index.pop(key, None)
                if entry is not None:
                    self._bytes -= entry.size
                    _unlink_quiet(self._path(key))
                    removed += 1
        return removed

    def clear(self) -> None:
        with self._lock:
            for key in self._index:
                _unlink_quiet(self._path(key))
            self._index.clear()
            self._bytes = 0

    def stats(self) -> dict[str, Any]:
        with self._lock:
            snapshot = self._counters.snapshot(len(self._index), self._bytes)
        snapshot["max_bytes"] = self.max_bytes
        return snapshot

    # -- one page ----------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self.root / key[:_FANOUT_HEX] / key

    def _get_one(self, key: str) -> bytes | None:
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                self._counters.miss("missing")
                return None
            self._index.move_to_end(key)
        try:
            payload, reason = decode_page(key, self._path(key).read_bytes())
        except FileNotFoundError:  # evicted or deleted meanwhile, or removed by hand
            payload, reason = None, "missing"
        except OSError as exc:  # unreadable (EIO, permissions): as good as corrupt
            log.warning("storage_read_failed", key=key, error=str(exc))
            payload, reason = None, "corrupt"
        with self._lock:
            if reason is None:
                self._counters.hits += 1
                return payload
            self._counters.miss(reason)
            # NOTE: drop only the entry that was read; if the key was rewritten meanwhile
            # (a new entry, renamed under the lock), the new file is not ours to delete.
            if self._index.get(key) is entry:
                del self._index[key]
                self._bytes -= entry.size
                _unlink_quiet(self._path(key))
        return None

    def _set_one(self, key: str, payload: bytes) -> bool:
        with self._lock:
            if key in self._index:  # a key names its content: refresh, don't rewrite
                self._index.move_to_end(key)
                return True
        blob = encode_page(key, payload)
        if len(blob) > self.max_bytes:
            return self._write_failed(key, None, "page larger than max_bytes")
        path = self._path(key)
        tmp = path.with_name(f".{key}.{secrets.token_hex(8)}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            write_file(tmp, blob, self.fsync)
        except OSError as exc:  # ENOSPC, EIO, EDQUOT, ...
            return self._write_failed(key, tmp, str(exc))
        with self._lock:
            if key in self._index:  # another thread stored it while we wrote
                _unlink_quiet(tmp)
                self._index.move_to_end(key)
                return True
            self._evict_until(len(blob))
            try:
                os.replace(tmp, path)
            except OSError as exc:
                self._counters.fail("write_error")
                _unlink_quiet(tmp)
                log.warning("storage_write_failed", key=key, error=str(exc))
                return False
            self._index[key] = _Entry(len(blob))
            self._bytes += len(blob)
        if self.fsync:
            self._fsync_dir(path.parent)
        return True

    def _write_failed(self, key: str, tmp: Path | None, error: str) -> bool:
        if tmp is not None:
            _unlink_quiet(tmp)
        with self._lock:
            self._counters.fail("write_error")
        log.warning("storage_write_failed", key=key, error=error)
        return False

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        """Make the rename durable too; a failure costs durability only, never a page."""
        try:
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("storage_fsync_dir_failed", path=str(directory), error=str(exc))

    # -- the index ---------------------------------------------------------------------

    def _evict_until(self, incoming: int) -> None:
        """Drop least recently used pages until `incoming` more bytes fit (lock held)."""
        while self._index and self._bytes + incoming > self.max_bytes:
            key, entry = self._index.popitem(last=False)
            self._bytes -= entry.size
            _unlink_quiet(self._path(key))
            self._counters.fail("evicted")

    def _rebuild_index(self) -> None:
        """Index what an earlier backend left here; remove its orphaned temp files.

        Files that are neither pages nor temp files are not ours and are left alone.
        Headers are verified lazily, on `get_pages`: reading every page here would make
        start-up as slow as the disk is big.
        """
        found: list[tuple[int, str, int]] = []  # (mtime_ns, key, size)
        for sub in os.scandir(self.root):
            if not (sub.is_dir(follow_symlinks=False) and _DIR_RE.fullmatch(sub.name)):
                continue
            for item in os.scandir(sub.path):
                if _TMP_RE.fullmatch(item.name):
                    _unlink_quiet(item.path)
                elif (
                    _PAGE_RE.fullmatch(item.name)
                    and item.name.startswith(sub.name)
                    and item.is_file(follow_symlinks=False)
                ):
                    st = item.stat(follow_symlinks=False)
                    if st.st_size < HEADER_SIZE:  # cannot even hold a header
                        _unlink_quiet(item.path)
                        self._counters.fail("truncated")
                    else:
                        found.append((st.st_mtime_ns, item.name, st.st_size))
        for _, key, size in sorted(found):  # oldest write first = least recently used
            self._index[key] = _Entry(size)
            self._bytes += size
        self._evict_until(0)  # the budget may be smaller than last run's
