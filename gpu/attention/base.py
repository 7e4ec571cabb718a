"""Attention backend interface: paged KV, mixed prefill-extend and decode batches."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence

import torch

from cache.kv_pool import KVPool
from gpu.graphs.static_buffers import BufferSpec


class AttentionBackend(ABC):
    """Computes causal attention of a step's tokens against the paged KV cache.

    Contract: `prepare` is called once per step with the step's layout (request rows,
    cached prefix length and new-token count per request, flattened token order) and
    builds whatever index metadata the backend needs. `forward` is then called once per
    layer: it first writes the new tokens' K/V at their slots (`out_cache_loc`), then
    returns attention output for every new token, attending to all cached and new
    tokens of its own request at positions <= its own.

    Static-shape execution (captured graphs, `graphs.mode`): a backend that supports it
    declares its metadata as static buffers (`static_specs`, rows per bucket from
    `static_rows`), builds the live rows with `static_metadata`, and reads the staged
    views after `bind_static`. Padding rows (the buffers' sentinels) must attend only
    to the reserved page 0 and write only there. Every tensor attribute of the backend
    except `req_to_token` must then be one of those views: the graph runner checks it
    at capture, so a metadata tensor left out of the registry fails loudly.
    """

    supports_static = False
    persistent: tuple[str, ...] = ("req_to_token",)  # tensor attributes that are not per-step metadata

    def __init__(self, pool: KVPool, req_to_token: torch.Tensor, cpu_kernels: bool = False) -> None:
        self.pool = pool
        self.req_to_token = req_to_token
        # May try tierserve's C++ CPU kernels (gpu/kernels/cpu/); a backend without any ignores it.
        self.cpu_kernels = cpu_kernels

    @abstractmethod
    def prepare(self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> None: ...

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D]."""

    # Static-shape hooks (graph capture / replay); see the class docstring.

    def static_rows(self, tokens: int, requests: int) -> dict[str, int]:
        """Rows of the backend's own units (beyond tokens, requests) a bucket needs."""
        raise NotImplementedError(f"{type(self).__name__} has no static-shape metadata")

    def static_specs(self) -> dict[str, BufferSpec]:
        """The backend's metadata buffers and their padding sentinels."""
        raise NotImplementedError(f"{type(self).__name__} has no static-shape metadata")

    def static_metadata(
        self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int]
    ) -> dict[str, torch.Tensor]:
        """The live rows of every buffer of `static_specs` for this step."""
        raise NotImplementedError(f"{type(self).__name__} has no static-shape metadata")

    def bind_static(self, views: Mapping[str, torch.Tensor]) -> None:
        """Read the staged views in `forward` from now on."""
        raise NotImplementedError(f"{type(self).__name__} has no static-shape metadata")

    def metadata_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor attribute `forward` may read, but the persistent ones."""
        return {
            k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor) and k not in self.persistent
        }
