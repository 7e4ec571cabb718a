"""The teardown accounting check (tests/leaks.py) is real: planted leaks go red.

The old fixture checked only the two shared engines, ignored cached pages (so it could
not run with the radix cache) and never asked whether a page was both held and cached.
"""

from __future__ import annotations

from typing import Any

import pytest

from kernel.async_engine import AsyncEngine
from kernel.scheduling.prefix_reuse import PrefixReuse
from tests import leaks
from tests.conftest import TINY_OVERRIDES

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
