"""A step's index tensors on the device: token ids (placeholders resolved), positions,
and the flat index of each sampling request's last token.

Overlap scheduling (kernel/overlap.py) submits step N+1 before step N's tokens reach the
host: a request that continues carries `placeholder(table_row)` as its input id, and
`NextTokens` — written by the sampler of every step, read by the next — turns it into
the token step N sampled for that row, on the device. The device thread runs steps in
order, so step N's tokens are in the tensor before step N+1 reads it.

On CUDA the host side is built in pinned buffers (`PinnedStaging`) and copied with
non_blocking=True on the device thread's stream.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu.forward_batch import ForwardBatch


class NextTokens:
    """Per request-table row, the token the latest step sampled for it (device tensor)."""

    def __init__(self, num_rows: int, device: torch.device) -> None:
        self.tokens = torch.zeros(num_rows, dtype=torch.int64, device=device)

    def record(self, table_rows: Sequence[int], token_ids: torch.Tensor) -> None:
        index = torch.tensor(table_rows, dtype=torch.int64).to(token_ids.device, non_blocking=True)
        self.tokens.index_copy_(0, index, token_ids.to(torch.int64))

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids with each placeholder -1 - row replaced by row's latest token."""
        rows = (-1 - input_ids).clamp_(min=0)
        return torch.where(input_ids < 0, self.tokens[rows], input_ids)


class PinnedStaging:
    """CUDA: reused page-locked host rows for a step's index tensors (sized to the largest
    step), so their copies to the device are asynchronous on the device thread's stream.

    NOTE: a row is refilled only by the next step's `upload`; the device thread waits for
    its stream at the end of every job (gpu/device_thread.py), so the previous step's
    copies out of it are complete by then. Not exercised on CPU (nothing to pin)."""

    def __init__(self, max_len: int, device: torch.device, rows: int = 3, pin: bool = True) -> None:
        self.device = device
        # pin=False only for tests of the staging logic on a machine without CUDA.
        self.buffers = torch.empty((rows, max_len), dtype=torch.int64, pin_memory=pin)

    def upload(self, *host: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if any(t.numel() > self.buffers.shape[1] for t in host) or len(host) > self.buffers.shape[0]:
            return tuple(t.to(self.device) for t in host)  # larger than sized for: a plain copy
        out = []
        for row, tensor in zip(self.buffers, host):
            staged = row[: tensor.numel()]
            staged.copy_(tensor)
            out.append(staged.to(self.device, non_blocking=True))
        return tuple(out)


class StepInputs:
    """Builds a batch's flat index tensors on `device` (the model runner and the graph
    runner share one, so placeholders resolve the same way eagerly and in a bucket)."""

    def __init__(
        self, device: torch.device, next_tokens: NextTokens | None = None, staging: PinnedStaging | None = None
    ) -> None:
        self.device = device
        self.next_tokens = next_tokens  # overlap scheduling only
        self.staging = staging  # CUDA only

    def build(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        host = host_inputs(batch)
        if self.staging is not None:
            input_ids, positions, last = self.staging.upload(*host)
        else:
            input_ids, positions, last = (t.to(self.device) for t in host)
        if batch.placeholders:
            if self.next_tokens is None:
                raise ValueError("a batch with placeholder ids, but overlap scheduling is off")
            input_ids = self.next_tokens.resolve(input_ids)
        return input_ids, positions, last


def host_inputs(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids and positions of the flattened tokens, and the flat index of each
    sampling request's last token, as CPU tensors."""
    input_ids = torch.tensor(batch.input_ids, dtype=torch.int64)
    prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64)
    extend = torch.tensor(batch.extend_lens, dtype=torch.int64)
    starts = torch.cumsum(extend, 0) - extend  # first flat index of each request
    offsets = torch.arange(len(batch.input_ids)) - torch.repeat_interleave(starts, extend)
    positions = torch.repeat_interleave(prefix, extend) + offsets
    last = (starts + extend - 1)[torch.tensor(batch.sample_rows, dtype=torch.int64)]
    return input_ids, positions, last
