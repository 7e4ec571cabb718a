"""The copy worker: FIFO jobs (urgent ones first) on its own thread, futures on the caller's loop, bounded shutdown."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from cache.copy_worker import CopyWorker, CopyWorkerClosed
from cache.host_pool import HostPool, load_back, offload
from cache.kv_pool import KVPool

WAIT = 10.0  # a bound on waits that only a broken worker reaches; never a timing assertion


@pytest.fixture
def worker() -> Iterator[CopyWorker]:
    w = CopyWorker()
    yield w
    w.shutdown(wait=False)


def wait_until(cond: Callable[[], bool]) -> int:
    """Poll `cond` (0 once true): for conditions another thread makes true, bounded by WAIT."""
    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.001)
    return 0


def recorder(log: list[int], i: int) -> Callable[[], int]:
    """A job that appends `i` to `log` and returns it."""

    def job() -> int:
        log.append(i)
        return i

    return job


async def test_future_resolves_on_the_loop_from_another_thread(worker: CopyWorker) -> None:
    loop_thread = threading.get_ident()
    fut = worker.submit(threading.get_ident)
    job_thread = await fut
    assert job_thread != loop_thread, "the job ran on the event loop's thread"
    done_on: list[int] = []
    fut2 = worker.submit(lambda: 1)
    fut2.add_done_callback(lambda _: done_on.append(threading.get_ident()))
    assert await fut2 == 1
    await asyncio.sleep(0)
    assert done_on == [loop_thread], "the future was resolved off the loop"


async def test_jobs_run_in_fifo_order(worker: CopyWorker) -> None:
    gate = threading.Event()
    order: list[int] = []
    # The first job holds the worker, so all others are queued before any runs: the order
    # below is the queue's, not the order the submissions happened to race in.
    first = worker.submit(lambda: gate.wait(WAIT))
    futs = [worker.submit(recorder(order, i)) for i in range(40)]
    assert worker.stats().queued >= 40
    gate.set()
    assert await first is True
    assert await asyncio.gather(*futs) == list(range(40))
    assert order == list(range(40))


async def test_urgent_jobs_start_before_queued_ones_fifo_within_each(worker: CopyWorker) -> None:
    gate = threading.Event()
    order: list[int] = []
    first = worker.submit(lambda: gate.wait(WAIT))  # holds the worker: the rest queue up
    normal = [worker.submit(recorder(order, i)) for i in range(5)]
    urgent = [worker.submit_copy(recorder(order, 100 + i), urgent=True) for i in range(3)]
    gate.set()
    assert await first is True
    await asyncio.gather(*normal, *urgent)
    assert order == [100, 101, 102, 0, 1, 2, 3, 4]
    assert worker.stats().bytes_copied == 100 + 101 + 102


def test_shutdown_drains_urgent_jobs_queued_before_it() -> None:
    async def main() -> list[int]:
        w = CopyWorker()
        ran: list[int] = []
        futs = [w.submit(lambda: wait_until(lambda: w.closed))]
        futs += [w.submit(recorder(ran, 1)), w.submit(recorder(ran, 2), urgent=True)]
        assert w.shutdown(wait=True, timeout=WAIT) is True
        await asyncio.gather(*futs)
        return ran

    assert asyncio.run(main()) == [2, 1]


async def test_an_exception_reaches_the_awaiter_and_the_worker_goes_on(worker: CopyWorker) -> None:
    def boom() -> None:
        raise KeyError("host page 3")

    bad = worker.submit(boom)
    good = worker.submit(lambda: "after")
    with pytest.raises(KeyError, match="host page 3"):
        await bad
    assert await good == "after"
    stats = worker.stats()
    assert (stats.jobs_done, stats.jobs_failed) == (1, 1)


async def test_a_slow_job_does_not_block_the_loop(worker: CopyWorker) -> None:
    """The job waits for a coroutine that can only run if the loop is free while it waits."""
    ticks = 0
    release = threading.Event()

    def slow() -> int:
        if not release.wait(WAIT):
            raise TimeoutError("the loop never ran while the job was waiting")
        return ticks

    async def ticker() -> None:
        nonlocal ticks
        for _ in range(20):
            ticks += 1
            await asyncio.sleep(0)
        release.set()

    fut = worker.submit(slow)
    await ticker()
    assert await fut == 20


def test_shutdown_drains_queued_jobs() -> None:
    async def main() -> tuple[CopyWorker, list[asyncio.Future[int]], list[int]]:
        w = CopyWorker()
        ran: list[int] = []
        # The first job waits until shutdown has begun, so the rest are still queued then.
        futs = [w.submit(lambda: wait_until(lambda: w.closed))]
        futs += [w.submit(recorder(ran, i)) for i in range(1, 6)]
        assert w.shutdown(wait=True, timeout=WAIT) is True
        assert ran == [1, 2, 3, 4, 5]
        assert await asyncio.gather(*futs) == [0, 1, 2, 3, 4, 5]
        with pytest.raises(CopyWorkerClosed):
            w.submit(lambda: 0)
        assert w.shutdown() is True  # idempotent
        return w, futs, ran

    w, _, _ = asyncio.run(main())
    assert w.stats().jobs_done == 6


async def test_shutdown_is_bounded_and_fails_unstarted_jobs() -> None:
    w = CopyWorker()
    gate = threading.Event()
    stuck = w.submit(lambda: gate.wait(WAIT))
    queued = [w.submit(lambda: 1) for _ in range(3)]
    wait_until(lambda: w.stats().queued == 3)  # the stuck job has started
    assert w.shutdown(wait=True, timeout=0.05) is False
    gate.set()
    assert await stuck is True, "a running job completes"
    for fut in queued:
        with pytest.raises(CopyWorkerClosed):
            await fut
    assert w.stats().jobs_done == 1


class FakeStream:
    """Records the thread it was made on and each synchronize (the CUDA contract, on CPU)."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.syncs = 0

    def synchronize(self) -> None:
        self.syncs += 1


