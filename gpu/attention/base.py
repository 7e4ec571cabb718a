"""Attention backend interface: paged KV, mixed prefill-extend and decode batches."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from cache.kv_pool import KVPool


class AttentionBackend(ABC):
    """Computes causal attention of a step's tokens against the paged KV cache.

    Contract: `prepare` is called once per step with the step's layout (request rows,
    cached prefix length and new-token count per request, flattened token order) and
    builds whatever index metadata the backend needs. `forward` is then called once per
    layer: it first writes the new tokens' K/V at their slots (`out_cache_loc`), then
    returns attention output for every new token, attending to all cached and new
    tokens of its own request at positions <= its own.
    """

    def __init__(self, pool: KVPool, req_to_token: torch.Tensor) -> None:
        self.pool = pool
        self.req_to_token = req_to_token

    @abstractmethod
    def prepare(self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> None: ...

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D]."""
