"""The suite's own set-up (tests/conftest.py): torch's OpenMP team fits the cores this test
process may run on, on the main thread and on a thread started later, so tests that run
torch outside an engine do not time-share a core between two OpenMP threads."""

from __future__ import annotations

import os
import threading

import torch

from gpu.cpu_threads import usable_cpus


def affinity() -> int:
    return len(usable_cpus())


def test_main_thread_team_fits_the_affinity_mask() -> None:
    assert torch.get_num_threads() == affinity()


def test_a_later_thread_team_fits_the_affinity_mask() -> None:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert seen == [affinity()]


def test_red_torch_imported_before_the_pin_keeps_a_team_per_machine_core() -> None:
    """The hazard the set-up guards against, shown in a child process pinned to one core:
    torch imported first keeps one thread per machine core; the conftest's sizing brings it
    to the mask."""
    import subprocess
    import sys

    import pytest

    if not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2:
        pytest.skip("needs a machine with two cores")
    code = (  # the child first widens the mask it inherits (an xdist worker's is one core)
        "import os\n"
        "os.sched_setaffinity(0, range(os.cpu_count()))\n"
        "import torch\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "before = torch.get_num_threads()\n"
        "import tests.conftest\n"
        "print(before, torch.get_num_threads())\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTEST_XDIST_WORKER")}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                         check=True, timeout=300)
    before, after = map(int, out.stdout.split()[-2:])
    assert after == 1, out.stdout
    if before == 1:
        pytest.skip("torch's own default is one thread on this machine: no hazard to show")
