"""Reading a job's results back from the device, off the device thread.

A step's launch (the forward, sampling) only queues device work and starts the copies
of its results to the host (`HostCopy`); it returns a `Pending` whose `finish()` turns
the copied tensors into plain lists once the copies landed. On CUDA the device thread
does not wait for that: it records a marker (a `torch.cuda.Event`) on its stream after
the job and hands marker and result to the `ReadbackThread`, which waits for the marker,
finishes the result and delivers it, while the device thread launches the next job.

NOTE: a job's result is delivered only after its device work completed — the marker is
recorded after everything the job queued — so the loop may read or free whatever the
job wrote (host-tier copies rely on it), exactly as when the device thread waited for
its stream itself. Deliveries keep the jobs' order (one thread, one FIFO queue).
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

import torch


class Pending(ABC):
    """A job's result still on its way to the host; `finish()` gives the plain result."""

    @abstractmethod
    def finish(self) -> Any: ...


class Marker(Protocol):
    """A point in a stream's work; `synchronize()` returns once the work before it ran
    (a `torch.cuda.Event` is one, and so is any stream: it waits for all it queued)."""

    def synchronize(self) -> None: ...


def mark_stream(stream: Any) -> Marker:
    """A marker after the work queued on `stream` so far."""
    if isinstance(stream, torch.cuda.Stream):
        # A default event: its synchronize() releases the GIL and waits as the stream's
        # own synchronize() did on the device thread before (same CPU cost, other thread).
        event = torch.cuda.Event()
        event.record(stream)
        return event
    return stream  # type: ignore[no-any-return]  # a stand-in stream (tests): waiting on it is the marker


class HostCopy:
    """Device tensors copied to the host without blocking; `get()` waits for the copies.

    NOTE: `.to("cpu", non_blocking=True)` of a CUDA tensor lands in pinned memory
    allocated by torch and returns before the copy ran: its values may be read only after
    the event recorded behind the copies. On CPU the tensors are the host tensors already.
    """

    def __init__(self, *tensors: torch.Tensor) -> None:
        self._host = tuple(t.to("cpu", non_blocking=True) for t in tensors)
        self._event: torch.cuda.Event | None = None
        if any(t.is_cuda for t in tensors):
            self._event = torch.cuda.Event()
            self._event.record()  # on the current stream, behind the copies

    def get(self) -> tuple[torch.Tensor, ...]:
        if self._event is not None:
            self._event.synchronize()
        return self._host


def finish_result(result: Any) -> Any:
    return result.finish() if isinstance(result, Pending) else result


Deliver = Callable[[Any, BaseException | None], None]


class ReadbackThread:
    """Waits for each job's marker, finishes its result and delivers it, in job order."""

    def __init__(self, name: str = "tierserve-readback") -> None:
        self._items: queue.Queue[tuple[Marker, Any, BaseException | None, Deliver] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def put(self, marker: Marker, result: Any, error: BaseException | None, deliver: Deliver) -> None:
        """Deliver `result` (or `error`, raised by the job) once `marker` completed."""
        self._items.put((marker, result, error, deliver))

    def shutdown(self, timeout: float = 30) -> None:
        """Deliver everything queued so far, then stop."""
        self._items.put(None)
        self._thread.join(timeout=timeout)

    def _main(self) -> None:
        while True:
            item = self._items.get()
            if item is None:
                return
            marker, result, error, deliver = item
            try:
                marker.synchronize()  # a failed job's queued work too, before its error
                if error is None:
                    result = finish_result(result)
            except BaseException as exc:  # noqa: BLE001 - delivered to the caller
                if error is None:
                    result, error = None, exc
            deliver(result, error)
