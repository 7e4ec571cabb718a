"""The `file` storage backend (cache/storage/file_backend.py): round trips, verification,
failed writes, LRU within the byte budget, restarts, path safety and threads."""

from __future__ import annotations

import errno
import os
import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cache.storage import file_backend, page_file
from cache.storage.base import FAILURE_REASONS, StorageError
from cache.storage.file_backend import FileBackend
from cache.storage.keys import KEY_HEX_LEN, PageFormat, page_keys
from cache.storage.page_file import HEADER_SIZE
from kernel import registry

FMT = PageFormat(
    model_id="tiny", layout="nhd", dtype="float16", page_size=4, num_kv_layers=2, kv_heads=1, head_dim=4
)
KEYS = page_keys(list(range(64)), FMT)  # 16 chained keys
OTHER_KEY = page_keys(list(range(4)), PageFormat("other", "nhd", "float16", 4, 2, 1, 4))[0]
PAGE_FILE = re.compile(rf"[0-9a-f]{{2}}/[0-9a-f]{{{KEY_HEX_LEN}}}")


def payload(key: str, size: int = 64) -> bytes:
    """Bytes determined by the key, so any reader can tell a right page from a wrong one."""
    return (bytes.fromhex(key) * (size // 16 + 1))[:size]


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def page_path(root: Path, key: str) -> Path:
    return root / key[:2] / key


def failures(backend: FileBackend) -> dict[str, int]:
    return {k: v for k, v in backend.stats()["failures"].items() if v}


@pytest.fixture
def backend(tmp_path: Path) -> FileBackend:
    return FileBackend(str(tmp_path / "store"), max_bytes=1 << 20)


def test_round_trip(backend: FileBackend) -> None:
    items = [(k, payload(k, n)) for k, n in zip(KEYS[:4], (0, 1, 64, 4096), strict=True)]
    assert backend.set_pages(items) == 4
    assert backend.get_pages([k for k, _ in items]) == [p for _, p in items]
    stats = backend.stats()
    assert stats["pages"] == 4 and stats["hits"] == 4 and stats["misses"] == 0
    assert stats["bytes"] == sum(HEADER_SIZE + len(p) for _, p in items)
    assert set(stats["failures"]) == set(FAILURE_REASONS) and not failures(backend)


def test_registered_as_storage_file() -> None:
    assert registry.lookup("storage", "file") is FileBackend


def test_exists_prefix_stops_at_the_first_gap(backend: FileBackend) -> None:
    backend.set_pages([(k, payload(k)) for i, k in enumerate(KEYS[:6]) if i != 3])
    assert backend.exists_prefix(KEYS[:6]) == 3
    assert backend.exists_prefix(KEYS[:3]) == 3
    assert backend.exists_prefix(KEYS[4:6]) == 2
    assert backend.exists_prefix([]) == 0
    assert backend.exists_prefix(KEYS[3:]) == 0
    stats = backend.stats()
    assert stats["hits"] == stats["misses"] == 0  # a probe counts nothing


def test_missing_pages_are_none_and_counted(backend: FileBackend, tmp_path: Path) -> None:
    backend.set_pages([(KEYS[0], payload(KEYS[0])), (KEYS[2], payload(KEYS[2]))])
    page_path(tmp_path / "store", KEYS[2]).unlink()  # removed behind the backend's back
    assert backend.get_pages(KEYS[:3]) == [payload(KEYS[0]), None, None]
    assert failures(backend) == {"missing": 2}
    assert backend.stats()["misses"] == 2 and backend.stats()["pages"] == 1


def corrupt_then_get(backend: FileBackend, root: Path, damage: str) -> bytes | None:
    """Store a page, damage its file one way, and read it back."""
    key = KEYS[0]
    backend.set_pages([(key, payload(key))])
    path = page_path(root, key)
    data = bytearray(path.read_bytes())
    if damage == "flip_payload":
        data[-1] ^= 0x01
    elif damage == "flip_length":
        data[24] ^= 0x01  # inside the u64 payload length: claims more than is there
    elif damage == "flip_checksum":
        data[HEADER_SIZE - 1] ^= 0x80
    elif damage == "magic":
        data[:4] = b"XXXX"
    elif damage == "truncate":
        data = data[: HEADER_SIZE + 10]
    elif damage == "truncate_header":
        data = data[:10]
    elif damage == "trailing":
        data += b"\0"
    elif damage == "wrong_key":  # a whole, valid page of another key copied over it
        other = KEYS[1]
        backend.set_pages([(other, payload(key))])
        data = bytearray(page_path(root, other).read_bytes())
    path.write_bytes(bytes(data))
    return backend.get_pages([key])[0]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("flip_payload", "corrupt"),
        ("flip_length", "truncated"),
        ("flip_checksum", "corrupt"),
        ("magic", "corrupt"),
        ("truncate", "truncated"),
        ("truncate_header", "truncated"),
        ("trailing", "corrupt"),
        ("wrong_key", "corrupt"),
    ],
)
def test_damaged_pages_are_none_counted_and_removed(
    backend: FileBackend, tmp_path: Path, damage: str, reason: str
) -> None:
    root = tmp_path / "store"
    assert corrupt_then_get(backend, root, damage) is None
    assert failures(backend) == {reason: 1}
    assert not page_path(root, KEYS[0]).exists()
    assert backend.exists_prefix(KEYS[:1]) == 0
    # the slot is free again: a rewrite is served
    assert backend.set_pages([(KEYS[0], payload(KEYS[0]))]) == 1
    assert backend.get_pages([KEYS[0]]) == [payload(KEYS[0])]


