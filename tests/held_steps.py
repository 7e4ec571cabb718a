"""Device steps the test holds back: "still generating" by construction, never by
guessing how fast this machine decodes.

In-process, `hold_a_step` blocks one call of the engine's model runner. In a server
subprocess, `model.attention: tests.held_steps:HeldTorchAttention` (with `deterministic: false`, or
the deterministic backend is used whatever is named) is the torch backend whose per-step
`prepare`, on the device thread, waits while the file `steps` exists in the folder named
by `TIERSERVE_TEST_HOLD_DIR` — from the first step that decodes (so some request has
streamed its first token); a held step creates `step-held` first. The event loop runs
on meanwhile (signals, the drain's grace, HTTP), as it would around a slow step.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from gpu.attention.torch_backend import TorchAttention
from tests.slow_storage import HOLD_ENV, wait_while


class HeldTorchAttention(TorchAttention):
    def prepare(self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> None:
        hold = Path(os.environ[HOLD_ENV])
        if 1 in extend_lens and (hold / "steps").exists():
            (hold / "step-held").touch()
            wait_while(hold / "steps")
        super().prepare(rows, prefix_lens, extend_lens)


def hold_a_step(engine: Any, monkeypatch: pytest.MonkeyPatch, on_call: int = 3) -> tuple[threading.Event, threading.Event]:
    """The model runner's `on_call`-th step from now waits for `release`; `held` is set
    once it does (the device thread is blocked, the event loop runs on)."""
    runner = engine.loop.runner
    real_run = runner.run
    held, release = threading.Event(), threading.Event()
    calls = {"n": 0}

    def run(batch: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == on_call:
            held.set()
            release.wait(60)
        return real_run(batch)

    monkeypatch.setattr(runner, "run", run)
    return held, release
