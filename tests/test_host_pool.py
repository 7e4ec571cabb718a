"""Host pages: allocator, byte serialization, and bit-exact copies to and from the device pool."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch

import cache.host_pool as host_pool_mod
from cache.host_pool import HostPool, Layout, load_back, offload
from cache.kv_pool import KVPool

LAYERS, PAGES, HEADS, DIM = 3, 10, 2, 4
CPU = torch.device("cpu")


def filled_pool(page_size: int, dtype: torch.dtype, seed: int = 0) -> KVPool:
    kv = KVPool(LAYERS, PAGES, page_size, HEADS, DIM, dtype, CPU)
    gen = torch.Generator().manual_seed(seed)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    return kv


def device_page(kv: KVPool, page: int) -> torch.Tensor:
    """The test's own reading of a device page, canonical order [2, layers, page, heads, dim]."""
    per = [torch.stack([t.view(PAGES, kv.page_size, HEADS, DIM)[page] for t in ts]) for ts in (kv.k, kv.v)]
    return torch.stack(per)


def round_trip_errors(
    kv: KVPool,
    host: HostPool,
    src: Sequence[int],
    hpages: Sequence[int],
    dst: Sequence[int],
    staging_bytes: int = host_pool_mod.DEFAULT_STAGING_BYTES,
) -> list[str]:
    """Offload `src` to `hpages`, load them into `dst`; every way the copy can be wrong.

    The host check reads `host.data` by plain indexing, independent of the copy code: a
    shift applied to both directions would still round-trip the data."""
    errors = []
    offload(kv, src, host, hpages, staging_bytes=staging_bytes)
    for d, h in zip(src, hpages, strict=True):
        if not torch.equal(host.page(h), device_page(kv, d)):
            errors.append(f"host page {h} != device page {d}")
    load_back(host, hpages, kv, dst, staging_bytes=staging_bytes)
    for s, d in zip(src, dst, strict=True):
        if not torch.equal(device_page(kv, d), device_page(kv, s)):
            errors.append(f"device page {d} != device page {s} after the round trip")
    return errors


