"""GGUF 4-bit blocks (Q4_0, Q4_1) read straight into the int4 op's format.

A block covers 32 consecutive weights of a row: an fp16 scale d (Q4_1: then an fp16 min m)
and 16 bytes of nibbles, where byte j holds weight j in its low nibble and weight j + 16
in its high nibble. Q4_0 means w = d * (q - 8), Q4_1 means w = d * q + m. The nibbles are
taken as they are (no float round trip), so the 4-bit linear computes with exactly the
checkpoint's levels; only d and m are rounded to the compute dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gpu.quant.linears import GROUP

# bytes per block before the 16 nibble bytes: d (and m) as float16
_HEADER = {"Q4_0": 2, "Q4_1": 4}


class Q4Blocks(NamedTuple):
    """One weight's raw GGUF blocks, rows in output order: data uint8 [N, blocks * bytes]."""

    kind: str  # "Q4_0" | "Q4_1"
    data: torch.Tensor

    @property
    def in_features(self) -> int:
        return self.data.shape[1] // (_HEADER[self.kind] + GROUP // 2) * GROUP


def block_bytes(kind: str) -> int:
    """Bytes of one 32-weight block of `kind` (its header, then 16 nibble bytes)."""
    return _HEADER[kind] + GROUP // 2


def is_q4(kind: str) -> bool:
    return kind in _HEADER


def unpack_q4(blocks: Q4Blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """nibbles int32 [N, K] in 0..15, scale and zero float32 [N, K / 32] in the int4 op's
    convention w = (q - 8) * scale + zero."""
    header = _HEADER[blocks.kind]
    n = blocks.data.shape[0]
    raw = blocks.data.reshape(n, -1, header + GROUP // 2)
    halves = raw[..., :header].contiguous().view(torch.float16).float()  # [N, blocks, 1 or 2]
    d = halves[..., 0]
    nibbles = split_nibbles(raw[..., header:]).reshape(n, -1)
    zero = halves[..., 1] + 8.0 * d if blocks.kind == "Q4_1" else torch.zeros_like(d)
    return nibbles, d, zero


def split_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] int32: the low nibbles are weights 0..15, the high 16..31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int32)


def cat_blocks(parts: list[Q4Blocks]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """unpack_q4 of several weights stacked along N (a fused qkv or gate_up)."""
    unpacked = [unpack_q4(p) for p in parts]
    return tuple(torch.cat([u[i] for u in unpacked]) for i in range(3))  # type: ignore[return-value]
