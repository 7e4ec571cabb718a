"""Attention with Triton kernels (gpu/kernels/triton_attention.py): paged KV, split-K decode.

This module imports cleanly without triton and without CUDA (the registry imports every
module of gpu.attention on its first lookup); triton is imported when the backend is
built. On CUDA the kernels are compiled; without CUDA they run only under the Triton
interpreter (TRITON_INTERPRET=1 set before triton is first imported), which is how the
tests check them on CPU.

A step's requests are routed by their new-token count: one token goes to the split-K
decode kernels, more to the extend kernel, none (a padding request with nothing to
compute) to neither. Padding requests point at request-table row 0, whose entries are
all slot 0 (the reserved page): they write and read only there and their outputs are
finite and ignored.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType

import torch

from cache.kv_pool import KVPool
from gpu.attention.base import AttentionBackend
from kernel.registry import register

# NOTE: invariant 7 for decode: a request's keys are cut into splits of DECODE_SPLIT
# tokens on absolute positions, whatever the batch, so its decode output is the same
# bits alone or batched. A multiple of DECODE_BLOCK_N.
DECODE_SPLIT = 256
DECODE_BLOCK_N = 32
EXTEND_BLOCK_M = 32
EXTEND_BLOCK_N = 32


def load_kernels(device: torch.device) -> ModuleType:
    """The kernel module, or a RuntimeError saying why this backend cannot run here."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            "model.attention: triton needs the `triton` package (pip install triton); "
            "pick `model.attention: torch` to run without it"
        ) from exc
    interpret = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
    if device.type != "cuda" and not interpret:
        raise RuntimeError(
            f"model.attention: triton runs on CUDA devices (the KV pool is on {device}); "
            "pick `model.attention: torch`, or set TRITON_INTERPRET=1 to run the kernels "
            "in the (slow) Triton interpreter"
        )
    from gpu.kernels import triton_attention

    if device.type != "cuda" and not triton_attention.INTERPRETED:
        raise RuntimeError(
            "the Triton kernels were compiled for the GPU (gpu.kernels.triton_attention was "
            "imported before TRITON_INTERPRET=1 was set) and cannot run on "
            f"{device}; set TRITON_INTERPRET=1 before triton is first imported"
        )
    return triton_attention


@register("attention", "triton")
class TritonAttention(AttentionBackend):
    def __init__(self, pool: KVPool, req_to_token: torch.Tensor, cpu_kernels: bool = False) -> None:
        super().__init__(pool, req_to_token, cpu_kernels)
        device = pool.k[0].device if pool.k else req_to_token.device
        self.kernels = load_kernels(device)
        self.decode_split = DECODE_SPLIT  # tests shrink it to exercise many splits
        self.decode_block_n = DECODE_BLOCK_N
        empty = torch.empty(0, dtype=torch.int64, device=device)
        self.out_cache_loc = empty
        self._dec = (empty, empty, empty)  # rows, key counts, flat token index
        self._dec_max = 0
        self._ext = (empty, empty, empty, empty)  # rows, prefix lens, extend lens, first token
        self._ext_max = 0

    def prepare(self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> None:
        if self.decode_split % self.decode_block_n:
            raise ValueError(f"decode_split {self.decode_split} is not a multiple of {self.decode_block_n}")
        device = self.req_to_token.device
        dec: tuple[list[int], list[int], list[int]] = ([], [], [])
        ext: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        tok_rows: list[int] = []
        tok_pos: list[int] = []
        tok = 0
        for row, prefix, num in zip(rows, prefix_lens, extend_lens):
            tok_rows += [row] * num
            tok_pos += range(prefix, prefix + num)
            if num == 1:
                for lst, val in zip(dec, (row, prefix + 1, tok)):
                    lst.append(val)
            elif num > 1:
                for lst, val in zip(ext, (row, prefix, num, tok)):
                    lst.append(val)
            tok += num

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        self.out_cache_loc = self.req_to_token[as_tensor(tok_rows), as_tensor(tok_pos)]
        self._dec = (as_tensor(dec[0]), as_tensor(dec[1]), as_tensor(dec[2]))
        self._dec_max = max(dec[1], default=0)
        self._ext = (as_tensor(ext[0]), as_tensor(ext[1]), as_tensor(ext[2]), as_tensor(ext[3]))
        self._ext_max = max(ext[2], default=0)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        kern = self.kernels
        kern.store_kv(k_cache, v_cache, self.out_cache_loc, k, v)
        q = q.contiguous()
        out = torch.empty_like(q)
        table = self.req_to_token
        dec_rows, dec_lens, dec_toks = self._dec
        kern.decode_attention(
            out, q, k_cache, v_cache, table, dec_rows, dec_lens, dec_toks,
            self._dec_max, self.decode_split, self.decode_block_n,
        )  # fmt: skip
        ext_rows, ext_prefix, ext_lens, ext_starts = self._ext
        kern.extend_attention(
            out, q, k_cache, v_cache, table, ext_rows, ext_prefix, ext_lens, ext_starts,
            self._ext_max, EXTEND_BLOCK_M, EXTEND_BLOCK_N,
        )  # fmt: skip
        return out
