"""The host tier: KV pages (and hybrid state slots) in host memory, and the copies between
them and the device pools.

A host page holds what one device `KVPool` page holds: K and V of every layer for
`page_size` tokens. Its canonical order — used by `page_bytes`/`load_bytes` whatever the
layout, so storage objects do not depend on it — is C order over
`[2 (K then V), num_layers, page_size, num_kv_heads, head_dim]` in the pool dtype, native
byte order. Page 0 is reserved like on the device (ids can use 0 as "no page").

Copies go through a device staging tensor in the host layout: on CUDA the gather/scatter
runs on the device and each run of consecutive host pages is one non-blocking transfer
from/to pinned memory, enqueued on the caller's copy stream. On CPU the same code runs with
blocking copies, so the tests exercise the CUDA logic.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Literal, Self

import torch

from cache.allocator import FreeList, PooledIds
from cache.kv_pool import KVPool

Layout = Literal["layer_first", "page_first"]

# Staging bound per copy call: a long offload is cut into chunks so the device scratch
# never exceeds this (a page of a large model can be tens of MiB).
DEFAULT_STAGING_BYTES = 64 * 2**20


def pin_default(pin_memory: bool | None) -> bool:
    """Pinned (page-locked, for non-blocking transfers) when CUDA is there, unless told."""
    return torch.cuda.is_available() if pin_memory is None else pin_memory


def tensor_bytes(t: torch.Tensor) -> bytes:
    """`t`'s elements as bytes, C order, native byte order (any dtype, bfloat16 included).
    A device tensor (a `StatePool` slot on CUDA) is copied to host first, blocking: the
    writes it must see have to be complete, or queued on the current stream."""
    return t.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: bytes | bytearray | memoryview, expected: int, what: str) -> torch.Tensor:
    """A fresh uint8 tensor of `data`; raises ValueError unless it has `expected` bytes."""
    if len(data) != expected:
        raise ValueError(f"{what} needs {expected} bytes, got {len(data)}")
    # bytearray: frombuffer wants a writable buffer; this is the one copy of the input.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class HostPool(PooledIds):
    """Host KV pages. `data` is `[2, layers, pages, page_size, heads, head_dim]`
    (layer_first: per layer and K/V one contiguous block, the device order) or
    `[pages, 2, layers, page_size, heads, head_dim]` (page_first: one contiguous block per
    page in canonical order)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        layout: Layout = "layer_first",
        pin_memory: bool | None = None,
        data: torch.Tensor | None = None,
    ) -> None:
        """`data`: memory to hold the pages (shared memory another process maps, say), of
        the shape and dtype this pool would allocate; None allocates it."""
        if layout not in ("layer_first", "page_first"):
            raise ValueError(f"unknown host layout {layout!r}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.layout: Layout = layout
        self.pinned = pin_default(pin_memory)
        self._ids = FreeList(num_pages, "page")
        shape = self.shape_of(num_layers, num_pages, page_size, num_kv_heads, head_dim, layout)
        if data is not None:
            if tuple(data.shape) != shape or data.dtype != dtype:
                raise ValueError(f"host pool memory is {tuple(data.shape)} {data.dtype}, pages need {shape} {dtype}")
            self.data = data
            return
        # `empty`, not zeros: a host page is read only after an offload or load_bytes wrote
        # it, and zero-filling tens of GiB of pinned memory would stall start-up.
        self.data = torch.empty(shape, dtype=dtype, pin_memory=self.pinned)

    @staticmethod
    def shape_of(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 layout: Layout) -> tuple[int, ...]:
        """`data`'s shape for these pages (see the class docstring)."""
        tail = (page_size, num_kv_heads, head_dim)
        return (2, num_layers, num_pages, *tail) if layout == "layer_first" else (num_pages, 2, num_layers, *tail)

    @classmethod
    def like(
        cls, kv_pool: KVPool, num_pages: int, layout: Layout = "layer_first", pin_memory: bool | None = None,
        data: torch.Tensor | None = None,
    ) -> Self:
        """A host pool whose pages match `kv_pool`'s (layers, page size, heads, dtype)."""
        _, heads, head_dim = kv_pool.k[0].shape
        return cls(
            len(kv_pool.k), num_pages, kv_pool.page_size, heads, head_dim, kv_pool.k[0].dtype, layout, pin_memory,
            data,
        )

    @property
    def bytes_per_page(self) -> int:
        return self.own_page_bytes

    @property
    def own_page_bytes(self) -> int:
        """Bytes of one page of `data` (`bytes_per_page` too, but for a pool whose pages
        span more memory: kernel/parallel/host_shards.py)."""
        return KVPool.bytes_per_page(self.num_layers, self.page_size, self.num_kv_heads, self.head_dim, self.dtype)

    def allocate(self, n: int) -> list[int] | None:
        """`n` free host pages (stale contents), or None and nothing taken."""
        return self._ids.allocate(n)

    def free(self, pages: Sequence[int]) -> None:
        """Return pages to the free list; a page not allocated raises and nothing changes."""
        self._ids.free(pages)

    def block(self, kv: int, layer: int) -> torch.Tensor:
        """View `[pages, page_size, heads, head_dim]` of K (kv=0) or V (kv=1) of one layer."""
        return _block(self.data, self.layout, kv, layer)

    def page(self, page: int) -> torch.Tensor:
        """View `[2, layers, page_size, heads, head_dim]` of one page (canonical order)."""
        return self.data[:, :, page] if self.layout == "layer_first" else self.data[page]

    def page_bytes(self, page: int) -> bytes:
        """The page's bytes in canonical order (see the module docstring). Reads only."""
        self._check_page(page)
        return tensor_bytes(self.page(page))

    def load_bytes(self, page: int, data: bytes | bytearray | memoryview) -> None:
        """Overwrite one page from `page_bytes` output; raises on a length mismatch
        before writing anything."""
        self._check_page(page)
        raw = tensor_from_bytes(data, self.own_page_bytes, "a host page")
        self.page(page).copy_(raw.view(self.dtype).view(self.page(page).shape))

    def _check_page(self, page: int) -> None:
        if not 0 < page < self.num_pages:
            raise IndexError(f"host page {page} is reserved or out of range [1, {self.num_pages})")

    def staging(self, n: int, device: torch.device) -> torch.Tensor:
        """Scratch for `n` pages in this pool's layout, on `device`."""
        tail = (self.page_size, self.num_kv_heads, self.head_dim)
        if self.layout == "layer_first":
            shape: tuple[int, ...] = (2, self.num_layers, n, *tail)
        else:
            shape = (n, 2, self.num_layers, *tail)
        return torch.empty(shape, dtype=self.dtype, device=device)

    def pages_of(self, t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Pages [start, stop) of `data` or of a staging tensor (same layout)."""
        return t[:, :, start:stop] if self.layout == "layer_first" else t[start:stop]


def _block(t: torch.Tensor, layout: Layout, kv: int, layer: int) -> torch.Tensor:
    """K/V of one layer, `[pages, page_size, heads, dim]`, of `data` or a staging tensor."""
    return t[kv, layer] if layout == "layer_first" else t[:, kv, layer]


def runs(ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(i, j, first): ids[i:j] == range(first, first + j - i), maximal runs in order."""
    i = 0
    while i < len(ids):
        j = i + 1
        while j < len(ids) and ids[j] == ids[j - 1] + 1:
            j += 1
        yield i, j, ids[i]
        i = j


def check_ids(ids: Sequence[int], size: int, what: str) -> None:
    """Raise ValueError on a repeat or an id outside [1, size) (0 is reserved)."""
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what} {list(ids)} repeat: one copy would overwrite another")
    bad = [i for i in ids if not 0 < i < size]
    if bad:
        raise ValueError(f"{what} {bad} are reserved or out of range [1, {size})")


def _check_match(kv_pool: KVPool, host: HostPool, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
    if len(device_pages) != len(host_pages):
        raise ValueError(f"{len(device_pages)} device pages but {len(host_pages)} host pages")
    _, heads, head_dim = kv_pool.k[0].shape
    dev = (len(kv_pool.k), kv_pool.page_size, heads, head_dim, kv_pool.k[0].dtype)
    hst = (host.num_layers, host.page_size, host.num_kv_heads, host.head_dim, host.dtype)
    if dev != hst:
        raise ValueError(f"device pages (layers, page, heads, dim, dtype) {dev} != host pages {hst}")
    check_ids(device_pages, kv_pool.num_pages, "device pages")
    check_ids(host_pages, host.num_pages, "host pages")


def _paged(t: torch.Tensor, page_size: int) -> torch.Tensor:
    """A device layer tensor `[slots, heads, dim]` viewed as `[pages, page_size, heads, dim]`."""
    return t.view(-1, page_size, *t.shape[1:])


def stream_ctx(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
    """Make `stream` current (allocations and kernels go on it); nothing on CPU."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _chunks(n: int, bytes_per_item: int, staging_bytes: int) -> Iterator[tuple[int, int]]:
    step = max(1, staging_bytes // max(1, bytes_per_item))
    for start in range(0, n, step):
        yield start, min(n, start + step)


def offload(
    kv_pool: KVPool,
    device_pages: Sequence[int],
    host_pool: HostPool,
    host_pages: Sequence[int],
    stream: torch.cuda.Stream | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> int:
    """Copy whole device pages (all layers, K and V) to host pages, pairwise; returns bytes.

    Writes only `host_pages` of `host_pool`; reads `device_pages`. With a CUDA `stream`
    the work is enqueued on it and the host pages are valid only once the stream has
    finished; the caller makes the stream wait for the forward that wrote the pages and
    must not reuse those device pages before then.
    """
    _check_match(kv_pool, host_pool, device_pages, host_pages)
    device = kv_pool.k[0].device
    non_blocking = stream is not None
    with stream_ctx(stream):
        for a, b in _chunks(len(device_pages), host_pool.bytes_per_page, staging_bytes):
            idx = torch.tensor(device_pages[a:b], dtype=torch.long, device=device)
            stage = host_pool.staging(b - a, device)
            for kv, layers in enumerate((kv_pool.k, kv_pool.v)):
                for layer, t in enumerate(layers):
                    _block(stage, host_pool.layout, kv, layer).copy_(_paged(t, kv_pool.page_size).index_select(0, idx))
            # One transfer per run of consecutive host pages (allocation keeps runs long).
            for i, j, first in runs(host_pages[a:b]):
                dst = host_pool.pages_of(host_pool.data, first, first + j - i)
                dst.copy_(host_pool.pages_of(stage, i, j), non_blocking=non_blocking)
    return len(device_pages) * host_pool.bytes_per_page


def load_back(
    host_pool: HostPool,
    host_pages: Sequence[int],
    kv_pool: KVPool,
    device_pages: Sequence[int],
    stream: torch.cuda.Stream | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
) -> int:
    """Copy host pages back into device pages, pairwise, all layers; returns bytes.

    Writes only `device_pages` of `kv_pool`; reads `host_pages`. With a CUDA `stream`
    the work is enqueued on it: the forward that reads the pages must wait for the stream,
    and the host pages must stay allocated and unwritten until it has finished.
    """
    _check_match(kv_pool, host_pool, device_pages, host_pages)
    device = kv_pool.k[0].device
    non_blocking = stream is not None
    with stream_ctx(stream):
        for a, b in _chunks(len(device_pages), host_pool.bytes_per_page, staging_bytes):
            stage = host_pool.staging(b - a, device)
            for i, j, first in runs(host_pages[a:b]):
                src = host_pool.pages_of(host_pool.data, first, first + j - i)
                host_pool.pages_of(stage, i, j).copy_(src, non_blocking=non_blocking)
            idx = torch.tensor(device_pages[a:b], dtype=torch.long, device=device)
            for kv, layers in enumerate((kv_pool.k, kv_pool.v)):
                for layer, t in enumerate(layers):
                    _paged(t, kv_pool.page_size).index_copy_(0, idx, _block(stage, host_pool.layout, kv, layer))
    return len(device_pages) * host_pool.bytes_per_page


