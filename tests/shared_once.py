"""Work done once per test run and shared by every pytest-xdist worker of that run: the first
worker to ask builds the thing into the run's shared temporary folder under a file lock,
the others wait for it and read what it built. Nothing outlives the run (the folder is the
run's own), so no result of an earlier run is ever reused."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock


def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This run's temporary folder, the same for all of its workers."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """`run_folder/name`, filled by `build(folder)` in whichever worker gets there first. A
    build that raises leaves no folder marked done, so the next worker tries again (and fails
    the same way, in its own test)."""
    folder = run_folder(tmp_path_factory) / name
    done = folder / ".built"
    with FileLock(f"{folder}.lock"):
        if not done.exists():
            folder.mkdir(parents=True, exist_ok=True)
            build(folder)
            done.touch()
    return folder
