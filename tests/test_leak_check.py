"""The teardown accounting check (tests/leaks.py) is real: planted leaks go red.

The old fixture checked only the two shared engines, ignored cached pages (so it could
not run with the radix cache) and never asked whether a page was both held and cached.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kernel.async_engine import AsyncEngine
from kernel.scheduling.prefix_reuse import PrefixReuse
from tests import leaks
from tests.conftest import TINY_OVERRIDES

ROOT = Path(__file__).resolve().parent.parent

PARAMS = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


async def make(folder: str) -> AsyncEngine:
    # The radix cache on: the check must count cached pages, not call them leaked. The
    # per-step integrity check off: the teardown check alone must see the leak.
    return await AsyncEngine.create(None, {
        "model.path": folder, **TINY_OVERRIDES, "cache.prefix": "radix", "debug.check_invariants": False,
    })


async def test_clean_engine_with_cached_pages_passes(tiny_chat_folder: str) -> None:
    engine = await make(tiny_chat_folder)
    try:
        await engine.generate(list(range(100, 130)), PARAMS)
        assert engine.stats()["pages"]["cached"] > 0
        assert leaks.accounting_errors(engine) == []
    finally:
        await engine.shutdown()


async def test_red_pages_a_finished_request_forgot_to_free(
    tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = await make(tiny_chat_folder)
    real_release = PrefixReuse.release

    def leaky(self: PrefixReuse, req: Any) -> None:
        real_free = self.allocator.free
        # Planted: the last page a finished request gives back is forgotten, not freed.
        self.allocator.free = lambda pages: real_free(pages[:-1])  # type: ignore[method-assign]
        try:
            real_release(self, req)
        finally:
            self.allocator.free = real_free  # type: ignore[method-assign]

    monkeypatch.setattr(PrefixReuse, "release", leaky)
    try:
        await engine.generate(list(range(100, 133)), PARAMS)  # KV of 38 tokens: a partial last page
        errors = leaks.accounting_errors(engine)
        assert any("pages leaked" in e for e in errors), errors
    finally:
        leaks.excuse(engine)
        await engine.shutdown()


async def test_red_a_halted_engine_is_reported_unless_excused(
    tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A halt no planted-bug test asked for is a failure, at teardown and at shutdown
    alike; the old check skipped every halted engine."""
    engine = await make(tiny_chat_folder)
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: (_ for _ in ()).throw(RuntimeError("planted halt")))
    try:
        with pytest.raises(Exception, match="planted halt"):
            await engine.generate(list(range(100, 110)), PARAMS)
        assert engine.halt_reason is not None
        assert leaks.accounting_errors(engine) == [
            f"engine halted (not excused by a planted-bug test): {engine.halt_reason}"]
    finally:
        await engine.shutdown()
    found = list(leaks.failures)
    leaks.failures.clear()  # reported here, not by this test's teardown
    assert any("at shutdown: engine halted (not excused" in e and "planted halt" in e for e in found), found


LEAKS_AT_EXIT = '''
import os

import pytest

from kernel import Engine
from tests.conftest import TINY_OVERRIDES


@pytest.fixture(scope="session")
def engine():
    engine = Engine(None, {"model.path": os.environ["TIERSERVE_TINY_CHAT"], **TINY_OVERRIDES})
    yield engine
    engine.engine.scheduler.allocator.allocate(1)  # planted: a page leaked after the last teardown
    engine.shutdown()


def test_uses_the_engine(engine):
    assert engine.generate(list(range(100, 110)), {"max_new_tokens": 2})["output_ids"]
'''


@pytest.mark.parametrize("workers", [["-p", "no:xdist"], ["-n", "1"]], ids=["plain", "xdist"])
def test_red_a_leak_at_session_end_fails_the_run(tiny_chat_folder: str, tmp_path: Path, workers: list[str]) -> None:
    """A session-scoped engine shuts down after the last teardown; its leak used to be
    recorded and never reported (the run passed). conftest's sessionfinish fails it, also
    when the engine lived in an xdist worker (`make test`), whose own exit status is not the run's."""
    (tmp_path / "test_leaks_at_exit.py").write_text(LEAKS_AT_EXIT)
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.conftest", *workers,
            "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    run = subprocess.run(args, check=False, cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env={**env, "TIERSERVE_TINY_CHAT": tiny_chat_folder})
    out = run.stdout + run.stderr
    assert "1 passed" in out, out  # the test itself passed: only the end-of-session check fails
    assert run.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert "engine accounting broken at the end of the session" in out and "1 pages leaked" in out, out
