"""Per-layer K/V storage over pages: slot = page * page_size + offset."""

from __future__ import annotations

import torch


class KVPool:
    """K and V tensors of shape [num_pages * page_size, num_kv_heads, head_dim] per layer.

    Slot 0..page_size-1 (page 0) is the reserved write target of padding rows.
    `dtype` is the storage's; `compute_dtype` (default: the same) the model's, in which K/V
    arrive and attention computes. A float32 model may store float16 (`cache.kv_dtype`):
    `write` rounds K/V to it (round to nearest even) and readers widen it back.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.page_size = page_size
        self.compute_dtype = dtype if compute_dtype is None else compute_dtype
        self.num_pages = num_pages
        num_slots = num_pages * page_size
        shape = (num_slots, num_kv_heads, head_dim)
        # NOTE: zero-filled, not `empty`: decode reads whole pages, and the masked tail of a
        # request's last page must hold finite values (0 * NaN would poison the output).
        # Page 0 is the read/write target of padding.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * itemsize

    @property
    def widened(self) -> bool:
        """Whether the storage is narrower than the compute dtype (readers convert)."""
        return bool(self.k) and self.k[0].dtype != self.compute_dtype

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        cache_k, cache_v = self.k[layer], self.v[layer]
        cache_k.index_copy_(0, slots, k.to(cache_k.dtype))
        cache_v.index_copy_(0, slots, v.to(cache_v.dtype))
