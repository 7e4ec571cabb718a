"""Triton kernels of the `triton` attention backend, and the hybrid models' state-slot gather/scatter.

Imported only by gpu/attention/triton_backend.py when that backend is built (never by the
registry scan): this module imports triton at module level. Every `@triton.jit` kernel is
decorated when the module is first imported, so the Triton interpreter is used only if
TRITON_INTERPRET=1 was set before then; `INTERPRETED` records which it was.

Layout (cache/kv_pool.py): per layer K and V are [num_slots, Hkv, D], slot = page *
page_size + offset; keys are read token by token through req_to_token[row, pos], so any
page size works and stale table entries past a request's length are never read.

- `store_kv`: one program per new token copies its [Hkv * D] row of K and V to its slot.
- `decode_attention`: split-K over splits of a FIXED number of keys (`split`), anchored at
  position 0 of the request: stage 1 gives each (request, KV head, split) its query
  heads' partial output and log-sum-exp, stage 2 merges a request's splits in order. An
  entry with key count 0 (a static step's unused one) is skipped by both stages.
  A request's splits, and the order they are merged in, depend only on its own length,
  so its output is the same bits alone or in any batch (batch-invariant).
- `extend_attention`: one program per (request, query head, block of new tokens; blocks
  past a request's new tokens, and entries with none, exit at once) runs an online softmax
  over keys [0, last position of the block], prefix and new tokens alike read through
  the table (the new K/V are stored first), with the causal mask.
- `gather_state_slots` / `scatter_state_slots`: per request row, a state slot read into
  (or written from) a dense [R, ...] batch, fresh rows read as zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

INTERPRETED: bool = bool(knobs.runtime.interpret)

_NEG = tl.constexpr(-1.0e30)  # finite start of a running max: exp(_NEG - m) is exactly 0, never NaN
_PRECISION = tl.constexpr("ieee")  # no TF32 on fp32 inputs: results comparable to the torch backend
_STATE_BLOCK = 1024


def _pow2(n: int, least: int = 16) -> int:
    """Block extent for n elements; tl.dot needs every extent >= 16 on a real GPU."""
    return max(least, triton.next_power_of_2(n))


@triton.jit
def _attend_keys(
    qb, k_cache, v_cache, slots, kvh, stride_kt, stride_kh, offs_d, d_mask, n_mask, visible, sm_scale, m, l, acc,
):
    """One block of keys (at `slots`) into a running softmax: the rows of `qb` see the
    keys where `visible`; returns the updated (max, sum, weighted values)."""
    kb = tl.load(
        k_cache + slots[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None],
        mask=d_mask[:, None] & n_mask[None, :],
        other=0.0,
    )
    s = tl.dot(qb, kb, input_precision=_PRECISION) * sm_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m - m_new)
    vb = tl.load(
        v_cache + slots[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
        mask=n_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=_PRECISION)
    return m_new, l, acc


@triton.jit
def _store_kv_kernel(
    k_new, v_new, k_cache, v_cache, locs, num_slots, stride_new, ROW: tl.constexpr, BLOCK: tl.constexpr
):
    t = tl.program_id(0)
    slot = tl.load(locs + t)
    offs = tl.arange(0, BLOCK)
    # NOTE: a slot outside [0, num_slots) is never written (memory safety; the table's
    # entries always lie inside the pool, padding rows point at the reserved page 0).
    # (The scalar is broadcast first: the interpreter rejects block & scalar masks.)
    slot_b = slot + tl.zeros([BLOCK], slot.dtype)
    mask = (offs < ROW) & (slot_b >= 0) & (slot_b < num_slots)
    k = tl.load(k_new + t * stride_new + offs, mask=mask)
    v = tl.load(v_new + t * stride_new + offs, mask=mask)
    tl.store(k_cache + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache + slot * ROW + offs, v, mask=mask)


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write k/v [T, Hkv, D] at slots `locs` [T] of the pool tensors [num_slots, Hkv, D]."""
    num = locs.numel()
    if num == 0:
        return
    k, v = k.contiguous(), v.contiguous()
    row = k_cache.shape[1] * k_cache.shape[2]
    _store_kv_kernel[(num,)](
        k,
        v,
        k_cache,
        v_cache,
        locs,
        k_cache.shape[0],
        k.stride(0),
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
    )