async def test_stream_factory_runs_once_on_the_worker_and_each_job_syncs() -> None:
    made: list[FakeStream] = []

    def factory() -> FakeStream:
        made.append(FakeStream())
        return made[-1]

    w = CopyWorker(stream_factory=factory)
    try:
        job_thread = await w.submit(threading.get_ident)
        assert len(made) == 1 and w.stream is made[0]
        assert made[0].thread == job_thread != threading.get_ident()
        await w.submit(lambda: None)
        assert made[0].syncs == 2, "a future resolved before its stream was synchronized"
    finally:
        w.shutdown()
    assert CopyWorker().stream is None

    def broken() -> FakeStream:
        raise RuntimeError("no device")

    with pytest.raises(RuntimeError, match="stream_factory"):
        CopyWorker(stream_factory=broken)


async def test_copy_jobs_count_bytes_and_round_trip(worker: CopyWorker) -> None:
    kv = KVPool(2, 6, 4, 2, 8, torch.bfloat16, torch.device("cpu"))
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape).to(torch.bfloat16))
    host = HostPool.like(kv, 5, "page_first")
    pages = host.allocate(3)
    assert pages is not None
    n = await worker.submit_copy(lambda: offload(kv, [1, 2, 3], host, pages))
    assert n == 3 * host.bytes_per_page
    await worker.submit_copy(lambda: load_back(host, pages, kv, [5, 4, 3]))
    for t in kv.k + kv.v:
        paged = t.view(6, 4, 2, 8)
        assert torch.equal(paged[5], paged[1]) and torch.equal(paged[4], paged[2])
    bad = worker.submit_copy(lambda: offload(kv, [1], host, [0]))
    with pytest.raises(ValueError):
        await bad
    stats = worker.stats()
    assert (stats.bytes_copied, stats.jobs_done, stats.jobs_failed) == (6 * host.bytes_per_page, 2, 1)
