"""The device thread with a stream: job N+1 is launched while job N's device work may
still run, and job N's future resolves only once its marker (a CUDA event behind its
work) completed, its Pending result finished (gpu/readback.py).

The stream and its markers are faked on CPU: a `Gate` marker blocks the readback thread
until the test releases it, standing for a GPU still busy with that job.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import gpu.readback as readback_mod
from gpu.device_thread import DeviceThread
from gpu.readback import Pending, ReadbackThread

WAIT = 5.0  # seconds: only ever reached when a test is failing


class Gate:
    """A marker whose device work completes when the test says so."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def synchronize(self) -> None:
        assert self.released.wait(WAIT), "gate never released"


class FakeStream:
    def synchronize(self) -> None:
        raise AssertionError("with markers, nothing waits for the whole stream")


class Finishes(Pending):
    def __init__(self, value: Any, log: list[str] | None = None) -> None:
        self.value, self.log = value, log

    def finish(self) -> Any:
        if isinstance(self.value, BaseException):
            raise self.value
        if self.log is not None:
            self.log.append(f"finish {self.value}")
        return self.value


@pytest.fixture
def gates() -> list[Gate]:
    return [Gate() for _ in range(4)]


@pytest.fixture
def gated(gates: list[Gate]) -> Iterator[DeviceThread]:
    """A device thread whose k-th job's marker is gates[k]."""
    handed = iter(gates)
    thread = DeviceThread(stream_factory=FakeStream, mark=lambda stream: next(handed))
    yield thread
    for gate in gates:
        gate.released.set()
    thread.shutdown()


async def wait_for(event: threading.Event, timeout: float = WAIT) -> bool:
    return await asyncio.get_running_loop().run_in_executor(None, event.wait, timeout)


async def check_next_job_launches_before_the_first_resolves(thread: DeviceThread, gates: list[Gate],
                                                            launch_wait: float = WAIT) -> None:
    second_ran = threading.Event()
    first = thread.submit(lambda: Finishes(1))
    second = thread.submit(lambda: second_ran.set() or 2)
    ran = await wait_for(second_ran, launch_wait)
    assert ran, "job 2 was not launched while job 1's device work ran"
    await asyncio.sleep(0.05)
    assert not first.done(), "job 1's future resolved before its device work completed"
    gates[0].released.set()
    assert await asyncio.wait_for(first, WAIT) == 1
    gates[1].released.set()
    assert await asyncio.wait_for(second, WAIT) == 2


async def test_job_n_plus_1_launches_before_job_n_resolves(gated: DeviceThread, gates: list[Gate]) -> None:
    await check_next_job_launches_before_the_first_resolves(gated, gates)