def shifted_runs(ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """The planted bug: every run lands one host page too far."""
    for i, j, first in ORIGINAL_RUNS(ids):
        yield i, j, first + 1


ORIGINAL_RUNS = host_pool_mod.runs
LAYOUTS: tuple[Layout, ...] = ("layer_first", "page_first")
SRC, HOST, DST = [3, 1, 7, 2], [2, 3, 4, 6], [4, 6, 8, 9]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("staging_pages", [None, 2])
def test_round_trip_is_bit_exact(layout: Layout, dtype: torch.dtype, page_size: int, staging_pages: int | None) -> None:
    kv = filled_pool(page_size, dtype)
    host = HostPool.like(kv, 9, layout)
    host.data.fill_(-7.0)  # sentinel: pages not copied to must keep it
    dst = DST
    staging = host_pool_mod.DEFAULT_STAGING_BYTES if staging_pages is None else staging_pages * host.bytes_per_page
    before = {p: device_page(kv, p).clone() for p in range(1, PAGES) if p not in dst}
    hp = HOST
    assert round_trip_errors(kv, host, SRC, hp, dst, staging) == []
    for p in range(1, 9):
        if p not in hp:
            assert bool((host.page(p) == -7.0).all()), f"host page {p} was written"
    for p, t in before.items():
        assert torch.equal(device_page(kv, p), t), f"device page {p} was written"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_red_a_page_copied_to_the_wrong_host_slot_is_detected(layout: Layout, monkeypatch: pytest.MonkeyPatch) -> None:
    """Revert-then-red for the round-trip check: shift the host index and watch it fail."""
    kv = filled_pool(4, torch.float32)
    host = HostPool.like(kv, 9, layout)
    src, hp, dst = [1, 2, 3], [2, 3, 5], [6, 7, 8]
    assert round_trip_errors(kv, host, src, hp, dst) == []
    # Both directions shifted: the data round-trips, only the host-side reading sees it.
    kv = filled_pool(4, torch.float32, seed=1)
    monkeypatch.setattr(host_pool_mod, "runs", shifted_runs)
    errors = round_trip_errors(kv, host, src, hp, dst)
    assert errors and all(e.startswith("host page") for e in errors)
    # Only the offload shifted: the device pages come back wrong too.
    kv = filled_pool(4, torch.float32, seed=2)
    offload(kv, src, host, hp)
    monkeypatch.setattr(host_pool_mod, "runs", ORIGINAL_RUNS)
    load_back(host, hp, kv, dst)
    assert not any(torch.equal(device_page(kv, d), device_page(kv, s)) for s, d in zip(src, dst, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_bytes_are_canonical_and_round_trip(dtype: torch.dtype) -> None:
    kv = filled_pool(4, dtype)
    pools = {layout: HostPool.like(kv, 6, layout) for layout in LAYOUTS}
    for host in pools.values():
        offload(kv, [3], host, [1])
    expected = device_page(kv, 3).contiguous().view(torch.uint8).numpy().tobytes()
    assert len(expected) == pools["page_first"].bytes_per_page
    for layout, host in pools.items():
        assert host.page_bytes(1) == expected, f"{layout} bytes are not in canonical order"
    # Bytes written by one layout load into the other.
    pools["layer_first"].load_bytes(4, pools["page_first"].page_bytes(1))
    assert torch.equal(pools["layer_first"].page(4), device_page(kv, 3))
    pools["page_first"].load_bytes(2, bytearray(expected))
    assert torch.equal(pools["page_first"].page(2), device_page(kv, 3))


def test_load_bytes_checks_length_and_page() -> None:
    kv = filled_pool(4, torch.float32)
    host = HostPool.like(kv, 4)
    offload(kv, [1], host, [2])
    good = host.page_bytes(2)
    before = host.page(2).clone()
    for bad in (good[:-1], good + b"\0", b""):
        with pytest.raises(ValueError, match="bytes"):
            host.load_bytes(2, bad)
    assert torch.equal(host.page(2), before), "a refused load wrote the page"
    for page in (0, 4, -1):
        with pytest.raises(IndexError):
            host.load_bytes(page, good)
        with pytest.raises(IndexError):
            host.page_bytes(page)


def test_allocator_all_or_nothing_and_double_free() -> None:
    host = HostPool(2, 5, 4, 1, 8, torch.float32)
    assert host.num_usable == 4 and host.num_free == 4
    first = host.allocate(3)
    assert first == [1, 2, 3]
    assert host.allocate(2) is None and host.num_free == 1, "a refused allocation took pages"
    last = host.allocate(1)
    assert last == [4] and host.num_free == 0
    assert host.allocate(1) is None and host.allocate(0) == []
    host.free([2])
    with pytest.raises(RuntimeError, match="double free"):
        host.free([2])
    with pytest.raises(RuntimeError, match="repeat"):
        host.free([1, 1])
    with pytest.raises(RuntimeError):
        host.free([3, 0])  # page 0 was never allocated: refused, and 3 stays allocated
    assert host.is_allocated(3) and host.num_free == 1
    host.free([1, 3, 4])
    assert sorted(host.allocate(4) or []) == [1, 2, 3, 4], "page 0 must never be handed out"
    with pytest.raises(ValueError):
        HostPool(2, 1, 4, 1, 8, torch.float32)


def test_freed_pages_come_back_as_ascending_runs() -> None:
    """Copies move each run of consecutive host pages in one transfer: pages freed (in
    any order) and allocated again form runs, not one page per transfer."""
    host = HostPool(2, 17, 4, 1, 8, torch.float32)
    a, b = host.allocate(8), host.allocate(8)
    assert a == list(range(1, 9)) and b == list(range(9, 17))
    host.free(a[::-1])  # e.g. an eviction that gives a node's pages back last first
    host.free(b[2:6])
    again = host.allocate(12) or []
    assert sorted(again) == sorted(a + b[2:6])
    assert len(list(host_pool_mod.runs(again))) == 2, again  # [11..14] then [1..8]


def test_sizes_and_memory_kind() -> None:
    for layout in LAYOUTS:
        host = HostPool(3, 7, 16, 2, 8, torch.bfloat16, layout)
        assert host.bytes_per_page == KVPool.bytes_per_page(3, 16, 2, 8, torch.bfloat16) == 2 * 3 * 16 * 2 * 8 * 2
        assert host.data.nbytes == 7 * host.bytes_per_page
        assert host.pinned == torch.cuda.is_available()
    assert HostPool(2, 3, 4, 1, 8, torch.float32, pin_memory=False).pinned is False
    with pytest.raises(ValueError):
        HostPool(2, 3, 4, 1, 8, torch.float32, "bogus")  # type: ignore[arg-type]


def test_copies_refuse_mismatched_or_reserved_pages() -> None:
    kv = filled_pool(4, torch.float32)
    host = HostPool.like(kv, 6)
    with pytest.raises(ValueError, match="host pages"):
        offload(kv, [1, 2], host, [1])
    with pytest.raises(ValueError, match="repeat"):
        offload(kv, [1, 2], host, [3, 3])
    with pytest.raises(ValueError, match="reserved"):
        load_back(host, [1], kv, [0])
    with pytest.raises(ValueError, match="reserved"):
        offload(kv, [1], host, [6])
    other = HostPool(LAYERS, 6, 8, HEADS, DIM, torch.float32)
    with pytest.raises(ValueError, match="!="):
        offload(kv, [1], other, [1])
    assert offload(kv, [], host, []) == 0
    assert offload(kv, [1, 2], host, [1, 2]) == 2 * host.bytes_per_page
