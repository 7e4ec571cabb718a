"""Structured outputs on the device side: the allowed-token bitmask of constrained rows.

A constrained sampling row carries a `TokenMasker` (kernel/structured/grammar.py's per-request
matcher). When a batch has one, the device thread fills an int32 bitmask [B, ceil(V/32)]
(bit t of a row: token t allowed) for the constrained rows and the sampler sets every
other token's logit to -inf on those rows, before penalties, sampling and logprobs, so
the reported logprobs are of the constrained distribution (like the logit_bias ones).
Unconstrained rows are not touched, and unconstrained batches pay nothing. The fill runs on the device thread after the forward is queued, so
on CUDA it overlaps the forward; the bitmask is built on the host (the matcher writes
host memory) and copied once, without blocking (gpu/upload.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from gpu.upload import copy_to_device, to_device


class TokenMasker(Protocol):
    """Writes the tokens a row may sample next into its row of an int32 bitmask."""

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None: ...


@dataclass(frozen=True)
class TokenMask:
    rows: list[int]  # indices of the constrained rows in the batch
    bitmask: torch.Tensor  # [B, ceil(V/32)] int32 on the logits' device; other rows all ones
    # `rows` on a CUDA device (int32): given a list there, xgrammar would make the tensor
    # itself with a copy from pageable memory, which may wait for the device.
    row_index: torch.Tensor | None = None


def mask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def build_token_mask(maskers: Sequence[TokenMasker | None], vocab_size: int,
                     device: torch.device) -> TokenMask | None:
    """The bitmask of the rows that have a masker; None when no row has one."""
    rows = [i for i, m in enumerate(maskers) if m is not None]
    if not rows:
        return None
    bitmask = torch.full((len(maskers), mask_width(vocab_size)), -1, dtype=torch.int32)
    for i in rows:
        masker = maskers[i]
        assert masker is not None
        bitmask[i] = 0  # nothing allowed past what the masker writes (ids beyond its vocabulary)
        masker.fill_mask(bitmask, i)
    row_index = to_device(rows, torch.int32, device) if device.type == "cuda" else None
    return TokenMask(rows, copy_to_device(bitmask, device), row_index)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask | None) -> torch.Tensor:
    """logits with every disallowed token of a constrained row at -inf (a new tensor when
    there is a mask: the input stays as it is). xgrammar's kernel does the work: C++ on
    CPU (2.5x a torch unpack + masked_fill here), Triton on CUDA."""
    if mask is None:
        return logits
    import xgrammar  # only once a batch is constrained: importing it takes ~0.5 s

    masked = logits.clone(memory_format=torch.contiguous_format)
    if mask.row_index is None:
        xgrammar.apply_token_bitmask_inplace(masked, mask.bitmask, vocab_size=logits.shape[1], indices=mask.rows)
    else:  # CUDA: the Triton kernel xgrammar picks there, which takes the rows as a tensor
        from xgrammar.kernels.apply_token_bitmask_inplace_triton import apply_token_bitmask_inplace_triton

        apply_token_bitmask_inplace_triton(masked, mask.bitmask, logits.shape[1], mask.row_index)
    return masked
