"""Tensor-parallel ranks as threads of the test process (gloo groups over one HashStore),
so the model-level guards of tests/test_tp_shard.py run in milliseconds and a planted bug
(monkeypatched here) reaches every rank — worker processes would not see it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cache.kv_pool import KVPool
from gpu.attention.torch_backend import TorchAttention
from gpu.model_config import ModelArchConfig
from gpu.models.llama import LlamaModel
from gpu.parallel.group import TensorParallel
from gpu.parallel.shard import shard_checkpoint
from kernel.registry import lookup

PAGE = 16
PAGES = 8


def run_ranks(size: int, fn: Callable[[int, Any], torch.Tensor]) -> list[torch.Tensor]:
    """fn(rank, process group) on `size` threads at once -> each rank's result."""
    store = dist.HashStore()
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def main(rank: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, size, timedelta(seconds=30))
            results[rank] = fn(rank, pg)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results


def prefill_then_decode(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Logits of every prompt position (one prefill of ids[:-1]), then of one decode step
    of ids[-1] reading the cached KV: [len(ids), vocab]."""
    arch = model.arch
    pool = KVPool(arch.num_layers, PAGES, PAGE, arch.num_kv_heads, arch.head_dim, torch.float32,
                  torch.device("cpu"), torch.float32)
    table = torch.zeros((2, PAGES * PAGE), dtype=torch.int64)
    table[1, : (PAGES - 1) * PAGE] = torch.arange(PAGE, PAGES * PAGE)  # page 0 is reserved
    attn = TorchAttention(pool, table)
    n = len(ids) - 1
    attn.prepare((1,), (0,), (n,))
    first = model.forward(torch.tensor(ids[:-1]), torch.arange(n), attn, torch.arange(n))
    attn.prepare((1,), (n,), (1,))
    last = model.forward(torch.tensor(ids[-1:]), torch.tensor([n]), attn, torch.tensor([0]))
    return torch.cat([first, last])


def sharded_logits(arch: ModelArchConfig, weights: Mapping[str, torch.Tensor], size: int, ids: list[int],
                   deterministic: bool = False) -> list[torch.Tensor]:
    """prefill_then_decode on `size` ranks of the model: every rank's gathered logits."""

    def rank_fn(rank: int, pg: Any) -> torch.Tensor:
        shard = shard_checkpoint(arch, weights, {}, rank, size)
        tp = TensorParallel(rank, size, arch.vocab_size, shard.vocab_start, shard.vocab_chunk,
                            ordered=deterministic, group=pg)
        model = lookup("model", arch.architecture)(shard.arch, shard.weights, torch.float32, torch.device("cpu"),
                                                    deterministic=deterministic, tp=tp)
        return prefill_then_decode(model, ids)

    with torch.inference_mode():
        return run_ranks(size, rank_fn)
