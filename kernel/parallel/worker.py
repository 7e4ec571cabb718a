"""A tensor-parallel worker rank: `python -m kernel.parallel.worker --rank R --size N --port P`.

Started by rank 0 (kernel/parallel/workers.py), never by hand. It joins the group, takes
the config rank 0 sends, builds its shard of the model and pools like rank 0's (the same
page count, table shape, KV dtype and attention backend: `Setup`), then runs what rank 0
sends until it says stop:
- ("run", batch, table rows): write the rows into its own request table and run the step
  as rank 0's runner does (the same collectives), without sampling: rank 0 samples;
- ("copy_states", copies): a hybrid model's queued state-slot copies, in order;
- ("copy", kind, ..., ticket): the host tier's copy of this rank's shard of pages, or of
  its part of a state slot to or from its mirror (kernel/parallel/host_shards.py), marked
  done for rank 0's copy job.

It exits when rank 0 says stop, when rank 0's process dies (it watches its parent, and the
next receive fails), and on any error (rank 0's next collective then fails: the engine
halts with the reason).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from cache.kv_pool import KVPool
from cache.state_pool import StatePool
from gpu.forward_batch import ForwardBatch
from gpu.graphs.runner import Bucket, GraphRunner
from gpu.model_runner import ModelRunner
from gpu.parallel import group
from kernel import registry
from kernel.components import build_graph_runner, pick_device, step_inputs
from kernel.config import Config
from kernel.logging_setup import setup_logging
from kernel.model_build import build_model
from kernel.parallel.host_shards import WorkerCopies
from kernel.parallel.workers import Setup, write_table_rows


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    _die_with_parent()
    cpus = [int(c) for c in args.cpus.split(",") if c]
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.size, timeout=timedelta(seconds=args.timeout))
    config: Config = group.receive()
    setup_logging(config.logging.level, config.logging.json)
    torch.set_num_threads(config.model.num_threads or max(1, len(cpus)))
    runner, copies = _build(config, args.rank, args.size)
    dist.barrier()  # built: rank 0's start-up goes on (kernel/parallel/workers.py `set_up`)
    # Rank 0 builds its graph runner next: the warm-ups (emulate) or captures (cuda) run
    # the forward's collectives, so this rank runs the same ones, bucket for bucket.
    runner.graphs = build_graph_runner(config, runner.model, runner.attention, runner.states, runner.device)
    if isinstance(runner.graphs, GraphRunner):
        runner.graphs.inputs = runner.inputs
    with torch.inference_mode():
        while (message := group.receive())[0] != "stop":
            if message[0] == "copy_states":
                runner.copy_states(message[1])
                continue
            if message[0] == "move_kv":
                runner.move_kv(message[1])
                continue
            if message[0] == "copy":
                assert copies is not None, "a host copy, and this rank has no host pages"
                copies.run(*message[1:])
                continue
            _, batch, (rows, lens, flat), bucket = message
            write_table_rows(runner.attention.req_to_token, rows, lens, flat)
            runner.check_bucket(batch, bucket)
            runner.run(batch)
    dist.barrier()  # rank 0 waits here too: nobody closes a connection another still reads
    dist.destroy_process_group()
    return 0


def _build(config: Config, rank: int, size: int) -> tuple[WorkerRunner, WorkerCopies | None]:
    """This rank's model shard and pools, shaped as rank 0's `Setup` says."""
    device = pick_device(config)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    built = build_model(config, device, rank=rank)
    setup: Setup = group.receive()
    arch, model = built.arch, built.model
    kv_dtype = getattr(torch, setup.kv_dtype)
    kv_layers = getattr(model, "num_kv_layers", arch.num_layers)  # hybrids: attention layers only
    pool = KVPool(kv_layers, setup.num_pages, config.cache.page_size, arch.num_kv_heads, arch.head_dim,
                  kv_dtype, device, built.dtype)
    table = torch.zeros((setup.table_rows + setup.scratch_rows, setup.table_cols), dtype=torch.int64, device=device)
    attention = registry.lookup("attention", setup.attention)(pool, table, cpu_kernels=built.cpu_kernels)
    states = StatePool(model.state_shapes(), setup.state_slots, built.dtype, device) if setup.state_slots else None
    copies = WorkerCopies(pool, states, setup.host, rank, size) if setup.host is not None else None
    runner = WorkerRunner(model, pool, attention, states, cpu_kernels=built.cpu_kernels)
    runner.inputs = step_inputs(device, table.shape[0], setup.overlap)
    return runner, copies


class WorkerRunner(ModelRunner):
    """A worker rank's model runner: rank 0's step calls (so the same collectives), and
    no sampling: rank 0 samples from the logits every rank gathered."""

    def sample(self, logits: torch.Tensor, batch: ForwardBatch) -> None:
        """Nothing to sample; with overlap scheduling, rank 0's tokens for the next step's
        placeholders (kernel/parallel/workers.py `TensorParallelRunner.sample`)."""
        next_tokens = self.inputs.next_tokens
        if next_tokens is None:
            return
        tokens = torch.empty(len(batch.sample_rows), dtype=torch.int64, device=self.device)
        dist.broadcast(tokens, src=0)
        next_tokens.record([batch.rows[i] for i in batch.sample_rows], tokens)

    def check_bucket(self, batch: ForwardBatch, bucket: Bucket | None) -> None:
        """Raise BucketMismatch unless this rank runs the batch in rank 0's graph bucket
        (or, like it, eagerly). NOTE: checked before the step's first collective: ranks
        padding one batch to different shapes would mismatch every all-reduce (gloo
        aborts the process that receives more than it expects: rank 0 may be that one).
        Raised here, it ends this worker, and rank 0's collective fails: the engine halts."""
        graph = self.graphs.bucket_for(batch) if isinstance(self.graphs, GraphRunner) else None
        mine = graph.bucket if graph is not None else None
        if mine != bucket:
            raise BucketMismatch(f"rank 0 runs this batch in graph bucket {bucket}, this rank in {mine}")


class BucketMismatch(RuntimeError):
    """A worker would run a batch at another static shape than rank 0."""


def _die_with_parent() -> None:
    """Exit when rank 0's process is gone, so no worker outlives its server.
    NOTE: not PR_SET_PDEATHSIG: that fires when the *thread* that started the worker ends,
    and rank 0 starts its workers from its device thread, which ends before they stop."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="tierserve-parent-watch", daemon=True).start()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="a tensor-parallel worker rank (started by rank 0)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--cpus", default="")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
