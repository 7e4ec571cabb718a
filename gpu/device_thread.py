"""The device thread: launches steps in order and resolves the loop's futures.

On CUDA it owns a dedicated stream (made on the thread by `stream_factory`, since a
stream is current per thread) and every job runs on it. A job only launches its work:
the thread then records an event behind it on the stream and hands event and result to
a readback thread (gpu/readback.py), which waits for the event, finishes a `Pending`
result (its device-to-host copies read into plain lists) and resolves the future, while
this thread already launches the next job. So the GPU runs step N while step N+1's
Python launch work runs here, and neither this thread nor the event loop ever waits for
the device. On CPU it is the same thread without a stream, finishing each result inline.

NOTE: a job's future resolves only after its device work completed (gpu/readback.py):
the loop may read or free whatever a finished job wrote. Errors of a job or of its
finish reach the awaiting coroutine; futures resolve in job order.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import structlog
import torch

from cache.copy_worker import Stream, resolve_future
from cache.host_pool import stream_ctx
from gpu.cpu_threads import ThreadPlan, apply_on_this_thread, plan_threads
from gpu.readback import Deliver, Marker, ReadbackThread, finish_result, mark_stream

log = structlog.get_logger("tierserve")


class DeviceThread:
    def __init__(
        self, name: str = "tierserve-device", num_threads: int | None = None,
        stream_factory: Callable[[], Stream] | None = None, mark: Callable[[Any], Marker] = mark_stream,
        cpus: tuple[int, ...] | None = None,
    ) -> None:
        # SimpleQueue (C, a bare lock): wakes the device thread sooner than Queue's Condition.
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Deliver] | None] = queue.SimpleQueue()
        # `num_threads` None: one intra-op thread per core of the affinity mask (or of `cpus`,
        # a tensor-parallel rank's share, which the thread then keeps to).
        self.threads: ThreadPlan = plan_threads(num_threads, cpus)
        self._stream_factory = stream_factory
        self._mark = mark  # the marker behind a job's work on the stream (tests fake it)
        self.stream: Stream | None = None  # set on the thread, before the first job runs
        # With a stream, results are read back off this thread; without, inline.
        self._readback = ReadbackThread(f"{name}-readback") if stream_factory is not None else None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Queue `fn` to run on the device thread; the future resolves on the caller's loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._jobs.put((fn, partial(_resolve_on, loop, fut)))
        return fut

    def post(self, fn: Callable[[], Any]) -> None:
        """Queue `fn` behind the jobs queued so far, with no result to await (a message that
        must keep its place among the steps); an error is logged."""
        self._jobs.put((fn, _log_error))

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the device thread and wait (for set-up outside the event loop)."""
        done = threading.Event()
        box: list[tuple[Any, BaseException | None]] = []

        def deliver(result: Any, error: BaseException | None) -> None:
            box.append((result, error))
            done.set()

        self._jobs.put((fn, deliver))
        done.wait()
        result, error = box[0]
        if error is not None:
            raise error
        return result

    def shutdown(self) -> None:
        """Stop after the jobs queued so far; their futures all resolve first."""
        self._jobs.put(None)
        self._thread.join(timeout=30)
        if self._readback is not None:
            self._readback.shutdown()

    def _main(self) -> None:
        apply_on_this_thread(self.threads)
        if self._stream_factory is not None:
            self.stream = self._stream_factory()
        while (job := self._jobs.get()) is not None:
            fn, deliver = job
            result, error = None, None
            try:
                result = self._launch(fn)
            except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting caller
                error = exc
            if self._readback is not None:
                self._readback.put(self._mark(self.stream), result, error, deliver)
            else:
                _finish_inline(result, error, deliver)

    def _launch(self, fn: Callable[[], Any]) -> Any:
        """One job on the device stream; on CUDA its work may still be running on return.

        NOTE: on CUDA the job's stream first waits for the default stream: the loop
        thread writes request-table rows there (cache/req_table.py `write_pages`) just
        before it submits a step, and torch's side streams do not wait for the default
        stream by themselves, so the step could otherwise read a row before it lands.
        """
        if isinstance(self.stream, torch.cuda.Stream):
            self.stream.wait_stream(torch.cuda.default_stream(self.stream.device))
        with stream_ctx(self.stream):  # type: ignore[arg-type]
            return fn()


def _finish_inline(result: Any, error: BaseException | None, deliver: Deliver) -> None:
    if error is None:
        try:
            result = finish_result(result)
        except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting caller
            result, error = None, exc
    deliver(result, error)


def _log_error(result: Any, error: BaseException | None) -> None:
    if error is not None:
        log.error("device_thread_post_failed", error=repr(error))


def _resolve_on(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result: Any,
                error: BaseException | None) -> None:
    try:
        loop.call_soon_threadsafe(resolve_future, fut, result, error)
    except RuntimeError:
        pass  # the caller's loop is closed: nobody awaits this future any more
