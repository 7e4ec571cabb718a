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

Static shapes (captured graphs, gpu/graphs/): the same metadata, one buffer per field,
with room for every request slot of a bucket. A decode or extend entry past the live ones
has key / token count 0, so no kernel program reads or writes for it; the padding tokens'
rows of the output are zeros (the output starts zeroed) and their K/V go to slot 0. The
grids are sized from the bucket, not the step: decode splits for the whole request table,
extend blocks for all the bucket's tokens; the programs past a request's length exit at
once. The split size is fixed per backend (it depends on the table width only), so a
request's output in a replayed, padded step is the eager step's, bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from types import ModuleType

import torch

from cache.kv_pool import KVPool
from gpu.attention.base import AttentionBackend
from gpu.graphs.static_buffers import BufferSpec
from gpu.upload import to_device
from kernel.registry import MissingExtraError, optional_module, register

# NOTE: invariant 7 for decode: a request's keys are cut into splits of DECODE_SPLIT
# tokens on absolute positions, whatever the batch, so its decode output is the same
# bits alone or batched. A multiple of DECODE_BLOCK_N.
DECODE_SPLIT = 256
DECODE_BLOCK_N = 32
# At most this many splits per request (wider tables get longer splits): bounds the
# partial-output buffers of a static decode step, whose grid covers the whole table.
MAX_SPLITS = 64
EXTEND_BLOCK_M = 32
EXTEND_BLOCK_N = 32


def load_kernels(device: torch.device) -> ModuleType:
    """The kernel module, or a RuntimeError saying why this backend cannot run here."""
    try:
        optional_module("triton", "model.attention: triton")
    except MissingExtraError as exc:
        raise RuntimeError(f"{exc}; pick `model.attention: torch` to run without it") from exc
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


# Per-step metadata: out_cache_loc per token; per decode request its table row, key count
# and flat token; per extend request its row, cached prefix, new tokens and first token.
DECODE_FIELDS = ("dec_rows", "dec_lens", "dec_toks")
EXTEND_FIELDS = ("ext_rows", "ext_prefix", "ext_lens", "ext_starts")


def split_size(table_width: int) -> int:
    """Keys per decode split: DECODE_SPLIT, longer where the table would need more than
    MAX_SPLITS of them (a multiple of DECODE_BLOCK_N either way)."""
    per_split = -(-table_width // MAX_SPLITS)
    return max(DECODE_SPLIT, -(-per_split // DECODE_BLOCK_N) * DECODE_BLOCK_N)


@register("attention", "triton")
class TritonAttention(AttentionBackend):
    supports_static = True

    def __init__(self, pool: KVPool, req_to_token: torch.Tensor, cpu_kernels: bool = False) -> None:
        super().__init__(pool, req_to_token, cpu_kernels)
        device = pool.k[0].device if pool.k else req_to_token.device
        self.kernels = load_kernels(device)
        self.decode_split = split_size(req_to_token.shape[1])  # tests shrink it to exercise many splits
        self.decode_block_n = DECODE_BLOCK_N
        empty = torch.empty(0, dtype=torch.int64, device=device)
        self.meta: dict[str, torch.Tensor] = dict.fromkeys(("out_cache_loc", *DECODE_FIELDS, *EXTEND_FIELDS), empty)
        # Grid extents: the step's longest decode (keys) and extend (new tokens); for a
        # static step the bucket's bounds instead.
        self._dec_max = 0
        self._ext_max = 0

    def prepare(self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> None:
        self.meta = self._metadata(rows, prefix_lens, extend_lens)
        self._dec_max = max((p + 1 for p, n in zip(prefix_lens, extend_lens) if n == 1), default=0)
        self._ext_max = max((n for n in extend_lens if n > 1), default=0)

    def _metadata(
        self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int]
    ) -> dict[str, torch.Tensor]:
        if self.decode_split % self.decode_block_n:
            raise ValueError(f"decode_split {self.decode_split} is not a multiple of {self.decode_block_n}")
        device = self.req_to_token.device
        lists: dict[str, list[int]] = {name: [] for name in (*DECODE_FIELDS, *EXTEND_FIELDS)}
        tok_rows: list[int] = []
        tok_pos: list[int] = []
        tok = 0
        for row, prefix, num in zip(rows, prefix_lens, extend_lens):
            tok_rows += [row] * num
            tok_pos += range(prefix, prefix + num)
            if num == 1:
                for name, val in zip(DECODE_FIELDS, (row, prefix + 1, tok)):
                    lists[name].append(val)
            elif num > 1:
                for name, val in zip(EXTEND_FIELDS, (row, prefix, num, tok)):
                    lists[name].append(val)
            tok += num

        def as_tensor(values: list[int]) -> torch.Tensor:
            return to_device(values, torch.int64, device)  # no host wait on CUDA

        meta = {name: as_tensor(values) for name, values in lists.items()}
        meta["out_cache_loc"] = self.req_to_token[as_tensor(tok_rows), as_tensor(tok_pos)]
        return meta

    # ---- static shapes (see the module docstring) ----------------------------------
    def static_rows(self, tokens: int, requests: int) -> dict[str, int]:
        return {}

    def static_specs(self) -> dict[str, BufferSpec]:
        specs = {"out_cache_loc": BufferSpec("tokens", (), torch.int64, 0)}  # slot 0 of the reserved page
        # Row 0 (the reserved one), count 0: an entry no program reads or writes for.
        specs.update({name: BufferSpec("requests", (), torch.int64, 0) for name in (*DECODE_FIELDS, *EXTEND_FIELDS)})
        return specs

    def static_metadata(
        self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int]
    ) -> dict[str, torch.Tensor]:
        return self._metadata(rows, prefix_lens, extend_lens)

    def bind_static(self, views: Mapping[str, torch.Tensor]) -> None:
        self.meta = dict(views)
        self._dec_max = self.req_to_token.shape[1]  # splits for any request the table holds
        self._ext_max = views["out_cache_loc"].shape[0]  # query blocks for all the bucket's tokens

    def metadata_tensors(self) -> dict[str, torch.Tensor]:
        return {**super().metadata_tensors(), **{f"meta.{k}": v for k, v in self.meta.items()}}

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.pool.k[layer], self.pool.v[layer]
        kern, meta, table = self.kernels, self.meta, self.req_to_token
        kern.store_kv(k_cache, v_cache, meta["out_cache_loc"], k, v)
        q = q.contiguous()
        # Zeroed: a static step's padding tokens belong to no decode or extend entry.
        out = torch.zeros_like(q)
        kern.decode_attention(
            out, q, k_cache, v_cache, table, *(meta[n] for n in DECODE_FIELDS),
            self._dec_max, self.decode_split, self.decode_block_n,
        )  # fmt: skip
        kern.extend_attention(
            out, q, k_cache, v_cache, table, *(meta[n] for n in EXTEND_FIELDS),
            self._ext_max, EXTEND_BLOCK_M, EXTEND_BLOCK_N,
        )  # fmt: skip
        return out
