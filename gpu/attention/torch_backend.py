"""Attention with torch SDPA for CPU (and as a reference on any device).

Decodes are batched into one padded SDPA call; prefill chunks run one SDPA call each
(there are few per step, and padding a 512-token chunk against 1-token decodes would
waste far more than the loop costs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from cache.kv_pool import KVPool
from gpu.attention.base import AttentionBackend
from kernel.registry import register


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
        self._dec_tok: torch.Tensor | None = None
        self._dec_kv_idx = torch.empty(0, dtype=torch.int64)
        self._dec_mask = torch.empty(0, dtype=torch.bool)
        self._extends: list[_Extend] = []

    def prepare(self, rows: list[int], prefix_lens: list[int], extend_lens: list[int]) -> None:
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
        if dec_tok:
            lens = torch.tensor(dec_lens, device=device)
            max_len = max(dec_lens)
            self._dec_tok = torch.tensor(dec_tok, device=device)
            key_pos = torch.arange(max_len, device=device)
            valid = key_pos[None, :] < lens[:, None]
            # Table entries past a request's length are stale: read the zero page there.
            idx = table[torch.tensor(dec_rows, device=device), :max_len]
            self._dec_kv_idx = torch.where(valid, idx, 0)
            self._dec_mask = valid[:, None, None, :]
        else:
            self._dec_tok = None

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.write(layer, self.out_cache_loc, k, v)
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        out = torch.empty_like(q)
        if self._dec_tok is not None:
            qd = q.index_select(0, self._dec_tok)[:, :, None, :]  # [B, H, 1, D]
            kd = k_cache[self._dec_kv_idx].transpose(1, 2)  # [B, Hkv, L, D]
            vd = v_cache[self._dec_kv_idx].transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self._dec_mask, enable_gqa=True)
            out.index_copy_(0, self._dec_tok, od[:, :, 0, :])
        for ext in self._extends:
            sl = slice(ext.tok_start, ext.tok_start + ext.num)
            qe = q[sl].transpose(0, 1)[None]  # [1, H, n, D]
            if ext.kv_idx is None:
                ke, ve = k[sl].transpose(0, 1)[None], v[sl].transpose(0, 1)[None]
                oe = F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, enable_gqa=True)
            else:
                ke = k_cache[ext.kv_idx].transpose(0, 1)[None]
                ve = v_cache[ext.kv_idx].transpose(0, 1)[None]
                oe = F.scaled_dot_product_attention(qe, ke, ve, attn_mask=ext.mask, enable_gqa=True)
            out[sl] = oe[0].transpose(0, 1)
        return out
