"""A storage backend for the end-to-end tests: the `file` backend whose writes are slow.

Loaded by dotted path (`hicache.storage: tests.slow_storage:SlowFileBackend`) in a server
subprocess, so a test can send SIGTERM while writes are still queued and check that the
drain flushes them. The delay per `set_pages` call comes from the environment
(`TIERSERVE_TEST_WRITE_DELAY_S`, default 0.5 s): the options a backend gets are the
`hicache` section, which has no key for it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from cache.storage.file_backend import FileBackend

DELAY_ENV = "TIERSERVE_TEST_WRITE_DELAY_S"


class SlowFileBackend(FileBackend):
    delay_s = 0.5

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> SlowFileBackend:
        backend = cls(os.path.expanduser(str(options["storage_dir"])), int(options["storage_max_bytes"]))
        backend.delay_s = float(os.environ.get(DELAY_ENV, cls.delay_s))
        return backend

    def set_pages(self, items: Sequence[tuple[str, bytes]]) -> int:
        time.sleep(self.delay_s)
        return super().set_pages(items)
