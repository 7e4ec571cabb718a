"""A step's index tensors on the device: token ids (placeholders resolved), positions,
and the flat index of each sampling request's last token.

Overlap scheduling (kernel/scheduling/overlap.py) submits step N+1 before step N's tokens reach the
host: a request that continues carries `placeholder(table_row)` as its input id, and
`NextTokens` — written by the sampler of every step, read by the next — turns it into
the token step N sampled for that row, on the device. The device thread launches steps
in order on one stream, so step N's tokens are in the tensor before step N+1 reads it,
though the device thread no longer waits for N to complete before it launches N+1.

NOTE: every host-to-device copy here goes through gpu/upload.py (pinned, non_blocking on
CUDA): a step's launch must never wait for the previous step's device work. A host
buffer refilled by the next step would race with a copy still queued on the stream, so
there is none: each copy gets its own block of torch's caching host allocator, which
reuses it only after the copy's stream event completed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpu.forward_batch import ForwardBatch
from gpu.upload import copy_to_device, to_device


class NextTokens:
    """Per request-table row, the token the latest step sampled for it (device tensor)."""

    def __init__(self, num_rows: int, device: torch.device) -> None:
        self.tokens = torch.zeros(num_rows, dtype=torch.int64, device=device)

    def record(self, table_rows: Sequence[int], token_ids: torch.Tensor) -> None:
        index = to_device(table_rows, torch.int64, token_ids.device)
        self.tokens.index_copy_(0, index, token_ids.to(torch.int64))

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids with each placeholder -1 - row replaced by row's latest token."""
        rows = (-1 - input_ids).clamp_(min=0)
        return torch.where(input_ids < 0, self.tokens[rows], input_ids)


class StepInputs:
    """Builds a batch's flat index tensors on `device` (the model runner and the graph
    runner share one, so placeholders resolve the same way eagerly and in a bucket)."""

    def __init__(self, device: torch.device, next_tokens: NextTokens | None = None) -> None:
        self.device = device
        self.next_tokens = next_tokens  # overlap scheduling only

    def build(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        input_ids, positions, last = (copy_to_device(t, self.device) for t in host_inputs(batch))
        return self.resolve(input_ids, batch), positions, last

    def resolve(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The batch's input ids on the device with its placeholders (if any) resolved."""
        if not batch.placeholders:
            return input_ids
        if self.next_tokens is None:
            raise ValueError("a batch with placeholder ids, but overlap scheduling is off")
        return self.next_tokens.resolve(input_ids)


def host_inputs(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids and positions of the flattened tokens, and the flat index of each
    sampling request's last token, as CPU tensors."""
    input_ids = torch.tensor(batch.input_ids, dtype=torch.int64)
    if len(batch.input_ids) == len(batch.extend_lens):
        # NOTE: every chunk holds >= 1 token (ForwardBatch.build), so this is a decode-only
        # batch: one token per request, at its prefix length, each the row it samples at
        # (sample_back is () there). Three small tensors instead of ~12 ops a step.
        positions = torch.tensor(batch.prefix_lens, dtype=torch.int64)
        return input_ids, positions, torch.tensor(batch.sample_rows, dtype=torch.int64)
    prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64)
    extend = torch.tensor(batch.extend_lens, dtype=torch.int64)
    starts = torch.cumsum(extend, 0) - extend  # first flat index of each request
    tokens = len(batch.input_ids)  # known on the host: no size to read from `extend`
    offsets = torch.arange(tokens) - torch.repeat_interleave(starts, extend, output_size=tokens)
    positions = torch.repeat_interleave(prefix, extend, output_size=tokens) + offsets
    last = (starts + extend - 1)[torch.tensor(batch.sample_rows, dtype=torch.int64)]
    if batch.sample_back:
        last -= torch.tensor(batch.sample_back, dtype=torch.int64)
    return input_ids, positions, last


def flat_inputs(batch: ForwardBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids and positions of the flattened tokens, and the flat index of each
    sampling request's last token (no placeholders: see StepInputs)."""
    input_ids, positions, last = host_inputs(batch)
    return copy_to_device(input_ids, device), copy_to_device(positions, device), copy_to_device(last, device)
