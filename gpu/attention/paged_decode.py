"""A step's decode tokens through the C++ paged decode attention kernel
(gpu/kernels/cpu/paged_attention.cpp): one call for all of them, reading each request's
K/V pages where they lie in the pool (no length groups, no gather buffers, no masks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from cache.kv_pool import KVPool
from gpu.kernels import cpu
from gpu.quant import gemv
from gpu.upload import to_device

KERNEL = "paged_attention"
# (storage, compute) dtypes the kernel runs; other pools take the torch path
DTYPES = {(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)}
MAX_HEAD_DIM = 512  # the kernel's limit (kMaxHeadDim)


class PagedDecode(NamedTuple):
    tok: torch.Tensor | None  # flat token index of each decode; None: every token, in order
    page_table: torch.Tensor  # [b, pages] page ids of each decode's keys; entries past its length are not read
    seq_lens: torch.Tensor  # [b] keys of each decode, its own new token included


def kernel_ready(cpu_kernels: bool, pool: KVPool) -> bool:
    """Whether decodes over this pool may use the kernel (built on first use)."""
    if not cpu_kernels or not pool.k:
        return False
    k = pool.k[0]
    kinds = (k.dtype, pool.compute_dtype)
    return k.device.type == "cpu" and kinds in DTYPES and k.shape[2] <= MAX_HEAD_DIM and cpu.load(KERNEL)


def chained_extends(pool: KVPool) -> bool:
    """Whether prefill chunks over this pool run the chained kernel (its tile form) rather
    than torch's SDPA, where the kernel runs at all (`kernel_ready`): everywhere except
    bfloat16 where torch's GEMMs run on AMX tiles. Measured, 30 layers of SmolLM2's shapes
    on a Zen 5 EPYC (2 threads): 2 chunks of 220 tokens 50.1 -> 19.8 ms (bf16), 49.3 -> 22.0
    (float32); 512 tokens after 1,500 cached 471 -> 274 ms. On an AMX Xeon SDPA-flash took
    0.6x the chained form's time at a 2,048-token context (gpu/attention/deterministic_paged.py)."""
    return not (pool.compute_dtype == torch.bfloat16 and gemv.bf16_gemms_on_amx())


def build(
    req_to_token: torch.Tensor,
    page_size: int,
    dec: list[int],
    starts: list[int],
    rows: torch.Tensor,
    prefix: torch.Tensor,
    prefix_lens: Sequence[int],
) -> PagedDecode:
    """The kernel's metadata for the decode requests `dec` (indices into the step's
    requests): a few tensor ops whatever their number.

    rows/prefix: every request's table row and cached length, as tensors; starts: each
    request's first flat token index.
    """
    keys = max(prefix_lens[i] for i in dec) + 1
    if len(dec) == len(prefix_lens):  # decodes only: one token per request, in order
        tok, dec_rows, seq_lens = None, rows, prefix + 1
    else:
        device = req_to_token.device
        idx = to_device(dec, torch.int64, device)
        tok = to_device([starts[i] for i in dec], torch.int64, device)
        dec_rows, seq_lens = rows.index_select(0, idx), prefix.index_select(0, idx) + 1
    pages = -(-keys // page_size)
    # A page's first slot is page * page_size; the table's later slots of a page follow it.
    page_table = req_to_token[dec_rows, : pages * page_size : page_size] // page_size
    return PagedDecode(tok, page_table, seq_lens)


def build_extends(
    req_to_token: torch.Tensor, page_size: int, token_rows: torch.Tensor, positions: torch.Tensor,
    tok: torch.Tensor | None, keys: int,
) -> PagedDecode:
    """The chained kernel's metadata for a step's prefill-chunk tokens (its requests of more
    than one new token), each token a row of its own: its request's pages and its key count
    (positions <= its own). token_rows / positions: every new token's (`token_layout`); tok:
    the chunk tokens' flat indices (None: the step is its chunks); keys: the most keys a
    chunk token has."""
    rows, pos = (token_rows, positions) if tok is None else (token_rows[tok], positions[tok])
    pages = -(-keys // page_size)
    return PagedDecode(tok, req_to_token[rows, : pages * page_size : page_size] // page_size, pos + 1)


def token_layout(
    rows: torch.Tensor, prefix: torch.Tensor, extend: torch.Tensor, tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of a step's `tokens` new tokens' table row and position, in flat token order,
    from its requests' rows, cached lengths and new-token counts (a few tensor ops)."""
    if tokens == rows.shape[0]:  # one token per request (decodes): at its cached length
        return rows, prefix
    starts = torch.cumsum(extend, 0) - extend
    offsets = torch.arange(tokens, device=rows.device) - torch.repeat_interleave(starts, extend, output_size=tokens)
    positions = torch.repeat_interleave(prefix, extend, output_size=tokens) + offsets
    return torch.repeat_interleave(rows, extend, output_size=tokens), positions


def decode_slots(
    req_to_token: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, PagedDecode]:
    """A decode-only step (one token per request, in order): each token's KV slot and the
    kernel's metadata, in one native call (paged_attention.cpp `paged_decode_slots`; the
    same values as `build` and `TorchAttention._cache_locs` compute with torch ops).

    rows/positions: each request's table row and its new token's position (its cached length).
    """
    out_loc, page_table, seq_lens = torch.ops.tierserve_cpu.paged_decode_slots(req_to_token, rows, positions, page_size)
    return out_loc, PagedDecode(None, page_table, seq_lens)


def attend(
    step: PagedDecode,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_size: int,
    chained: bool = False,
) -> torch.Tensor:
    """Attention output [b, H, D] of the step's decode queries q [b, H, D].

    chained: in deterministic mode's arithmetic (gpu/kernels/cpu/chained_attention.h), which
    computes a request's consecutive rows (a prefill chunk) as tiles with the bits each row
    gets alone; else the paged decode kernel's."""
    scale = q.shape[-1] ** -0.5  # SDPA's default, which the torch path uses
    op = torch.ops.tierserve_cpu.paged_attention_chained if chained else torch.ops.tierserve_cpu.paged_attention_decode
    return op(q, k_cache, v_cache, step.page_table, step.seq_lens, page_size, scale)
