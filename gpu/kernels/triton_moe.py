"""Triton kernels of `moe: triton` (gpu/moe/triton_moe.py): a fused grouped GEMM over
(token, slot) pairs sorted by expert, each expert's group padded to whole blocks.

Imported only when that implementation is first called (never by the registry scan): this
module imports triton at module level, so TRITON_INTERPRET=1 must be set before it is
first imported for the kernels to run on CPU; `INTERPRETED` records which it was.

A step with T tokens routed to k of E experts each has P = T * k pairs; pair p is token
p // k's slot p % k. `align` lays the pairs out, on the device, in a fixed-size order:
sorted by expert (stable: token order within an expert), each expert's group padded to a
multiple of BLOCK_M with the marker P, so every block of BLOCK_M positions belongs to one
expert (`block_expert`; E for a block past every group). Then, one program per (block,
column tile):
- `_gate_up_kernel`: the block's token rows of x times its expert's fused gate_up weight
  [2I, H] (gate rows first, then up: gpu/models/hybrid_common.py `swiglu`), silu(gate) *
  up into the intermediate [padded, I] at the block's rows;
- `_down_kernel`: those rows times the expert's down weight [H, I], scattered to the
  pair's row of the per-pair output [P, H];
and `combine` adds each token's k pair rows times their routing weights, slot 0 first.

NOTE: static shapes. No host read of the routing: the order is built by torch ops whose
shapes depend only on (T, k, E) (`padded_size`), and the grids are sized from them, so a
graph can capture a step and replay it with other routing. A block whose expert is E
(unused) or a padding row (marker P) computes nothing and writes nothing.

NOTE: invariant 7 (batch invariance, deterministic mode). Everything that shapes the
arithmetic is a constant of the kernels: tile sizes, warps, one K loop in order, no split
K. A pair's row is one row of its block's tile, and a tile row's products never read
another row (padding rows load zeros), so a token's bits do not depend on which or how
many tokens share its expert's block, nor on its row within the block; its k terms are
summed in slot order whatever the batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton import knobs

INTERPRETED: bool = bool(knobs.runtime.interpret)

BLOCK_M = 16  # pairs per block (tl.dot needs >= 16 on a GPU); each expert's group is padded to it
BLOCK_N = 64
BLOCK_K = 32
NUM_WARPS = 4


class Alignment(NamedTuple):
    sorted_pairs: torch.Tensor  # int64 [padded]: the pair at each position, P (= T * k) for padding
    block_expert: torch.Tensor  # int64 [padded // BLOCK_M]: each block's expert, E for an unused block


def padded_size(tokens: int, top_k: int, num_experts: int, block: int = BLOCK_M) -> int:
    """Positions of the padded order: every pair, plus under one block of padding for each
    expert that can have a token (at most min(E, T * k) of them), in whole blocks."""
    pairs = tokens * top_k
    groups = min(num_experts, pairs)
    return -(-(pairs + groups * (block - 1)) // block) * block


def align(experts: torch.Tensor, num_experts: int, block: int = BLOCK_M) -> Alignment:
    """The padded, expert-sorted order of the pairs of `experts` (int64 [T, k]), built on
    the device: no host read, every shape from (T, k, E) alone."""
    flat = experts.reshape(-1)
    pairs, device = flat.numel(), flat.device
    # scatter_add_, not bincount: bincount reads the largest value on the host (CUDA).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    ends = torch.cumsum(padded, 0)  # where each expert's padded group ends
    first = torch.cumsum(counts, 0) - counts  # each expert's first index among the sorted pairs
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order kept
    expert_of = flat.index_select(0, order)
    rank = torch.arange(pairs, device=device) - first.index_select(0, expert_of)
    position = (ends - padded).index_select(0, expert_of) + rank
    size = padded_size(experts.shape[0], experts.shape[1], num_experts, block)
    sorted_pairs = torch.full((size,), pairs, dtype=torch.int64, device=device).scatter_(0, position, order)
    # A block belongs to the first expert whose group ends past the block's start.
    starts = torch.arange(0, size, block, dtype=torch.int64, device=device)
    return Alignment(sorted_pairs, torch.searchsorted(ends, starts, right=True))


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:  # float32 in: no TF32, as the torch implementation runs it
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _block_rows(sorted_pairs, pid_m, pairs, BM: tl.constexpr):
    """The block's positions, their pairs (0 for padding: an address in bounds) and which
    are real."""
    rows = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(sorted_pairs + rows)
    valid = pair < pairs
    pair = tl.where(valid, pair, 0).to(tl.int64)
    return rows.to(tl.int64), pair, valid


@triton.jit(do_not_specialize=["pairs"])
def _gate_up_kernel(
    x, w, sorted_pairs, block_expert, inter, pairs, num_experts, hidden, width,
    s_xt, s_xh, s_we, s_wo, s_wi, s_it, s_in,
    TOP_K: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert + pid_m)
    if expert >= num_experts:  # past every expert's group: nothing to compute
        return
    rows, pair, valid = _block_rows(sorted_pairs, pid_m, pairs, BM)
    token = pair // TOP_K
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    n_ok = rn < width
    x_ptr = x + token[:, None] * s_xt + rk[None, :] * s_xh
    w_ptr = w + expert.to(tl.int64) * s_we + rk[:, None] * s_wi + rn[None, :].to(tl.int64) * s_wo
    up_offset = width * s_wo  # the up rows follow the gate rows
    gate = tl.zeros((BM, BN), dtype=tl.float32)
    up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, hidden, BK):
        in_k = (k0 + rk) < hidden
        a = tl.load(x_ptr, mask=valid[:, None] & in_k[None, :], other=0.0)
        w_mask = in_k[:, None] & n_ok[None, :]
        gate = _dot(a, tl.load(w_ptr, mask=w_mask, other=0.0), gate, IEEE)
        up = _dot(a, tl.load(w_ptr + up_offset, mask=w_mask, other=0.0), up, IEEE)
        x_ptr += BK * s_xh
        w_ptr += BK * s_wi
    h = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up, in float32
    i_ptr = inter + rows[:, None] * s_it + rn[None, :] * s_in
    tl.store(i_ptr, h.to(inter.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["pairs"])
def _down_kernel(
    inter, w, sorted_pairs, block_expert, out, pairs, num_experts, hidden, width,
    s_it, s_in, s_we, s_wo, s_wi, s_ot, s_oh,
    IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert + pid_m)
    if expert >= num_experts:
        return
    rows, pair, valid = _block_rows(sorted_pairs, pid_m, pairs, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    n_ok = rn < hidden
    # Padding rows of the intermediate were never written: masked to zeros, not read.
    a_ptr = inter + rows[:, None] * s_it + rk[None, :] * s_in
    w_ptr = w + expert.to(tl.int64) * s_we + rk[:, None] * s_wi + rn[None, :].to(tl.int64) * s_wo
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, width, BK):
        in_k = (k0 + rk) < width
        a = tl.load(a_ptr, mask=valid[:, None] & in_k[None, :], other=0.0)
        acc = _dot(a, tl.load(w_ptr, mask=in_k[:, None] & n_ok[None, :], other=0.0), acc, IEEE)
        a_ptr += BK * s_in
        w_ptr += BK * s_wi
    o_ptr = out + pair[:, None] * s_ot + rn[None, :] * s_oh
    tl.store(o_ptr, acc.to(out.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def combine(pair_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[t] = sum over slots j of weights[t, j] * pair_out[t * k + j], in float32, slot 0
    first (a fixed order whatever the batch), cast to pair_out's dtype."""
    tokens, top_k = weights.shape
    per_slot = pair_out.view(tokens, top_k, -1).float()
    w = weights.float()
    out = per_slot[:, 0] * w[:, :1]
    for j in range(1, top_k):
        out = out + per_slot[:, j] * w[:, j : j + 1]
    return out.to(pair_out.dtype)


