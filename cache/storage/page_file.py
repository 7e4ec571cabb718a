"""The page file format of the `file` backend: a 48-byte header and the payload.

    magic b"TSKV" | u16 version | u16 flags (0) | 16-byte key | u64 payload length
    | 16-byte blake2b over the header's first 32 bytes and the payload | payload

The checksum covers the header's fields as well as the payload, so a flipped bit in
the length or flags is caught too. The key is checked on its own: a file copied onto
another key's path has a valid checksum but names the wrong prefix.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

MAGIC = b"TSKV"
VERSION = 1
_PREFIX = struct.Struct("<4sHH16sQ")  # magic, version, flags, key bytes, payload length
_CHECKSUM_LEN = 16
HEADER_SIZE = _PREFIX.size + _CHECKSUM_LEN


def _checksum(prefix: bytes, payload: bytes) -> bytes:
    h = hashlib.blake2b(prefix, digest_size=_CHECKSUM_LEN)
    h.update(payload)
    return h.digest()


def _checksum_matches(prefix: bytes, stored: bytes, payload: bytes) -> bool:
    return _checksum(prefix, payload) == stored


def _key_matches(key: str, key_bytes: bytes) -> bool:
    return key_bytes == bytes.fromhex(key)


def encode_page(key: str, payload: bytes) -> bytes:
    """Header + payload of one page file."""
    prefix = _PREFIX.pack(MAGIC, VERSION, 0, bytes.fromhex(key), len(payload))
    return prefix + _checksum(prefix, payload) + payload


def decode_page(key: str, blob: bytes) -> tuple[bytes | None, str | None]:
    """(payload, None) if `blob` is a whole, intact page file for `key`, else (None, reason)."""
    if len(blob) < HEADER_SIZE:
        return None, "truncated"
    magic, version, flags, key_bytes, length = _PREFIX.unpack_from(blob)
    if magic != MAGIC or version != VERSION or flags != 0 or not _key_matches(key, key_bytes):
        return None, "corrupt"
    payload = blob[HEADER_SIZE:]
    if len(payload) < length:
        return None, "truncated"
    if len(payload) > length:
        return None, "corrupt"
    if not _checksum_matches(blob[: _PREFIX.size], blob[_PREFIX.size : HEADER_SIZE], payload):
        return None, "corrupt"
    return payload, None


def _write_all(fd: int, data: bytes) -> None:
    """os.write until done: a short write is legal, and must not end a page early."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_file(path: Path, data: bytes, fsync: bool) -> None:
    """Create `path` (which must not exist) holding `data`; OSError on any failure."""
    # O_EXCL: a temp name is random, so an existing file means something is badly wrong.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
