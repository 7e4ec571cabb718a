"""Batch-invariant attention for deterministic mode on CPU, in the chained form.

Every new token of a step, prefill or decode, is one row of the paged kernel's problem
(gpu/kernels/cpu/paged_attention.cpp `paged_attention_chained`): its query against its own
request's keys at positions <= its own, read from the pool after this step's K/V are
written there.

NOTE: invariant 7. The chained form (gpu/kernels/cpu/chained_attention.h) fixes one
arithmetic per (query head, key): FMA chains in element and key order, fixed block sums,
keys cut into chunks by the row's own length and merged in chunk order. A decode row runs
it with keys in vector lanes; a request's consecutive tokens (a prefill chunk's) run it as
tiles of up to 16 with queries in lanes, each K/V row read once per tile; every lane runs
the same scalar sequence, so a token's output depends on its query, its position and its
request's K/V only: the same bits alone or among 64 other rows, in a 512-token chunk or as
a decode step, after a prefix hit or cold. Decode and prefill run one arithmetic, so K/V a
decode step wrote equal what a cold prefill of the same tokens writes (a cached answer
reused as the next turn's prompt). The native decode step (graphs.mode cpu,
decode_step.cpp) runs the chained form too when this backend is in use (`set_chained`).

Cost: a prefill tile reuses each K/V row across its 16 queries as a GEMM does; at a
2,048-token context it took ~1.6x SDPA-flash's time on an AMX Xeon and a fifth of it or less
on an AVX-512 EPYC, and a hybrid model's deterministic cold TTFT is about the default's
(benchmarks/hybrid_prefix.py). A decode row (keys in lanes, K transposed per block) takes
~1.5x the paged decode kernel's time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from cache.kv_pool import KVPool
from gpu.attention import paged_decode
from gpu.attention.base import AttentionBackend
from gpu.attention.paged_decode import PagedDecode
from gpu.graphs.static_buffers import BufferSpec
from gpu.upload import to_device
from kernel.registry import register


@register("attention", "deterministic_paged")
class PagedDeterministicAttention(AttentionBackend):
    """Static shapes: all metadata is per token (its KV slot, its request's page table,
    its key count), so a bucket needs no rows of its own; a padding token writes slot 0
    of the reserved page and attends to that one key."""

    supports_static = True

    def __init__(self, pool: KVPool, req_to_token: torch.Tensor, cpu_kernels: bool = False) -> None:
        super().__init__(pool, req_to_token, cpu_kernels)
        if not paged_decode.kernel_ready(cpu_kernels, pool):
            raise ValueError("the deterministic paged backend needs the C++ paged attention kernel for this pool")
        self.out_cache_loc = torch.empty(0, dtype=torch.int64)
        self._page_table = torch.empty(0, 0, dtype=torch.int64)  # [T, pages] each token's request's pages
        self._seq_lens = torch.empty(0, dtype=torch.int64)  # [T] keys each token sees, itself included
        self.max_pages = req_to_token.shape[1] // pool.page_size

    def prepare(self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> None:
        self._bind(self._metadata(rows, prefix_lens, extend_lens, None))

    def prepare_decodes(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """`prepare` of a decode-only step from tensors (one token per request, at
        `positions`): the native decode step's entry (gpu/graphs/cpu_step.py)."""
        self.out_cache_loc, step = paged_decode.decode_slots(self.req_to_token, rows, positions, self.pool.page_size)
        self._page_table, self._seq_lens = step.page_table, step.seq_lens

    def paged_decodes(self) -> tuple[torch.Tensor, PagedDecode] | None:
        """After `prepare`: every token's KV slot and the kernel's metadata (all tokens are
        kernel rows here, in order)."""
        return self.out_cache_loc, PagedDecode(None, self._page_table, self._seq_lens)

    @property
    def uses_paged_kernel(self) -> bool:
        return True

    def static_rows(self, tokens: int, requests: int) -> dict[str, int]:
        return {}

    def static_specs(self) -> dict[str, BufferSpec]:
        return {
            "out_cache_loc": BufferSpec("tokens", (), torch.int64, 0),  # slot 0 of the reserved page
            "page_table": BufferSpec("tokens", (self.max_pages,), torch.int64, 0),  # page 0
            "seq_lens": BufferSpec("tokens", (), torch.int64, 1),  # its one key
        }

    def static_metadata(
        self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int]
    ) -> dict[str, torch.Tensor]:
        return self._metadata(rows, prefix_lens, extend_lens, self.max_pages)

    def bind_static(self, views: Mapping[str, torch.Tensor]) -> None:
        self._bind(views)

    def _bind(self, meta: Mapping[str, torch.Tensor]) -> None:
        self.out_cache_loc, self._page_table, self._seq_lens = meta["out_cache_loc"], meta["page_table"], meta["seq_lens"]

    def _metadata(
        self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int], pages: int | None
    ) -> dict[str, torch.Tensor]:
        """pages: page-table width (None: just enough for the step's longest request)."""
        device, ps = self.req_to_token.device, self.pool.page_size
        tokens = sum(extend_lens)
        token_rows, positions = paged_decode.token_layout(
            to_device(rows, torch.int64, device), to_device(prefix_lens, torch.int64, device),
            to_device(extend_lens, torch.int64, device), tokens,
        )
        # From the host lists: a Python int from the tensors would wait for the device.
        pages = pages or -(-max(p + n for p, n in zip(prefix_lens, extend_lens)) // ps)
        # A page's first slot is page * page_size; entries past a token's keys are not read.
        return {
            "out_cache_loc": self.req_to_token[token_rows, positions],
            "page_table": self.req_to_token[token_rows, : pages * ps : ps] // ps,
            "seq_lens": positions + 1,
        }

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.write(layer, self.out_cache_loc, k, v)
        step = PagedDecode(None, self._page_table, self._seq_lens)
        return paged_decode.attend(step, q, self.pool.k[layer], self.pool.v[layer], self.pool.page_size, chained=True)
