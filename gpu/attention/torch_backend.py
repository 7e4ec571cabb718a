"""Attention with torch SDPA for CPU (and as a reference on any device).

Decodes are batched into one padded SDPA call; prefill chunks run one SDPA call each
(there are few per step, and padding a 512-token chunk against 1-token decodes would
waste far more than the loop costs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from cache.kv_pool import KVPool
from gpu.attention.base import AttentionBackend
from kernel.registry import register


class _DecodeGroup(NamedTuple):
    tok: torch.Tensor  # flat token index of each decode request in the group
    page_idx: torch.Tensor  # [b, pages] page ids, padded with the zero page
    mask: torch.Tensor  # [b, 1, 1, pages * page_size] keys inside each request's length


# Decodes are grouped by length so that padding to a group's longest request wastes at
# most ~1/4 of the keys read; one SDPA call per group.
_GROUP_FILL = 0.75


class _Extend(NamedTuple):
    tok_start: int
    num: int
    prefix: int
    kv_idx: torch.Tensor | None  # slots of [0, prefix + num) when prefix > 0
    mask: torch.Tensor | None  # [num, prefix + num] bool when prefix > 0


@register("attention", "torch")
class TorchAttention(AttentionBackend):
    def __init__(self, pool: KVPool, req_to_token: torch.Tensor) -> None:
        super().__init__(pool, req_to_token)
        self.out_cache_loc = torch.empty(0, dtype=torch.int64)
        self._decodes: list[_DecodeGroup] = []
        self._extends: list[_Extend] = []

    def prepare(self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> None:
        device = self.req_to_token.device
        table = self.req_to_token
        locs, dec_tok, dec_rows, dec_lens = [], [], [], []
        self._extends = []
        tok = 0
        for row, prefix, num in zip(rows, prefix_lens, extend_lens):
            locs.append(table[row, prefix : prefix + num])
            if num == 1:
                dec_tok.append(tok)
                dec_rows.append(row)
                dec_lens.append(prefix + 1)
            elif prefix == 0:
                self._extends.append(_Extend(tok, num, 0, None, None))
            else:
                total = prefix + num
                q_pos = torch.arange(prefix, total, device=device)[:, None]
                mask = torch.arange(total, device=device)[None, :] <= q_pos
                self._extends.append(_Extend(tok, num, prefix, table[row, :total], mask))
            tok += num
        self.out_cache_loc = torch.cat(locs) if locs else torch.empty(0, dtype=torch.int64)
        self._decodes = self._group_decodes(dec_tok, dec_rows, dec_lens)

    def _group_decodes(self, toks: list[int], rows: list[int], lens: list[int]) -> list[_DecodeGroup]:
        order = sorted(range(len(toks)), key=lambda i: -lens[i])
        groups: list[list[int]] = []
        for i in order:
            if not groups or lens[i] < _GROUP_FILL * lens[groups[-1][0]]:
                groups.append([])
            groups[-1].append(i)
        return [
            self._decode_group([toks[i] for i in g], [rows[i] for i in g], [lens[i] for i in g]) for g in groups
        ]

    def _decode_group(self, toks: list[int], rows: list[int], lens: list[int]) -> _DecodeGroup:
        """Page ids of each decode request, padded to the group's longest with the zero page.

        Decode reads whole pages (page_size * kv_heads * head_dim contiguous values), which
        copies several times faster than gathering token rows one by one.
        """
        device = self.req_to_token.device
        ps = self.pool.page_size
        lens_t = torch.tensor(lens, device=device)
        num_pages = -(-max(lens) // ps)
        first_slots = self.req_to_token[torch.tensor(rows, device=device), : num_pages * ps : ps]
        page_valid = torch.arange(num_pages, device=device)[None, :] * ps < lens_t[:, None]
        # Table entries past a request's length are stale: read the zero page there.
        page_idx = torch.where(page_valid, first_slots // ps, 0)
        key_pos = torch.arange(num_pages * ps, device=device)
        mask = (key_pos[None, :] < lens_t[:, None])[:, None, None, :]
        return _DecodeGroup(torch.tensor(toks, device=device), page_idx, mask)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.write(layer, self.out_cache_loc, k, v)
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        out = torch.empty_like(q)
        for group in self._decodes:
            out.index_copy_(0, group.tok, self._decode(group, q, k_cache, v_cache))
        for ext in self._extends:
            sl = slice(ext.tok_start, ext.tok_start + ext.num)
            qe = q[sl].transpose(0, 1)[None]  # [1, H, n, D]
            if ext.kv_idx is None:
                ke, ve = k[sl].transpose(0, 1)[None], v[sl].transpose(0, 1)[None]
                oe = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, enable_gqa=True)
            else:
                ke = k_cache.index_select(0, ext.kv_idx).transpose(0, 1)[None]
                ve = v_cache.index_select(0, ext.kv_idx).transpose(0, 1)[None]
                oe = F.scaled_dot_product_attention(qe, ke, ve, attn_mask=ext.mask, enable_gqa=True)
            out[sl] = oe[0].transpose(0, 1)
        return out

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
        kd = k_cache.view(by_page).index_select(0, flat).view(shape).transpose(1, 2)
        vd = v_cache.view(by_page).index_select(0, flat).view(shape).transpose(1, 2)
        qd = q.index_select(0, group.tok).view(batch, num_kv, num_heads // num_kv, head_dim)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=group.mask)
        return od.reshape(batch, num_heads, head_dim)