def fused_moe(
    x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The routed experts' SwiGLU MLPs of x [T, H], combined: `experts` / `weights` [T, k]
    (gpu/moe/routing.py), gate_up [E, 2I, H] and down [E, H, I] stacked per expert."""
    tokens, top_k = experts.shape
    num_experts, hidden, width = down.shape
    if gate_up.shape != (num_experts, 2 * width, hidden) or x.shape != (tokens, hidden):
        raise ValueError(f"fused_moe shapes: x {tuple(x.shape)}, experts {tuple(experts.shape)}, "
                         f"gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}")
    if not x.dtype == gate_up.dtype == down.dtype:
        raise ValueError(f"fused_moe dtypes: x {x.dtype}, gate_up {gate_up.dtype}, down {down.dtype}")
    if tokens == 0:
        return torch.zeros_like(x)
    plan = align(experts, num_experts)
    pairs = tokens * top_k
    inter = torch.empty((plan.sorted_pairs.shape[0], width), dtype=x.dtype, device=x.device)
    pair_out = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
    blocks = plan.block_expert.shape[0]
    consts = {"IEEE": x.dtype == torch.float32, "BM": BLOCK_M, "BN": BLOCK_N, "BK": BLOCK_K, "num_warps": NUM_WARPS}
    _gate_up_kernel[(blocks, triton.cdiv(width, BLOCK_N))](
        x, gate_up, plan.sorted_pairs, plan.block_expert, inter, pairs, num_experts, hidden, width,
        *x.stride(), *gate_up.stride(), *inter.stride(), TOP_K=top_k, **consts,
    )  # fmt: skip
    _down_kernel[(blocks, triton.cdiv(hidden, BLOCK_N))](
        inter, down, plan.sorted_pairs, plan.block_expert, pair_out, pairs, num_experts, hidden, width,
        *inter.stride(), *down.stride(), *pair_out.stride(), **consts,
    )  # fmt: skip
    return combine(pair_out, weights)