@triton.jit
def _decode_split_kernel(
    q, k_cache, v_cache, table, rows, seq_lens, toks, part_o, part_lse,
    sm_scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_table, max_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    start = split * SPLIT
    if start < seq_len:
        row = tl.load(rows + b)
        tok = tl.load(toks + b)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        h_mask = offs_h < GROUP
        d_mask = offs_d < HEAD_DIM
        heads = kvh * GROUP + offs_h
        qb = tl.load(
            q + tok * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
            mask=h_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        m = tl.full([BLOCK_H], _NEG, tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        end = tl.minimum(start + SPLIT, seq_len)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            slots = tl.load(table + row * stride_table + offs_n, mask=n_mask, other=0)
            m, l, acc = _attend_keys(
                qb, k_cache, v_cache, slots, kvh, stride_kt, stride_kh, offs_d, d_mask, n_mask,
                n_mask[None, :], sm_scale, m, l, acc,
            )
        # part_o [B, H, max_splits, D], part_lse [B, H, max_splits]
        head_row = b * (GROUP * tl.num_programs(1)) + heads
        o_ptr = part_o + ((head_row[:, None] * max_splits + split) * HEAD_DIM + offs_d[None, :])
        tl.store(o_ptr, acc / l[:, None], mask=h_mask[:, None] & d_mask[None, :])
        lse_ptr = part_lse + head_row * max_splits + split
        tl.store(lse_ptr, m + tl.log(l), mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    out, part_o, part_lse, seq_lens, toks, stride_ot, stride_oh, max_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    seq_len = tl.load(seq_lens + b)
    if seq_len > 0:  # 0: a static step's unused entry, no splits to merge
        tok = tl.load(toks + b)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        base = (b * num_heads + h) * max_splits
        # Splits merged in order from the first: the same operations for a request whatever
        # the batch (NOTE: invariant 7's "fixed reduction order", here for decode).
        m = tl.load(part_lse + base)
        acc = tl.load(part_o + base * HEAD_DIM + offs_d, mask=d_mask, other=0.0)
        l = tl.exp(m - m)
        num_splits = tl.cdiv(seq_len, SPLIT)
        for s in range(1, num_splits):
            lse = tl.load(part_lse + base + s)
            o = tl.load(part_o + (base + s) * HEAD_DIM + offs_d, mask=d_mask, other=0.0)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp(m - m_new)
            w = tl.exp(lse - m_new)
            acc = acc * alpha + w * o
            l = l * alpha + w
            m = m_new
        tl.store(out + tok * stride_ot + h * stride_oh + offs_d, (acc / l).to(out.dtype.element_ty), mask=d_mask)


def decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    toks: torch.Tensor,
    max_len: int,
    split: int,
    block_n: int,
) -> None:
    """out[toks[b]] = attention of q[toks[b]] [H, D] over keys [0, seq_lens[b]) of table row rows[b]."""
    batch = rows.numel()
    if batch == 0:
        return
    _, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    max_splits = triton.cdiv(max_len, split)
    part_o = torch.empty((batch, num_heads, max_splits, head_dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((batch, num_heads, max_splits), dtype=torch.float32, device=q.device)
    block_d = _pow2(head_dim)
    _decode_split_kernel[(batch, num_kv, max_splits)](
        q, k_cache, v_cache, table, rows, seq_lens, toks, part_o, part_lse,
        head_dim**-0.5, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), table.stride(0),
        max_splits, GROUP=group, HEAD_DIM=head_dim, BLOCK_H=_pow2(group), BLOCK_D=block_d,
        BLOCK_N=block_n, SPLIT=split,
    )  # fmt: skip
    _decode_merge_kernel[(batch, num_heads)](
        out, part_o, part_lse, seq_lens, toks, out.stride(0), out.stride(1), max_splits,
        HEAD_DIM=head_dim, BLOCK_D=block_d, SPLIT=split,
    )  # fmt: skip


@triton.jit
def _extend_kernel(
    out, q, k_cache, v_cache, table, rows, prefix_lens, extend_lens, tok_starts,
    sm_scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    ext_len = tl.load(extend_lens + e)
    if mb * BLOCK_M < ext_len:
        row = tl.load(rows + e)
        prefix = tl.load(prefix_lens + e)
        tok0 = tl.load(tok_starts + e)
        kvh = h // GROUP
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < ext_len
        d_mask = offs_d < HEAD_DIM
        qb = tl.load(
            q + (tok0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        q_pos = prefix + offs_m
        m = tl.full([BLOCK_M], _NEG, tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        end = prefix + tl.minimum((mb + 1) * BLOCK_M, ext_len)  # keys [0, end): the block's last position
        for n0 in range(0, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            slots = tl.load(table + row * stride_table + offs_n, mask=n_mask, other=0)
            visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])  # causal
            m, l, acc = _attend_keys(
                qb, k_cache, v_cache, slots, kvh, stride_kt, stride_kh, offs_d, d_mask, n_mask,
                visible, sm_scale, m, l, acc,
            )
        o = acc / l[:, None]  # every row sees key 0, so l > 0 (rows past ext_len are not stored)
        tl.store(
            out + (tok0 + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
            o.to(out.dtype.element_ty),
            mask=m_mask[:, None] & d_mask[None, :],
        )


def extend_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    tok_starts: torch.Tensor,
    max_extend: int,
    block_m: int,
    block_n: int,
) -> None:
    """out[tok_starts[e] + i] = causal attention of new token i of request e over its
    cached prefix and its new tokens up to i (all read from the pool through `table`)."""
    reqs = rows.numel()
    if reqs == 0:
        return
    _, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    _extend_kernel[(reqs, num_heads, triton.cdiv(max_extend, block_m))](
        out, q, k_cache, v_cache, table, rows, prefix_lens, extend_lens, tok_starts,
        head_dim**-0.5, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_D=_pow2(head_dim), BLOCK_N=block_n,
    )  # fmt: skip


@triton.jit
def _gather_state_kernel(pool, out, slots, fresh, per_slot, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < per_slot
    slot = tl.load(slots + r)
    fresh_b = tl.load(fresh + r) + tl.zeros([BLOCK], tl.int8)
    x = tl.load(pool + slot * per_slot + offs, mask=mask & (fresh_b == 0), other=0.0)
    tl.store(out + r * per_slot + offs, x, mask=mask)


@triton.jit
def _scatter_state_kernel(pool, states, slots, per_slot, num_slots, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots + r)
    slot_b = slot + tl.zeros([BLOCK], slot.dtype)
    mask = (offs < per_slot) & (slot_b >= 0) & (slot_b < num_slots)
    x = tl.load(states + r * per_slot + offs, mask=mask)
    tl.store(pool + slot * per_slot + offs, x.to(pool.dtype.element_ty), mask=mask)


def gather_state_slots(pool_tensor: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """[R, ...] = pool_tensor[slots], zeros where `fresh` (what HybridStep.load computes)."""
    reqs = slots.numel()
    out = pool_tensor.new_empty((reqs, *pool_tensor.shape[1:]))
    per_slot = out[0].numel() if reqs else 0
    if reqs and per_slot:
        grid = (reqs, triton.cdiv(per_slot, _STATE_BLOCK))
        _gather_state_kernel[grid](
            pool_tensor, out, slots, fresh.to(torch.int8), per_slot, BLOCK=_STATE_BLOCK
        )
    return out


def scatter_state_slots(pool_tensor: torch.Tensor, slots: torch.Tensor, states: torch.Tensor) -> None:
    """pool_tensor[slots] = states (cast to the pool's dtype); what HybridStep.store does."""
    reqs = slots.numel()
    per_slot = pool_tensor[0].numel()
    if reqs and per_slot:
        grid = (reqs, triton.cdiv(per_slot, _STATE_BLOCK))
        _scatter_state_kernel[grid](
            pool_tensor, states.contiguous(), slots, per_slot, pool_tensor.shape[0], BLOCK=_STATE_BLOCK
        )
