"""Rank 0's side of tensor parallelism: start the worker ranks, feed them, stop them.

`Workers.start` launches ranks 1..N-1 as processes (`python -m kernel.parallel.worker`),
joins them in one torch.distributed group (gloo on CPU) and sends them the config; each
builds its shard of the model. `TensorParallelRunner` is the model runner rank 0's device
thread uses: every step is first sent to the workers (the batch as plain values, with the
request-table rows it reads) and then run here, so all ranks enter the same collectives in
the same order. Rank 0 samples; the other ranks only compute (see kernel/parallel/worker.py).

NOTE: a worker that dies halts the engine, never hangs it. A step checks that every worker
is alive before it sends, a collective with a dead peer raises (gloo closes the
connection; `parallel.timeout_s` bounds the rest), and the step loop's error path halts
the engine with the reason. Workers die with rank 0: each watches its parent process
(kernel/parallel/worker.py), and their next receive fails.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.distributed as dist

from cache.host_pool import HostPool
from cache.kv_pool import KVPool
from cache.req_table import ReqToTokenTable
from gpu.forward_batch import ForwardBatch
from gpu.graphs.runner import Bucket, GraphRunner
from gpu.model_runner import ModelRunner, PendingStep, StepFatal
from gpu.parallel import group
from gpu.sampling import DeviceSample
from kernel.config import Config
from kernel.parallel.host_shards import HostShare

log = structlog.get_logger("tierserve")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WorkerDied(StepFatal):
    """A tensor-parallel worker process exited while the engine ran."""


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every rank's pools must agree on, decided by rank 0 once its model is built."""

    num_pages: int
    table_rows: int
    table_cols: int
    scratch_rows: int
    kv_dtype: str
    attention: str
    state_slots: int  # hybrid models' state pool (0: none)
    host: HostShare | None = None  # the host tier's pages of each worker (kernel/parallel/host_shards.py)
    overlap: bool = False  # overlap scheduling: rank 0 broadcasts each step's sampled tokens


class Workers:
    """The worker processes of ranks 1..size-1 and the group they share with rank 0."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], size: int, cpus: list[tuple[int, ...]]) -> None:
        self.procs = procs
        self.size = size
        self.cpus = cpus  # each rank's cores, rank 0's first
        self.stopped = False
        # NOTE: one stop at a time. An engine that halts starts a stop, and its shutdown then
        # starts another; two at once would each send "stop" and meet at different
        # collectives, and the ranks would hang there until `parallel.timeout_s`.
        self._stopping = threading.Lock()

    @classmethod
    def start(cls, config: Config, cpus: list[tuple[int, ...]]) -> Workers:
        """Launch the workers, join the group as rank 0 and send them the config."""
        size, par = config.parallel.tp_size, config.parallel
        port = _free_port()
        procs = []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
        for rank in range(1, size):
            cmd = [sys.executable, "-m", "kernel.parallel.worker", "--rank", str(rank), "--size", str(size),
                   "--port", str(port), "--timeout", str(par.timeout_s), "--cpus", ",".join(map(str, cpus[rank]))]
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env))
        workers = cls(procs, size, cpus)
        try:
            dist.init_process_group(_backend(par.backend), init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                    world_size=size, timeout=timedelta(seconds=par.timeout_s))
            group.send(config)
        except BaseException:
            workers.kill()
            raise
        log.info("tp_workers_started", size=size, pids=[p.pid for p in procs], cpus=[list(c) for c in cpus])
        return workers

    def check(self) -> None:
        """Raise WorkerDied if a worker is gone (before anything is sent to it)."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                raise WorkerDied(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}")

    def send(self, message: object) -> None:
        self.check()
        group.send(message)

    def set_up(self, setup: Setup) -> None:
        """Send the workers their pools' shape and wait until every worker built them (a
        worker that cannot fails the start here, not the first step)."""
        self.send(setup)
        dist.barrier()

    def stop(self, timeout: float = 10.0) -> None:
        """Tell the workers to exit, wait for them, kill what is left; leave the group. With
        a worker already dead the others cannot finish a collective: they are killed. Any
        thread may call it, any number of times: a later call waits for the first."""
        with self._stopping:
            self._stop(timeout)

    def _stop(self, timeout: float) -> None:
        if self.stopped:
            return
        try:
            self.check()
            group.send(("stop",))
            dist.barrier()  # every rank has the message before any closes its connections
        except Exception as exc:  # noqa: BLE001 - a dead or stuck rank: kill them all
            log.warning("tp_workers_killed", reason=str(exc))
            self.kill()
            return
        self.stopped = True
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        dist.destroy_process_group()
        log.info("tp_workers_stopped", codes=[p.returncode for p in self.procs])

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self.stopped = True
        if dist.is_initialized():
            dist.destroy_process_group()


