"""A step's requests laid out over a KV pool the way the engine leaves them: each owns
shuffled pages (page 0 reserved), its table row's tail past its pages holds stale slots,
every slot holds finite values (stale keys that must not be read), and the new tokens'
q/k/v are random. Shared by the attention backends' tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from cache.kv_pool import KVPool

Case = Sequence[tuple[int, int]]  # (prefix_len, extend_len) per request


class Shape(NamedTuple):
    page_size: int
    heads: int
    kv_heads: int
    dim: int
    dtype: torch.dtype = torch.float32  # the compute dtype (q, new k/v, the output)
    kv_dtype: torch.dtype | None = None  # the pool's (None: dtype)


class Layout(NamedTuple):
    pool: KVPool
    table: torch.Tensor  # req_to_token
    rows: list[int]  # table row of each request
    q: torch.Tensor  # [T, H, D] the step's new tokens
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor


def lay_out(case: Case, shape: Shape, seed: int) -> Layout:
    gen = torch.Generator().manual_seed(seed)
    ps = shape.page_size
    num_pages = 4 + sum(-(-(p + e) // ps) for p, e in case)
    pool = KVPool(1, num_pages, ps, shape.kv_heads, shape.dim, shape.kv_dtype or shape.dtype, torch.device("cpu"),
                  shape.dtype)
    pool.k[0].normal_(generator=gen)
    pool.v[0].normal_(generator=gen)
    width = ps * (2 + max(-(-(p + e) // ps) for p, e in case))
    table = torch.zeros((len(case) + 2, width), dtype=torch.int64)
    free = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # page 0 reserved
    rows = []
    for i, (prefix, extend) in enumerate(case):
        row = i + 2  # row 1 left empty: rows need not be dense
        pages = [free.pop() for _ in range(-(-(prefix + extend) // ps))]
        slots = torch.tensor([p * ps + j for p in pages for j in range(ps)])
        table[row, : len(slots)] = slots
        table[row, len(slots) :] = torch.randint(1, num_pages * ps, (width - len(slots),), generator=gen)
        rows.append(row)
    tokens = sum(e for _, e in case)
    q = torch.randn(tokens, shape.heads, shape.dim, generator=gen).to(shape.dtype)
    k = torch.randn(tokens, shape.kv_heads, shape.dim, generator=gen).to(shape.dtype)
    v = torch.randn(tokens, shape.kv_heads, shape.dim, generator=gen).to(shape.dtype)
    return Layout(pool, table, rows, q, k, v)
