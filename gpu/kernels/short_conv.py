"""Causal depthwise conv1d over a step's flattened tokens, with a carried window per request.

Used by Qwen3.5's Gated DeltaNet (conv over q/k/v, SiLU after) and LFM2's gated short
conv. Output at position t is sum_j weight[:, j] * x[t - (K-1) + j]: the usual causal
conv with K-1 zeros before position 0. A request resumes from its *window*, the last K-1
inputs before its first new token ([channels, K-1], oldest first, zeros before position
0), and leaves the window after its last token for the next step. Prefill chunks and
one-token decodes of several requests go through the same code in one call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu.upload import to_device


def short_conv_varlen(
    x: torch.Tensor,
    windows: torch.Tensor,
    extend_lens: Sequence[int],
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C] (requests back to back, `extend_lens` tokens each), windows [R, C, K-1],
    weight [C, K], bias [C] -> (y [T, C] in x's dtype, new windows [R, C, K-1]).

    NOTE: invariant 7. Each output is the same K products summed in tap order (an explicit
    loop of elementwise ops, accumulated in float32), whatever the batch or the chunking:
    a token's conv output does not depend on whether its window came from a prefill, a
    decode step or a cache hit.
    """
    num_tokens, reqs = x.shape[0], windows.shape[0]
    if len(extend_lens) != reqs or sum(extend_lens) != num_tokens:
        raise ValueError(f"extend_lens {list(extend_lens)} do not match {num_tokens} tokens / {reqs} windows")
    if all(n == 1 for n in extend_lens):
        return _one_token_each(x, windows, weight, bias)
    y, new_windows, _ = _varlen(x, windows, to_device(list(extend_lens), torch.int64, x.device), weight, bias)
    return y, new_windows


def short_conv_static(
    x: torch.Tensor, windows: torch.Tensor, lens: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`short_conv_varlen` with the lengths as a device tensor (lens [R] int64, summing to
    T), plus the window after each token -> (y [T, C], new windows [R, C, K-1], windows
    [T, C, K-1]): the static-shape form of a graph runner's verify bucket (every shape from
    T, R and K; nothing read back). The same products in the same order as
    `short_conv_varlen`, the windows the same copies as `short_conv_windows_at`."""
    y, new_windows, after = _varlen(x, windows, lens, weight, bias, per_token=True)
    assert after is not None
    return y, new_windows, after


def _varlen(
    x: torch.Tensor, windows: torch.Tensor, lens: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    per_token: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`short_conv_varlen` for any lengths (lens [R] on x's device): one buffer of window
    rows and new tokens; also the window after each token where `per_token` (else None)."""
    num_tokens, channels = x.shape
    reqs, _, width = windows.shape
    device = x.device
    # One extended buffer: per request its window rows, then its new tokens.
    seg_len = lens + width
    seg_start = torch.cumsum(seg_len, 0) - seg_len
    req_of_tok = torch.repeat_interleave(torch.arange(reqs, device=device), lens, output_size=num_tokens)
    tok_start = torch.cumsum(lens, 0) - lens
    tok_row = (
        seg_start[req_of_tok] + width + (torch.arange(num_tokens, device=device) - tok_start[req_of_tok])
    )
    win_row = (seg_start[:, None] + torch.arange(width, device=device)[None, :]).reshape(-1)
    ext = x.new_empty((num_tokens + reqs * width, channels))
    ext[win_row] = windows.transpose(1, 2).reshape(-1, channels).to(x.dtype)
    ext[tok_row] = x
    w = weight.float()
    acc = torch.zeros((num_tokens, channels), dtype=torch.float32, device=device)
    for j in range(width + 1):
        acc = acc + ext[tok_row - width + j].float() * w[:, j]
    if bias is not None:
        acc = acc + bias.float()
    last_rows = (seg_start + seg_len - width)[:, None] + torch.arange(width, device=device)[None, :]
    new_windows = ext[last_rows.reshape(-1)].view(reqs, width, channels).transpose(1, 2)
    if not per_token:
        return acc.to(x.dtype), new_windows.to(windows.dtype), None
    after = tok_row[:, None] + torch.arange(1 - width, 1, device=device)[None, :]  # each token's window rows
    token_windows = ext[after.reshape(-1)].view(num_tokens, width, channels).transpose(1, 2)
    return acc.to(x.dtype), new_windows.to(windows.dtype), token_windows.to(windows.dtype)


def _one_token_each(
    x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`short_conv_varlen` when every request brings one token (a decode step): the same
    products summed in the same order, so the same bits, without index tensors built
    from the lengths.

    NOTE: a captured decode graph of a hybrid model runs this: it makes no tensor from
    host values and reads nothing back, so replaying it is replaying the step."""
    w = weight.float()
    width = windows.shape[2]
    taps = windows.to(x.dtype)
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(width):
        acc = acc + taps[:, :, j].float() * w[:, j]
    acc = acc + x.float() * w[:, width]
    if bias is not None:
        acc = acc + bias.float()
    new_windows = torch.cat([taps[:, :, 1:], x[:, :, None]], dim=2)
    return acc.to(x.dtype), new_windows.to(windows.dtype)


def short_conv_windows_at(
    x: torch.Tensor,
    windows: torch.Tensor,
    extend_lens: Sequence[int],
    points: Sequence[tuple[int, int]],
) -> torch.Tensor:
    """The windows a run stopping inside a chunk would leave: for each (request r, n) with
    0 < n <= extend_lens[r], the last K-1 inputs before r's n-th new token ends, i.e. the
    window after its first n tokens -> [M, C, K-1] in windows' dtype.

    Same inputs as `short_conv_varlen` (x [T, C], windows [R, C, K-1]). A window is raw
    inputs, no arithmetic: gathered from r's carried window and new tokens it is the very
    bits `short_conv_varlen` over only those n tokens leaves.
    """
    num_tokens, channels = x.shape
    reqs, _, width = windows.shape
    if len(extend_lens) != reqs or sum(extend_lens) != num_tokens:
        raise ValueError(f"extend_lens {list(extend_lens)} do not match {num_tokens} tokens / {reqs} windows")
    if any(not 0 < n <= extend_lens[r] for r, n in points):
        raise ValueError(f"points {list(points)} are not inside their chunks {list(extend_lens)}")
    if not points:
        return windows.new_empty((0, channels, width))
    # Per point, the width rows before its end in "window rows, then new tokens" order:
    # row j < width of that order is window column j, row width + i is the i-th new token.
    starts = [0]
    for n in extend_lens:
        starts.append(starts[-1] + n)
    device = x.device
    req = to_device([r for r, _ in points], torch.int64, device)
    order = to_device([n for _, n in points], torch.int64, device)[:, None]
    order = order + torch.arange(width, device=device)[None, :]  # [M, width], in [1, width + n)
    in_window = order < width
    tok = to_device([starts[r] for r, _ in points], torch.int64, device)[:, None]
    from_x = x[(tok + order - width).clamp(min=0)]  # [M, width, C]
    from_win = windows.transpose(1, 2)[req[:, None], order.clamp(max=width - 1)].to(x.dtype)
    picked = torch.where(in_window[..., None], from_win, from_x)
    return picked.transpose(1, 2).to(windows.dtype)
