"""One rank's part of a tensor-parallel group, over torch.distributed's default group.

The model calls three collectives (gpu/models/llama.py): `all_reduce` after each
row-parallel linear, `embed` (a masked lookup in this rank's vocabulary rows, summed over
the ranks) and `gather_vocab` (every rank's logits columns side by side). Rank 0 also
sends each step's work to the other ranks through `send` / `receive` (kernel/parallel/).

NOTE: deterministic mode (`ordered`) sums the ranks' partial results in rank order, on
every rank, from an all-gather: a ring all-reduce adds an element's parts in an order
that depends on which chunk of the tensor the element falls in, i.e. on the row count,
which would make a token's logits depend on its batch (invariant 7). For two ranks both
orders are one addition, so the two agree bit for bit.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist


class TensorParallel:
    """`group`: the ranks' process group (None: torch.distributed's default group, which a
    rank process joined; tests pass one group object per rank thread)."""

    def __init__(self, rank: int, size: int, vocab_size: int, vocab_start: int, vocab_chunk: int,
                 ordered: bool = False, group: Any = None) -> None:
        self.group: Any = group if group is not None else dist.group.WORLD
        self.rank = rank
        self.size = size
        self.vocab_size = vocab_size
        self.vocab_start = vocab_start  # this rank's embedding rows are ids [start, start + chunk)
        self.vocab_chunk = vocab_chunk
        self.ordered = ordered
        # What the collectives cost this rank so far (benchmarks/tp.py reads them).
        self.reduced_bytes = 0  # all-reduced
        self.gathered_bytes = 0  # this rank's part of the gathered logits
        self.comm_seconds = 0.0  # inside all-reduces and gathers, waiting for the slowest rank included

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of each rank's `x` (same shape everywhere)."""
        x = x.contiguous()
        self.reduced_bytes += x.numel() * x.element_size()
        if not self.ordered:
            start = time.perf_counter()
            self.group.allreduce([x]).wait()
            self.comm_seconds += time.perf_counter() - start
            return x
        parts = self._all_gather(x)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def embed(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the whole embedding for `ids`, from this rank's rows `weight` [chunk, D]:
        each id is in exactly one rank's rows, the others add exact zeros."""
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.vocab_chunk)
        rows = weight[local.clamp(0, self.vocab_chunk - 1)]
        return self.all_reduce(torch.where(mine[:, None], rows, torch.zeros((), dtype=rows.dtype)))

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[T, chunk] logits of this rank's vocabulary rows -> [T, vocab_size] on every rank."""
        self.gathered_bytes += logits.numel() * logits.element_size()
        return torch.cat(self._all_gather(logits.contiguous()), dim=-1)[:, : self.vocab_size]

    def _all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        start = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        self.comm_seconds += time.perf_counter() - start
        return parts


def reduce_then_bias(tp: TensorParallel | None, partial: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A row-parallel linear's output: the ranks' partial sums all-reduced, then its bias.
    NOTE: the bias is added after the all-reduce, so once, whatever the rank count."""
    total = partial if tp is None else tp.all_reduce(partial)
    return total if bias is None else total + bias


def send(message: Any) -> None:
    """Rank 0: broadcast one picklable message to every other rank."""
    dist.broadcast_object_list([message], src=0)


def receive() -> Any:
    """Ranks 1..: the next message rank 0 sent."""
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