async def test_red_when_a_future_resolves_before_its_marker(gated: DeviceThread, gates: list[Gate],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: with the wait for the marker planted away, job 1's
    future resolves while its gate is still closed."""
    monkeypatch.setattr(Gate, "synchronize", lambda self: None)
    with pytest.raises(AssertionError, match="before its device work completed"):
        await check_next_job_launches_before_the_first_resolves(gated, gates)


async def test_red_when_the_device_thread_waits_for_each_job(gates: list[Gate]) -> None:
    """And red the other way: a device thread that waits for a job's marker itself before
    it takes the next job (what it did before the readback thread) does not overlap."""
    handed = iter(gates)

    def waited_marker(stream: Any) -> Gate:
        gate = next(handed)
        gate.synchronize()  # on the device thread, before the next job
        return gate

    thread = DeviceThread(stream_factory=FakeStream, mark=waited_marker)
    try:
        with pytest.raises(AssertionError, match="not launched while"):
            await check_next_job_launches_before_the_first_resolves(thread, gates, launch_wait=0.5)
    finally:
        for gate in gates:
            gate.released.set()
        thread.shutdown()


async def test_futures_resolve_in_job_order(gated: DeviceThread, gates: list[Gate]) -> None:
    order: list[int] = []
    futs = [gated.submit(lambda i=i: Finishes(i)) for i in range(3)]
    for i, fut in enumerate(futs):
        fut.add_done_callback(lambda _, i=i: order.append(i))
    gates[2].released.set()  # job 2's work is done first: it still waits for jobs 0 and 1
    gates[1].released.set()
    await asyncio.sleep(0.05)
    assert order == []
    gates[0].released.set()
    assert await asyncio.wait_for(asyncio.gather(*futs), WAIT) == [0, 1, 2]
    assert order == [0, 1, 2]


async def test_errors_of_a_job_and_of_its_finish_reach_the_caller(gated: DeviceThread, gates: list[Gate]) -> None:
    for gate in gates:
        gate.released.set()
    with pytest.raises(ZeroDivisionError):
        await gated.submit(lambda: 1 / 0)
    with pytest.raises(KeyError, match="lost"):
        await gated.submit(lambda: Finishes(KeyError("lost")))
    assert await gated.submit(lambda: Finishes(3)) == 3  # the threads go on
    with pytest.raises(ValueError, match="set-up"):
        gated.call(lambda: Finishes(ValueError("set-up")))


async def test_a_failed_jobs_error_waits_for_its_marker(gated: DeviceThread, gates: list[Gate]) -> None:
    """Whatever the failed job queued on the device is done before the caller hears of it."""
    failed = gated.submit(lambda: 1 / 0)
    await asyncio.sleep(0.05)
    assert not failed.done()
    gates[0].released.set()
    with pytest.raises(ZeroDivisionError):
        await asyncio.wait_for(failed, WAIT)


def test_call_returns_after_the_marker_with_the_finished_result(gates: list[Gate]) -> None:
    handed = iter(gates)
    thread = DeviceThread(stream_factory=FakeStream, mark=lambda stream: next(handed))
    log: list[str] = []
    try:
        threading.Timer(0.05, lambda: (log.append("released"), gates[0].released.set())).start()
        assert thread.call(lambda: Finishes(4, log)) == 4
        assert log == ["released", "finish 4"]
    finally:
        thread.shutdown()


async def test_shutdown_delivers_every_queued_job(gates: list[Gate]) -> None:
    handed = iter(gates)
    thread = DeviceThread(stream_factory=FakeStream, mark=lambda stream: next(handed))
    futs = [thread.submit(lambda i=i: Finishes(i)) for i in range(3)]
    threading.Timer(0.05, lambda: [g.released.set() for g in gates]).start()
    thread.shutdown()  # blocks until the three are delivered
    assert await asyncio.wait_for(asyncio.gather(*futs), WAIT) == [0, 1, 2]


async def test_without_a_stream_results_finish_inline() -> None:
    thread = DeviceThread()
    log: list[str] = []
    try:
        assert thread._readback is None  # CPU: no second thread, no hop
        assert await thread.submit(lambda: Finishes(5, log)) == 5
        assert log == ["finish 5"]
        with pytest.raises(KeyError):
            await thread.submit(lambda: Finishes(KeyError("x")))
    finally:
        thread.shutdown()


def test_readback_thread_survives_a_failing_marker() -> None:
    class Broken:
        def synchronize(self) -> None:
            raise RuntimeError("device lost")

    got: list[tuple[Any, Any]] = []
    done = threading.Event()

    def deliver(n: int) -> Callable[[Any, BaseException | None], None]:
        def put(result: Any, error: BaseException | None) -> None:
            got.append((result, type(error).__name__ if error else None))
            if n == 2:
                done.set()
        return put

    rb, gate = ReadbackThread(), Gate()
    rb.put(Broken(), Finishes(1), None, deliver(0))
    rb.put(Broken(), None, ZeroDivisionError(), deliver(1))  # the job's own error is reported
    rb.put(gate, 7, None, deliver(2))
    gate.released.set()
    assert done.wait(WAIT)
    rb.shutdown()
    assert got == [(None, "RuntimeError"), (None, "ZeroDivisionError"), (7, None)]


def test_cpu_host_copy_is_the_tensor_itself() -> None:
    import torch

    t = torch.arange(3)
    copy = readback_mod.HostCopy(t)
    assert copy.get()[0] is t and copy._event is None


def test_uploads_on_cpu_are_the_plain_tensors() -> None:
    import torch

    from gpu.upload import copy_to_device, to_device

    cpu = torch.device("cpu")
    t = to_device([3, 1, 2], torch.int32, cpu)
    assert t.dtype == torch.int32 and t.tolist() == [3, 1, 2]
    assert copy_to_device(t, cpu) is t  # no copy, no pinning on CPU
