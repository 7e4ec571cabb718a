"""Attention with torch SDPA for CPU (and as a reference on any device).

Decodes are batched into one padded SDPA call per length group, or, with the C++ CPU
kernels (`cpu_kernels`), all go through one call of the paged decode kernel
(gpu/attention/paged_decode.py). Prefill chunks run one SDPA call each (there are few per
step, and padding a 512-token chunk against 1-token decodes would waste far more than
the loop costs), or, with the C++ kernels where they are faster than SDPA
(`paged_decode.chained_extends`), all go through one call of the chained kernel, each of
their tokens a row with its keys up to its own position, read from the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, pairwise
from typing import NamedTuple

import torch
import torch.nn.functional as F

from cache.kv_pool import KVPool
from gpu.attention import paged_decode
from gpu.attention.base import AttentionBackend
from gpu.attention.paged_decode import PagedDecode
from gpu.upload import to_device
from kernel.registry import register


class _DecodeGroup(NamedTuple):
    tok: torch.Tensor | None  # flat token index of each decode request; None: all tokens, in order
    page_idx: torch.Tensor  # [b, pages] page ids, padded with the zero page
    mask: torch.Tensor  # [b, 1, 1, pages * page_size] additive: 0 inside each request's length, else -inf


# Decodes are grouped by length so that padding to a group's longest request wastes at
# most ~1/4 of the keys read; one SDPA call per group.
_GROUP_FILL = 0.75


class _Extend(NamedTuple):
    tok_start: int
    num: int
    prefix: int
    kv_idx: torch.Tensor | None  # slots of [0, prefix + num) when prefix > 0
    mask: torch.Tensor | None  # [num, prefix + num] additive (0 / -inf) when prefix > 0


@register("attention", "torch")
class TorchAttention(AttentionBackend):
    persistent = ("req_to_token", "_gather_k", "_gather_v")  # scratch, not per-step metadata

    def __init__(self, pool: KVPool, req_to_token: torch.Tensor, cpu_kernels: bool = False) -> None:
        super().__init__(pool, req_to_token, cpu_kernels)
        self.out_cache_loc = torch.empty(0, dtype=torch.int64)
        self._decodes: list[_DecodeGroup] = []
        self._extends: list[_Extend] = []
        # Decodes through the C++ kernel when it is allowed, built, and computes the pool's dtype.
        self._use_kernel = paged_decode.kernel_ready(cpu_kernels, pool)
        self._chained_extends = self._use_kernel and paged_decode.chained_extends(pool)
        self._paged: PagedDecode | None = None
        self._chained: PagedDecode | None = None  # the step's prefill-chunk tokens, with _chained_extends
        self._gather_k = torch.empty(0, dtype=pool.k[0].dtype if pool.k else torch.float32)
        self._gather_v = torch.empty_like(self._gather_k)

    def prepare(self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> None:
        # NOTE: a few tensor ops per step whatever the batch size: no per-request tensor
        # work here (a step of 64 decodes would otherwise pay ~64 slices and a concat).
        device = self.req_to_token.device
        rows_t = to_device(rows, torch.int64, device)
        prefix_t = to_device(prefix_lens, torch.int64, device)
        if self._use_kernel and extend_lens and len(extend_lens) == sum(extend_lens):  # decodes only (chunks hold >= 1)
            self.prepare_decodes(rows_t, prefix_t)
            return
        extend_t = to_device(extend_lens, torch.int64, device)
        tokens = sum(extend_lens)
        token_rows, positions = paged_decode.token_layout(rows_t, prefix_t, extend_t, tokens)
        self.out_cache_loc = self._cache_locs(token_rows, positions)
        starts = list(accumulate(extend_lens, initial=0))
        dec = [i for i, num in enumerate(extend_lens) if num == 1]
        self._decodes, self._paged, self._chained = [], None, None
        if dec and self._use_kernel:
            ps = self.pool.page_size
            self._paged = paged_decode.build(self.req_to_token, ps, dec, starts, rows_t, prefix_t, prefix_lens)
        elif dec:
            self._decodes = self._group_decodes(dec, starts, rows_t, prefix_lens)
        chunks = [i for i, num in enumerate(extend_lens) if num > 1]
        if chunks and self._chained_extends:
            # From the host lists: the chunk tokens' flat indices (none where the step is its chunks).
            tok = None if not dec else to_device(
                [t for i in chunks for t in range(starts[i], starts[i] + extend_lens[i])], torch.int64, device)
            keys = max(prefix_lens[i] + extend_lens[i] for i in chunks)
            self._chained = paged_decode.build_extends(self.req_to_token, self.pool.page_size, token_rows, positions,
                                                       tok, keys)
            chunks = []
        self._extends = [self._extend(rows[i], starts[i], extend_lens[i], prefix_lens[i]) for i in chunks]

    def prepare_decodes(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """`prepare` of a decode-only step over the C++ kernel (`uses_paged_kernel`), from
        its requests' table rows and new tokens' positions as tensors: one native call."""
        self.out_cache_loc, self._paged = paged_decode.decode_slots(
            self.req_to_token, rows, positions, self.pool.page_size
        )
        self._decodes, self._extends, self._chained = [], [], None

    @property
    def uses_paged_kernel(self) -> bool:
        """Decodes run the C++ paged decode kernel (gpu/attention/paged_decode.py)."""
        return self._use_kernel

    def paged_decodes(self) -> tuple[torch.Tensor, PagedDecode] | None:
        """After `prepare`: the KV slot of every new token and the paged kernel's metadata,
        where the step is decodes only, in order, over the C++ kernel (else None)."""
        if self._paged is None or self._paged.tok is not None or self._extends or self._chained is not None:
            return None
        return self.out_cache_loc, self._paged

    def _cache_locs(self, token_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """KV slot of every new token: its request's table row at its position."""
        return self.req_to_token[token_rows, positions]

    def _extend(self, row: int, tok_start: int, num: int, prefix: int) -> _Extend:
        if prefix == 0:
            return _Extend(tok_start, num, 0, None, None)
        device = self.req_to_token.device
        total = prefix + num
        q_pos = torch.arange(prefix, total, device=device)[:, None]
        visible = torch.arange(total, device=device)[None, :] <= q_pos
        return _Extend(tok_start, num, prefix, self.req_to_token[row, :total], self._additive(visible))

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        """A boolean mask as SDPA's additive float mask, made once per step: SDPA would
        otherwise convert a boolean mask in every layer's call."""
        mask = torch.zeros(visible.shape, dtype=self.pool.compute_dtype, device=visible.device)
        return mask.masked_fill_(~visible, float("-inf"))

    def _group_decodes(
        self, dec: list[int], starts: list[int], rows: torch.Tensor, prefix_lens: Sequence[int]
    ) -> list[_DecodeGroup]:
        """Decode requests sorted by length, cut into groups; the metadata of all groups
        is built at once and each group takes its slice of it.

        Decode reads whole pages (page_size * kv_heads * head_dim contiguous values), which
        copies several times faster than gathering token rows one by one.
        """
        device = self.req_to_token.device
        ps = self.pool.page_size
        order = sorted(dec, key=lambda i: -prefix_lens[i])
        keys = [prefix_lens[i] + 1 for i in order]  # keys per decode, its new token included
        bounds = [0]  # group g is order[bounds[g]:bounds[g + 1]]
        for k in range(1, len(order)):
            if keys[k] < _GROUP_FILL * keys[bounds[-1]]:
                bounds.append(k)
        bounds.append(len(order))
        keys_t = to_device(keys, torch.int64, device)
        num_pages = -(-keys[0] // ps)
        order_rows = rows.index_select(0, to_device(order, torch.int64, device))
        first_slots = self.req_to_token[order_rows, : num_pages * ps : ps]
        page_valid = torch.arange(num_pages, device=device)[None, :] * ps < keys_t[:, None]
        # Table entries past a request's length are stale: read the zero page there.
        page_idx = torch.where(page_valid, first_slots // ps, 0)
        mask = self._additive(torch.arange(num_pages * ps, device=device)[None, :] < keys_t[:, None])
        if len(bounds) == 2 and order == list(range(len(starts) - 1)):
            # One group holding every request of the step in batch order (batch-1 decode,
            # equal lengths): no gather of its queries, no scatter of its outputs.
            return [_DecodeGroup(None, page_idx, mask[:, None, None, :])]
        toks = to_device([starts[i] for i in order], torch.int64, device)
        groups = []
        for lo, hi in pairwise(bounds):
            pages = -(-keys[lo] // ps)
            group_mask = mask[lo:hi, None, None, : pages * ps]
            groups.append(_DecodeGroup(toks[lo:hi], page_idx[lo:hi, :pages].contiguous(), group_mask))
        return groups

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.write(layer, self.out_cache_loc, k, v)
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        paged, ps = self._paged, self.pool.page_size
        if paged is not None and paged.tok is None:  # the step is its decodes, in order
            return paged_decode.attend(paged, q, k_cache, v_cache, ps)
        if self._decodes and self._decodes[0].tok is None:  # the step is this one group
            return self._decode(self._decodes[0], q, k_cache, v_cache)
        chained = self._chained
        if chained is not None and chained.tok is None:  # the step is its prefill chunks
            return paged_decode.attend(chained, q, k_cache, v_cache, ps, chained=True)
        if self.pool.widened:
            # NOTE: a chunk attends to its own keys as the pool holds them (rounded), so a
            # later step or a cache hit reading them back from the pool sees the same values.
            k, v = k.to(k_cache.dtype).to(q.dtype), v.to(v_cache.dtype).to(q.dtype)
        out = torch.empty_like(q)
        if paged is not None and paged.tok is not None:
            out.index_copy_(0, paged.tok, paged_decode.attend(paged, q.index_select(0, paged.tok), k_cache, v_cache, ps))
        if chained is not None and chained.tok is not None:
            out.index_copy_(0, chained.tok,
                            paged_decode.attend(chained, q.index_select(0, chained.tok), k_cache, v_cache, ps, chained=True))
        for group in self._decodes:
            assert group.tok is not None
            out.index_copy_(0, group.tok, self._decode(group, q, k_cache, v_cache))
        for ext in self._extends:
            sl = slice(ext.tok_start, ext.tok_start + ext.num)
            qe = q[sl].transpose(0, 1)[None]  # [1, H, n, D]
            if ext.kv_idx is None:
                ke, ve = k[sl].transpose(0, 1)[None], v[sl].transpose(0, 1)[None]
                oe = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, enable_gqa=True)
            else:
                ke = k_cache.index_select(0, ext.kv_idx).to(q.dtype).transpose(0, 1)[None]
                ve = v_cache.index_select(0, ext.kv_idx).to(q.dtype).transpose(0, 1)[None]
                oe = F.scaled_dot_product_attention(qe, ke, ve, attn_mask=ext.mask, enable_gqa=True)
            out[sl] = oe[0].transpose(0, 1)
        return out

    def _gather_buffers(self, pages: int, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reused K and V buffers of `pages` whole pages for one decode group's gather.

        NOTE: a fresh multi-MB buffer per group and layer costs page faults and zeroing
        each time (the allocator hands big blocks back to the OS); one pair that grows to
        the largest group seen and is reused keeps the gather a plain copy. Groups run one
        after another, each done with the buffers before the next gathers.
        """
        width = self.pool.page_size * cache.shape[1] * cache.shape[2]
        if self._gather_k.shape[0] < pages or self._gather_k.dtype != cache.dtype:
            self._gather_k = torch.empty((pages, width), dtype=cache.dtype, device=cache.device)
            self._gather_v = torch.empty_like(self._gather_k)
        return self._gather_k[:pages], self._gather_v[:pages]

    def _decode(
        self, group: _DecodeGroup, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """One group of decode tokens in one SDPA call.

        The query heads sharing one KV head are laid out as that head's query rows (a
        decode token has no causal structure among its own heads), so SDPA runs without
        expanding K/V for grouped-query attention.
        """
        batch, num_pages = group.page_idx.shape
        _, num_heads, head_dim = q.shape
        num_kv = k_cache.shape[1]
        flat = group.page_idx.view(-1)
        by_page = (self.pool.num_pages, -1)
        shape = (batch, num_pages * self.pool.page_size, num_kv, head_dim)
        k_buf, v_buf = self._gather_buffers(flat.numel(), k_cache)
        kd = torch.index_select(k_cache.view(by_page), 0, flat, out=k_buf).view(shape).transpose(1, 2).to(q.dtype)
        vd = torch.index_select(v_cache.view(by_page), 0, flat, out=v_buf).view(shape).transpose(1, 2).to(q.dtype)
        qd = q if group.tok is None else q.index_select(0, group.tok)
        qd = qd.reshape(batch, num_kv, num_heads // num_kv, head_dim)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=group.mask)
        return od.reshape(batch, num_heads, head_dim)
