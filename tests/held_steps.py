"""Device steps the test holds back, in a server subprocess: "still generating" by
construction, never by guessing how fast this machine decodes.

`model.attention: tests.held_steps:HeldTorchAttention` (with `deterministic: false`, or
the deterministic backend is used whatever is named) is the torch backend whose per-step
`prepare`, on the device thread, waits while the file `steps` exists in the folder named
by `TIERSERVE_TEST_HOLD_DIR` — from the first step that decodes (so some request has
streamed its first token); a held step creates `step-held` first. The event loop runs
on meanwhile (signals, the drain's grace, HTTP), as it would around a slow step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from gpu.attention.torch_backend import TorchAttention
from tests.slow_storage import HOLD_ENV, wait_while


class HeldTorchAttention(TorchAttention):
    def prepare(self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> None:
        hold = Path(os.environ[HOLD_ENV])
        if 1 in extend_lens and (hold / "steps").exists():
            (hold / "step-held").touch()
            wait_while(hold / "steps")
        super().prepare(rows, prefix_lens, extend_lens)
