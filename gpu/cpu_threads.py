"""CPU thread settings the user never has to touch: intra-op threads sized to the cores
this process may run on, applied on the device thread.

torch's own default counts the machine's cores as its OpenMP runtime sees them, which
in a container limited by a CPU set (docker `--cpuset-cpus`, `taskset`, a Kubernetes
CPU manager) can be more threads than the process may use: threads then time-share a
core and every parallel region waits for the slowest. The affinity mask is the one
number that says which cores are ours, so it decides the count; the device thread (the
OpenMP master of every forward) and the OpenMP workers it starts inherit that mask.

NOTE: the event loop does not get a core of its own. Between steps the device thread
sleeps on its job queue, so planning, detokenizing and streaming run while the device
thread is idle; during a forward the loop's overlapped work (detokenizing step N while
N+1 runs) competes with one OpenMP worker. Whether a core for the loop (or fewer threads)
pays is measured by benchmarks/vs_llamacpp.py
(`--tierserve-variant threads-1:model.num_threads=1`): on the shared, overloaded 2-core
dev machine one thread was ~4x faster than two (a descheduled OpenMP thread stalls every
parallel region), which says nothing yet about a quiet machine; the default stays one
thread per core until a quiet-machine run decides.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadPlan:
    cpus: tuple[int, ...]  # cores this process may run on (its affinity mask)
    intra_op: int  # torch intra-op (OpenMP) threads of the device thread
    pin: bool = False  # the device thread (and the OpenMP workers it starts) keeps to `cpus`


def usable_cpus() -> tuple[int, ...]:
    """The cores in this process's affinity mask (all cores where there is no mask)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))  # macOS / Windows: no affinity mask


def plan_threads(configured: int | None, cpus: tuple[int, ...] | None = None) -> ThreadPlan:
    """`model.num_threads` when set, else one intra-op thread per usable core; `cpus`: a
    share of the cores to keep to (a tensor-parallel rank's), else the whole mask."""
    mine = cpus or usable_cpus()
    return ThreadPlan(mine, configured if configured else max(1, len(mine)), pin=cpus is not None)


def share_cpus(ranks: int, per_rank: int = 0) -> list[tuple[int, ...]]:
    """Each tensor-parallel rank's cores: `per_rank` each (0: the mask shared out evenly, at
    least one each), in mask order, wrapping around when there are more ranks than cores."""
    cpus = usable_cpus()
    per = per_rank or max(1, len(cpus) // ranks)
    return [tuple(cpus[(r * per + i) % len(cpus)] for i in range(per)) for r in range(ranks)]


def apply_on_this_thread(plan: ThreadPlan) -> None:
    """Run on the device thread: OpenMP's thread count is per calling thread."""
    import torch  # here: usable_cpus() is read before torch is imported (tests/conftest.py)

    if plan.pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, plan.cpus)  # 0: the calling thread (Linux)
    torch.set_num_threads(plan.intra_op)