class TensorParallelRunner(ModelRunner):
    """Rank 0's model runner: each step goes to the workers first, then runs here."""

    def attach(self, workers: Workers, table: ReqToTokenTable) -> None:
        self.workers = workers
        self.table = table

    def run(self, batch: ForwardBatch) -> PendingStep:
        """NOTE: any failure here is fatal (`StepFatal`: the engine halts). Once one rank
        failed a step the ranks may be inside different collectives, and a later step
        would hang or mix them up."""
        try:
            self.workers.send(("run", for_workers(batch), table_rows(self.table.table, batch), self.bucket_of(batch)))
            return super().run(batch)
        except Exception as exc:
            raise StepFatal(f"tensor-parallel step failed on rank 0: {exc}") from exc

    def sample(self, logits: torch.Tensor, batch: ForwardBatch) -> DeviceSample | None:
        """Rank 0 samples. NOTE: with overlap scheduling the next step may already be on its
        way with placeholders for these tokens, so every rank needs them on its device:
        they are broadcast here, in order with the steps' collectives (a worker receives
        them right after the same forward: kernel/parallel/worker.py)."""
        sampled = super().sample(logits, batch)
        if sampled is not None and self.inputs.next_tokens is not None:
            dist.broadcast(sampled.tokens.to(torch.int64).contiguous(), src=0)
        return sampled

    def bucket_of(self, batch: ForwardBatch) -> Bucket | None:
        """The graph bucket this rank runs the batch in (None: eagerly); every worker checks
        it picked the same (kernel/parallel/worker.py `check_bucket`)."""
        graph = self.graphs.bucket_for(batch) if isinstance(self.graphs, GraphRunner) else None
        return graph.bucket if graph is not None else None

    def copy_states(self, copies: Sequence[tuple[int, int]]) -> None:
        """Queued state copies run on every rank (each holds its heads' part of a slot)."""
        self._on_every_rank("copy_states", copies, super().copy_states)

    def move_kv(self, moves: Sequence[tuple[int, int]]) -> None:
        """A token tree's accepted side KV moves on every rank (each holds its heads' part)."""
        self._on_every_rank("move_kv", moves, super().move_kv)

    def _on_every_rank(self, kind: str, pairs: Sequence[tuple[int, int]],
                       here: Callable[[Sequence[tuple[int, int]]], None]) -> None:
        """Send (kind, pairs) to the workers (kernel/parallel/worker.py runs the same method),
        then run it here; any failure is fatal, as a step's is (`run`)."""
        try:
            self.workers.send((kind, tuple(pairs)))
            here(pairs)
        except Exception as exc:
            raise StepFatal(f"tensor-parallel {kind} failed on rank 0: {exc}") from exc

    def close(self) -> None:
        self.workers.stop()

    def rank_stats(self, used_pages: int, used_states: int, host: HostPool | None, used_host_pages: int) -> dict[str, Any]:
        """`/server_info`'s, `/metrics`' and the admin page's view of the ranks. Every rank
        holds its shard of the same page and slot ids: its use is rank 0's count times its
        own bytes per page (or slot)."""
        _, heads, head_dim = self.pool.k[0].shape
        page_bytes = KVPool.bytes_per_page(len(self.pool.k), self.pool.page_size, heads, head_dim, self.pool.k[0].dtype)
        slot_bytes = self.states.bytes_per_slot if self.states is not None else 0
        host_bytes = host.own_page_bytes if host is not None else 0
        tp = getattr(self.model, "tp", None)
        ranks = []
        for rank in range(self.workers.size):
            proc = self.workers.procs[rank - 1] if rank else None
            ranks.append({
                "rank": rank, "pid": proc.pid if proc is not None else os.getpid(),
                "alive": proc is None or proc.poll() is None, "cpus": list(self.workers.cpus[rank]),
                "kv_bytes": {"total": self.pool.num_pages * page_bytes, "used": used_pages * page_bytes},
                "state_bytes": {"total": self.states.num_slots * slot_bytes if self.states is not None else 0,
                                "used": used_states * slot_bytes},
                "host_bytes": {"total": host.num_pages * host_bytes if host is not None else 0,
                               "used": used_host_pages * host_bytes},
            })
        return {
            "tp_size": self.workers.size, "ranks": ranks,
            "collectives": {"reduced_bytes": tp.reduced_bytes if tp else 0,
                            "gathered_bytes": tp.gathered_bytes if tp else 0,
                            "seconds": tp.comm_seconds if tp else 0.0},
        }


def for_workers(batch: ForwardBatch) -> ForwardBatch:
    """The batch as the workers need it: sampling rows without what only rank 0 reads
    (a grammar matcher is not even picklable; token histories feed penalties)."""
    rows = tuple(dataclasses.replace(r, grammar=None, prompt_ids=(), output_ids=()) for r in batch.sampling)
    return dataclasses.replace(batch, sampling=rows)


def table_rows(table: torch.Tensor, batch: ForwardBatch) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """The request-table entries the batch reads: (rows, lengths, their slots flattened)."""
    rows, lens, parts = [], [], []
    for row, prefix, extend in zip(batch.rows, batch.prefix_lens, batch.extend_lens):
        if row == 0:
            continue  # the reserved padding row: every rank's is the same
        rows.append(row)
        lens.append(prefix + extend)
        parts.append(table[row, : prefix + extend])
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=table.dtype)
    return tuple(rows), tuple(lens), flat.cpu()


def write_table_rows(table: torch.Tensor, rows: tuple[int, ...], lens: tuple[int, ...], flat: torch.Tensor) -> None:
    """A worker's side of `table_rows`: its table gets rank 0's entries."""
    at = 0
    for row, n in zip(rows, lens):
        table[row, :n] = flat[at : at + n]
        at += n


def _backend(name: str) -> str:
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