def test_planted_bug_no_checksum_serves_a_flipped_byte(
    backend: FileBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With checksum verification disabled the corrupt-page test above goes red."""
    monkeypatch.setattr(page_file, "_checksum_matches", lambda *args: True)
    got = corrupt_then_get(backend, tmp_path / "store", "flip_payload")
    assert got is not None and got != payload(KEYS[0])


def test_planted_bug_no_key_check_serves_another_prefix(
    backend: FileBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checksum alone does not catch a file of another key: the key check does."""
    monkeypatch.setattr(page_file, "_key_matches", lambda *args: True)
    assert corrupt_then_get(backend, tmp_path / "store", "wrong_key") is not None


def test_a_bad_read_never_deletes_a_newer_page(
    backend: FileBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that finds a corrupt file drops only the entry it read: if the key was
    deleted and written again meanwhile (verification runs outside the lock), the new
    page stays."""
    key = KEYS[0]
    backend.set_pages([(key, payload(key))])
    path = page_path(tmp_path / "store", key)
    path.write_bytes(path.read_bytes()[:-1] + b"!")  # corrupt
    real_decode = page_file.decode_page

    def rewrite_meanwhile(k: str, blob: bytes) -> tuple[bytes | None, str | None]:
        monkeypatch.setattr(file_backend, "decode_page", real_decode)
        backend.delete([key])
        backend.set_pages([(key, payload(key))])
        return real_decode(k, blob)

    monkeypatch.setattr(file_backend, "decode_page", rewrite_meanwhile)
    assert backend.get_pages([key]) == [None]
    assert failures(backend) == {"corrupt": 1}
    assert backend.get_pages([key]) == [payload(key)]
    assert backend.stats()["bytes"] == path.stat().st_size


def enospc(*args: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_write_error_mid_write_leaves_nothing_partial(
    backend: FileBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    backend.set_pages([(KEYS[0], payload(KEYS[0]))])
    real_write_all = page_file._write_all

    def half_then_full(fd: int, data: bytes) -> None:
        real_write_all(fd, data[: len(data) // 2])  # a partial temp file really exists
        enospc()

    monkeypatch.setattr(page_file, "_write_all", half_then_full)
    assert backend.set_pages([(k, payload(k)) for k in KEYS[1:4]]) == 0
    assert failures(backend) == {"write_error": 3}
    assert files(root) == [f"{KEYS[0][:2]}/{KEYS[0]}"]  # no temp file, no torn page
    monkeypatch.undo()
    assert backend.get_pages(KEYS[:2]) == [payload(KEYS[0]), None]
    assert backend.stats()["pages"] == 1
    assert backend.set_pages([(KEYS[1], payload(KEYS[1]))]) == 1  # space is back


def test_write_error_at_rename_is_counted(
    backend: FileBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "store"
    real_replace = os.replace

    def fail_second(src: str, dst: str) -> None:
        if str(dst).endswith(KEYS[1]):
            enospc()
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_second)
    assert backend.set_pages([(k, payload(k)) for k in KEYS[:3]]) == 2
    monkeypatch.undo()
    assert failures(backend) == {"write_error": 1}
    assert backend.get_pages(KEYS[:3]) == [payload(KEYS[0]), None, payload(KEYS[2])]
    assert all(PAGE_FILE.fullmatch(f) for f in files(root)) and len(files(root)) == 2


def test_a_page_over_the_whole_budget_is_refused(tmp_path: Path) -> None:
    backend = FileBackend(str(tmp_path / "s"), max_bytes=HEADER_SIZE + 100)
    assert backend.set_pages([(KEYS[0], payload(KEYS[0], 101)), (KEYS[1], payload(KEYS[1], 100))]) == 1
    assert failures(backend) == {"write_error": 1}
    assert backend.exists_prefix(KEYS[1:2]) == 1


def test_lru_eviction_keeps_the_bound_and_a_get_refreshes(tmp_path: Path) -> None:
    root = tmp_path / "s"
    size = HEADER_SIZE + 64
    backend = FileBackend(str(root), max_bytes=3 * size + size // 2)
    backend.set_pages([(k, payload(k)) for k in KEYS[:3]])
    assert backend.get_pages([KEYS[0]]) == [payload(KEYS[0])]  # KEYS[1] is now the oldest
    backend.set_pages([(KEYS[3], payload(KEYS[3]))])
    assert backend.exists_prefix([KEYS[1]]) == 0 and not page_path(root, KEYS[1]).exists()
    assert backend.get_pages([KEYS[0], KEYS[2], KEYS[3]]) == [payload(k) for k in (KEYS[0], KEYS[2], KEYS[3])]
    backend.set_pages([(KEYS[1], payload(KEYS[1]))])  # oldest now: KEYS[0]
    assert backend.exists_prefix([KEYS[0]]) == 0
    stats = backend.stats()
    assert stats["failures"]["evicted"] == 2 and stats["pages"] == 3
    assert stats["bytes"] == 3 * size <= backend.max_bytes
    assert sum((root / f).stat().st_size for f in files(root)) == stats["bytes"]


def test_set_of_a_present_key_refreshes_without_rewriting(backend: FileBackend, tmp_path: Path) -> None:
    backend.set_pages([(KEYS[0], payload(KEYS[0]))])
    path = page_path(tmp_path / "store", KEYS[0])
    inode = path.stat().st_ino
    assert backend.set_pages([(KEYS[0], payload(KEYS[0]))]) == 1
    assert path.stat().st_ino == inode and backend.stats()["bytes"] == HEADER_SIZE + 64


def test_restart_serves_old_pages_cleans_temps_and_rebuilds_sizes(tmp_path: Path) -> None:
    root = tmp_path / "s"
    first = FileBackend(str(root), max_bytes=1 << 20)
    first.set_pages([(k, payload(k, 10 * i)) for i, k in enumerate(KEYS[:5])])
    before = first.stats()
    # what a kill -9 mid-write leaves: a temp file, plus a file that is not ours
    orphan = root / KEYS[7][:2] / f".{KEYS[7]}.{'ab' * 8}.tmp"
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"half a page")
    (root / "README").write_text("not ours")
    del first  # no close, no flush: the next instance must manage from the disk alone
    second = FileBackend(str(root), max_bytes=1 << 20)
    assert not orphan.exists() and (root / "README").exists()
    stats = second.stats()
    assert (
        (stats["pages"], stats["bytes"]) == (before["pages"], before["bytes"]) == (5, 5 * HEADER_SIZE + 100)
    )
    assert second.exists_prefix(KEYS) == 5
    assert second.get_pages(KEYS[:5]) == [payload(k, 10 * i) for i, k in enumerate(KEYS[:5])]


def test_restart_with_a_smaller_budget_evicts_the_oldest_writes(tmp_path: Path) -> None:
    root = tmp_path / "s"
    first = FileBackend(str(root), max_bytes=1 << 20)
    first.set_pages([(k, payload(k)) for k in KEYS[:4]])
    for age, key in enumerate(KEYS[:4]):  # mtimes decide, not the order of the scan
        t = 1_000_000 + (age if key != KEYS[0] else 10)  # KEYS[0] written last
        os.utime(page_path(root, key), (t, t))
    second = FileBackend(str(root), max_bytes=2 * (HEADER_SIZE + 64))
    assert [second.exists_prefix([k]) for k in KEYS[:4]] == [1, 0, 0, 1]
    assert second.stats()["failures"]["evicted"] == 2 and len(files(root)) == 2


def test_paths_are_hex_only_and_bad_keys_raise(backend: FileBackend, tmp_path: Path) -> None:
    root = tmp_path / "store"
    backend.set_pages([(k, payload(k)) for k in KEYS])
    assert files(root) and all(PAGE_FILE.fullmatch(f) for f in files(root))
    bad = "../" + KEYS[0][3:]
    slash = KEYS[0][:10] + "/" + KEYS[0][11:]
    for key in (bad, slash, "..", KEYS[0].upper()):
        with pytest.raises(ValueError):
            backend.set_pages([(OTHER_KEY, b"x"), (key, b"x")])  # checked before any write
        for call in (backend.get_pages, backend.exists_prefix, backend.delete):
            with pytest.raises(ValueError):
                call([key])
    assert not (tmp_path / KEYS[0][3:]).exists() and len(files(root)) == len(KEYS)
    assert backend.exists_prefix([OTHER_KEY]) == 0


def test_delete_and_clear(backend: FileBackend, tmp_path: Path) -> None:
    root = tmp_path / "store"
    backend.set_pages([(k, payload(k)) for k in KEYS[:4]])
    assert backend.delete([KEYS[1], KEYS[1], KEYS[9]]) == 1
    assert backend.exists_prefix(KEYS[:4]) == 1 and len(files(root)) == 3
    backend.get_pages([KEYS[0]])
    backend.clear()
    stats = backend.stats()
    assert (stats["pages"], stats["bytes"], stats["hits"]) == (0, 0, 1)  # counters keep counting
    assert files(root) == []


def test_configuration_errors(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(StorageError):
        FileBackend(str(not_a_dir), max_bytes=1024)
    with pytest.raises(StorageError):
        FileBackend(str(not_a_dir / "sub"), max_bytes=1024)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(StorageError):
            FileBackend(str(tmp_path / "ok"), max_bytes=bad)  # type: ignore[arg-type]


def test_concurrent_set_get_stay_consistent(tmp_path: Path) -> None:
    """Several threads write, read and delete overlapping keys under eviction pressure:
    every page served is the right one, and the size accounting matches the disk."""
    root = tmp_path / "s"
    size = HEADER_SIZE + 64
    backend = FileBackend(str(root), max_bytes=6 * size)

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(150):
            keys = rng.sample(KEYS, 3)
            op = rng.random()
            if op < 0.45:
                backend.set_pages([(k, payload(k)) for k in keys])
            elif op < 0.9:
                for k, got in zip(keys, backend.get_pages(keys), strict=True):
                    assert got is None or got == payload(k)
            else:
                backend.delete(keys[:1])

    with ThreadPoolExecutor(max_workers=4) as pool:  # the engine's own way of calling
        for future in [pool.submit(work, seed) for seed in range(4)]:
            future.result()  # re-raises a worker's failed assert here
    stats = backend.stats()
    on_disk = files(root)
    assert all(PAGE_FILE.fullmatch(f) for f in on_disk)  # no temp file left behind
    assert stats["pages"] == len(on_disk)
    assert stats["bytes"] == sum((root / f).stat().st_size for f in on_disk) <= backend.max_bytes
    assert not {
        k: v for k, v in stats["failures"].items() if k in ("truncated", "corrupt", "write_error") and v
    }
    served = backend.get_pages(KEYS)
    assert all(got is None or got == payload(k) for k, got in zip(KEYS, served, strict=True))
    assert sum(got is not None for got in served) == stats["pages"]
