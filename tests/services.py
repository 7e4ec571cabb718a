"""`python -m tests.services`: install the system services the suite drives (Debian's
`redis-server` and `chromium`) before pytest starts, so parallel test workers never race
each other for apt's lock. Each is skipped with a printed reason where it cannot be had
(not root, no apt-get); the tests that need it then skip with the same reason."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import pytest

from tests.browser import ensure_chromium
from tests.redis_server import ensure_redis_server


def ensure(name: str, install: Callable[[], str]) -> None:
    started = time.perf_counter()
    try:
        path = install()
    except pytest.skip.Exception as why:
        print(f"{name}: not available ({why})", flush=True)
        return
    print(f"{name}: {path} ({time.perf_counter() - started:.0f} s)", flush=True)


def main() -> int:
    ensure("redis-server", ensure_redis_server)
    ensure("chromium", ensure_chromium)
    return 0


if __name__ == "__main__":
    sys.exit(main())
