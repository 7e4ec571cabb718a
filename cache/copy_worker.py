"""The copy worker: one thread that runs the host tier's copy jobs, urgent ones first,
each class in FIFO order.

Copies get their own thread (and, on CUDA, their own stream) so that an offload or a
prefetch never queues behind a forward on the device thread, and the event loop never
blocks on one: it awaits the future `submit` returns. Jobs are plain callables built by
the loop from snapshots (page ids, pools); the worker knows nothing of trees or requests.

A load-back has a request waiting for it (its TTFT), an offload has nobody: loads are
submitted `urgent` and start before any offload still queued (a running job is never
interrupted). Reordering is safe because the two never touch the same memory: a load
reads host pages the tree already owns and writes device pages it allocated; an offload
reads device pages of a locked node and writes host pages it allocated.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class Stream(Protocol):
    """What the worker needs of its stream (a `torch.cuda.Stream` has it)."""

    def synchronize(self) -> None: ...


class CopyWorkerClosed(RuntimeError):
    """The worker was shut down: a job submitted after, or dropped unstarted by, shutdown."""


@dataclass(frozen=True)
class CopyStats:
    """Counters since start: jobs that returned, jobs that raised, bytes reported by
    `submit_copy` jobs that returned, and jobs still queued."""

    jobs_done: int
    jobs_failed: int
    bytes_copied: int
    queued: int


@dataclass
class _Job:
    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    fut: asyncio.Future[Any]
    counts_bytes: bool


# Queue priorities (lower first); the shutdown sentinel sorts after every job.
_URGENT, _NORMAL, _STOP = 0, 1, 2


class CopyWorker:
    """A dedicated copy thread. `stream_factory`, when given, is called once on that thread
    (a CUDA stream belongs to the thread that made it current); its result is `stream`,
    which jobs pass to `offload`/`load_back`. After each job the worker synchronizes the
    stream, so a future resolves only once the job's copies have landed: the loop may then
    free the source pages or read the destination."""

    def __init__(
        self, name: str = "tierserve-copy", stream_factory: Callable[[], Stream] | None = None
    ) -> None:
        # (priority, sequence, job): urgent jobs first, FIFO within a priority (the
        # sequence breaks ties, so jobs themselves are never compared).
        self._jobs: queue.PriorityQueue[tuple[int, int, _Job | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._lock = threading.Lock()  # orders `submit` against `shutdown`'s sentinel
        self._closed = False
        self._drop = False  # set by a shutdown that gave up waiting: unstarted jobs fail
        self._done = 0
        self._failed = 0
        self._bytes = 0
        self.stream: Stream | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(stream_factory,), name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            raise RuntimeError("copy worker: stream_factory failed") from self._start_error

    @property
    def closed(self) -> bool:
        """True once `shutdown` was called: `submit` then raises."""
        return self._closed

    def stats(self) -> CopyStats:
        # Plain int reads of counters only the worker thread writes: a snapshot may be one
        # job behind, never torn.
        return CopyStats(self._done, self._failed, self._bytes, self._jobs.qsize())

    def submit(self, fn: Callable[[], T], urgent: bool = False) -> asyncio.Future[T]:
        """Queue `fn` behind every job already queued — or, `urgent`, behind the urgent
        ones only; the future resolves on the calling (running) loop with its result or
        exception. Raises `CopyWorkerClosed` after shutdown."""
        return self._put(fn, counts_bytes=False, urgent=urgent)

    def submit_copy(self, fn: Callable[[], int], urgent: bool = False) -> asyncio.Future[int]:
        """Like `submit` for a job that returns the bytes it copied (`offload`, `load_back`
        do); they are added to `bytes_copied`."""
        return self._put(fn, counts_bytes=True, urgent=urgent)

    def _put(self, fn: Callable[[], Any], counts_bytes: bool, urgent: bool) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            if self._closed:
                raise CopyWorkerClosed("copy worker is shut down")
            self._jobs.put((_URGENT if urgent else _NORMAL, next(self._seq), _Job(fn, loop, fut, counts_bytes)))
        return fut

    def shutdown(self, wait: bool = True, timeout: float = 30.0) -> bool:
        """Stop taking jobs. `wait`: block (up to `timeout` seconds) while the queued jobs
        run, and return True if all finished. On timeout, or with `wait=False`, jobs not
        yet started fail with `CopyWorkerClosed` (a running one completes) and the result
        is False. Idempotent. Blocks the calling thread: call it off the loop, or with
        `wait=False` on it."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._jobs.put((_STOP, next(self._seq), None))
        if wait:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                return True
        self._drop = True
        return not self._thread.is_alive()

    def _main(self, stream_factory: Callable[[], Stream] | None) -> None:
        try:
            if stream_factory is not None:
                self.stream = stream_factory()
        except BaseException as exc:  # noqa: BLE001 - re-raised by __init__
            self._start_error = exc
            return
        finally:
            self._ready.set()
        while True:
            _, _, job = self._jobs.get()
            if job is None:
                return
            if self._drop:
                _deliver(job, None, CopyWorkerClosed("copy worker shut down before this job started"))
                continue
            try:
                result = job.fn()
                if self.stream is not None:
                    self.stream.synchronize()
                nbytes = int(result) if job.counts_bytes else 0
            except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting coroutine
                self._failed += 1
                _deliver(job, None, exc)
                continue
            self._done += 1
            self._bytes += nbytes
            _deliver(job, result, None)


def _deliver(job: _Job, result: Any, exc: BaseException | None) -> None:
    try:
        job.loop.call_soon_threadsafe(resolve_future, job.fut, result, exc)
    except RuntimeError:
        # The caller's loop is closed: nobody awaits this future any more. The worker
        # must survive it to serve the other loops' jobs.
        pass


def resolve_future(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    """Settle `fut` on its loop (called there via call_soon_threadsafe); a cancelled
    future is left alone. Shared with the device thread (gpu/device_thread.py)."""
    if fut.cancelled():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
