"""The device thread: runs steps in order and resolves the loop's futures.

On CUDA it owns a dedicated stream (made on the thread by `stream_factory`, since a
stream is current per thread): every job runs on it and the thread waits for the stream
before it resolves the job's future, so results handed to the loop are complete and the
event loop never synchronizes the device itself. On CPU it is the same thread without a
stream. The event loop never blocks on tensor work: it awaits the future.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from cache.copy_worker import Stream, resolve_future
from cache.host_pool import stream_ctx
from gpu.cpu_threads import ThreadPlan, apply_on_this_thread, plan_threads


class DeviceThread:
    def __init__(
        self, name: str = "tierserve-device", num_threads: int | None = None,
        stream_factory: Callable[[], Stream] | None = None,
    ) -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future] | None]
        self._jobs = queue.Queue()
        # `num_threads` None: one intra-op thread per core of the affinity mask.
        self.threads: ThreadPlan = plan_threads(num_threads)
        self._stream_factory = stream_factory
        self.stream: Stream | None = None  # set on the thread, before the first job runs
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Queue `fn` to run on the device thread; the future resolves on the caller's loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._jobs.put((fn, loop, fut))
        return fut

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the device thread and wait (for set-up outside the event loop)."""
        done = threading.Event()
        box: dict[str, Any] = {}

        def job() -> None:
            try:
                box["result"] = fn()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
                box["error"] = exc
            finally:
                done.set()

        self._jobs.put((job, None, None))  # type: ignore[arg-type]
        done.wait()
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def shutdown(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _main(self) -> None:
        apply_on_this_thread(self.threads)
        if self._stream_factory is not None:
            self.stream = self._stream_factory()
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fn, loop, fut = item
            if loop is None:
                self._run(fn)
                continue
            try:
                result = self._run(fn)
            except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting coroutine
                loop.call_soon_threadsafe(resolve_future, fut, None, exc)
            else:
                loop.call_soon_threadsafe(resolve_future, fut, result, None)

    def _run(self, fn: Callable[[], Any]) -> Any:
        """One job on the device stream; its work has finished when this returns.

        NOTE: on CUDA the job's stream first waits for the default stream: the loop
        thread writes request-table rows there (cache/req_table.py `write_pages`) just
        before it submits a step, and torch's side streams do not wait for the default
        stream by themselves, so the step could otherwise read a row before it lands.
        """
        if isinstance(self.stream, torch.cuda.Stream):
            self.stream.wait_stream(torch.cuda.default_stream(self.stream.device))
        with stream_ctx(self.stream):  # type: ignore[arg-type]
            result = fn()
        if self.stream is not None:
            self.stream.synchronize()
        return result
