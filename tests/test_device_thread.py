"""The device thread: jobs run in order on its own stream (CUDA), and a job's future
resolves only after a wait for that stream's work (here a stand-in stream, whose own
`synchronize` is the marker; tests/test_readback.py covers the readback thread with
markers) — so the loop never synchronizes the device. The stream is faked on CPU: what
is checked is the order of events."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import gpu.device_thread as device_mod
from gpu import cpu_threads
from gpu.device_thread import DeviceThread


class FakeStream:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def synchronize(self) -> None:
        self.log.append("sync")


async def test_jobs_run_on_the_stream_and_resolve_after_it_synchronized(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []

    @contextlib.contextmanager
    def current(stream: Any) -> Iterator[None]:
        log.append("enter" if stream is not None else "no-stream")
        yield
        log.append("exit")

    monkeypatch.setattr(device_mod, "stream_ctx", current)
    thread = DeviceThread(stream_factory=lambda: FakeStream(log))
    try:
        assert await thread.submit(lambda: log.append("job") or 7) == 7
        log.append("resolved")
        assert log == ["enter", "job", "exit", "sync", "resolved"]
        assert thread.call(lambda: 3) == 3  # set-up calls run on the stream too
        assert log[-3:] == ["enter", "exit", "sync"]
    finally:
        thread.shutdown()


async def test_cpu_has_no_stream() -> None:
    thread = DeviceThread()
    try:
        assert await thread.submit(lambda: 5) == 5
        assert thread.stream is None
    finally:
        thread.shutdown()


async def test_a_failing_job_reaches_the_caller_and_the_thread_goes_on() -> None:
    thread = DeviceThread()
    try:
        with pytest.raises(ZeroDivisionError):
            await thread.submit(lambda: 1 / 0)
        assert await thread.submit(lambda: 2) == 2
    finally:
        thread.shutdown()


def test_intra_op_threads_follow_the_affinity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU-set container: 3 of the machine's cores are ours, whatever os.cpu_count says.
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {5, 2, 7}, raising=False)
    assert cpu_threads.plan_threads(None) == cpu_threads.ThreadPlan((2, 5, 7), 3)
    assert cpu_threads.plan_threads(1).intra_op == 1  # model.num_threads wins when set


def test_the_device_thread_runs_with_the_planned_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    thread = DeviceThread()
    try:
        assert thread.threads.intra_op == 1
        # OpenMP's count is per thread: read it on the device thread itself.
        assert thread.call(torch.get_num_threads) == 1
    finally:
        thread.shutdown()
        torch.set_num_threads(before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_a_job_sees_what_the_loop_wrote_on_the_default_stream() -> None:
    """The loop writes request-table rows on the default stream right before it submits a
    step; the device thread's stream must not run ahead of them. The write is held back
    on the default stream by a ~50 ms spin, then the job reads it on its own stream."""
    thread = DeviceThread(stream_factory=torch.cuda.Stream)
    try:
        table = torch.zeros(1 << 20, dtype=torch.int64, device="cuda")
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # cycles on the default stream, before the write
        table.fill_(7)  # the loop's write, still queued behind the spin
        seen = await thread.submit(lambda: int(table.sum().item()))
        assert seen == 7 * table.numel()
    finally:
        thread.shutdown()
