"""Storage calls the test holds back: "still queued" and "still reading" by construction,
never by guessing how long a call takes.

- `Hold` (in-process): wraps a backend method; every call blocks until the test calls
  `release()`, and counts calls entered and returned.
- `HeldFileBackend` (a server subprocess, loaded by dotted path as
  `hicache.storage: tests.slow_storage:HeldFileBackend`): the `file` backend whose writes
  wait while the file `writes` exists in the folder named by `TIERSERVE_TEST_HOLD_DIR`,
  and whose probes (`exists_prefix`) wait while `reads` exists there; a held probe
  creates `read-held` first, so the test knows a request is waiting on it. The options a
  backend gets are the `hicache` section, which has no key for the folder.

Either gives up after `limit_s` and goes on (the test's own assertions then fail): a
broken test must not hang a server or the run.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cache.storage.file_backend import FileBackend

HOLD_ENV = "TIERSERVE_TEST_HOLD_DIR"
HOLD_LIMIT_S = 120.0


class Hold:
    """Calls of a wrapped function block until `release()` (or `limit_s`)."""

    def __init__(self, limit_s: float = HOLD_LIMIT_S) -> None:
        self.limit_s = limit_s
        self.entered = 0
        self.returned = 0
        self._gate = threading.Event()
        self._lock = threading.Lock()

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def held(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.entered += 1
            self._gate.wait(self.limit_s)
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.returned += 1

        return held

    def release(self) -> None:
        self._gate.set()


def wait_while(path: Path, limit_s: float = HOLD_LIMIT_S) -> None:
    """Block while `path` exists (the test removes it to let the call through)."""
    deadline = time.monotonic() + limit_s
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


class HeldFileBackend(FileBackend):
    hold_dir: Path | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> HeldFileBackend:
        backend = cls(os.path.expanduser(str(options["storage_dir"])), int(options["storage_max_bytes"]))
        backend.hold_dir = Path(os.environ[HOLD_ENV])
        return backend

    def exists_prefix(self, keys: Sequence[str]) -> int:
        if self.hold_dir is not None and (self.hold_dir / "reads").exists():
            (self.hold_dir / "read-held").touch()
            wait_while(self.hold_dir / "reads")
        return super().exists_prefix(keys)

    def set_pages(self, items: Sequence[tuple[str, bytes]]) -> int:
        if self.hold_dir is not None:
            wait_while(self.hold_dir / "writes")
        return super().set_pages(items)
