"""Host state slots (hybrid models): allocator, canonical bytes, bit-exact copies."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch

import cache.host_pool as host_pool_mod
from cache.host_state_pool import (
    HostStatePool,
    load_states_back,
    offload_states,
    slot_from_bytes,
    slot_to_bytes,
)
from cache.state_pool import RECURRENT_DTYPE, LayerStateShape, StatePool

# A conv-only layer between two delta-rule layers; odd conv sizes put the float32
# recurrent block of the next layer off a 4-byte boundary in the canonical bytes.
LAYERS = (LayerStateShape(5, 3, (2, 4, 4)), LayerStateShape(5, 3, None), LayerStateShape(3, 1, (1, 2, 3)))
SLOTS = 8


def filled(dtype: torch.dtype, seed: int = 0) -> StatePool:
    pool = StatePool(LAYERS, SLOTS, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    for t in pool._tensors():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return pool


def slot_of(pool: StatePool | HostStatePool, slot: int) -> list[torch.Tensor]:
    """The test's own reading of one slot, canonical order (conv, then recurrent, per layer)."""
    out = []
    for conv, rec in zip(pool.conv, pool.recurrent, strict=True):
        out.append(conv[slot])
        if rec is not None:
            out.append(rec[slot])
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def errors(pool: StatePool, host: HostStatePool, src: Sequence[int], hs: Sequence[int], dst: Sequence[int]) -> list[str]:
    out = []
    offload_states(pool, src, host, hs)
    out += [f"host slot {h} != slot {s}" for s, h in zip(src, hs, strict=True) if not same(slot_of(host, h), slot_of(pool, s))]
    load_states_back(host, hs, pool, dst)
    out += [f"slot {d} != slot {s}" for s, d in zip(src, dst, strict=True) if not same(slot_of(pool, d), slot_of(pool, s))]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    pool = filled(dtype)
    host = HostStatePool.like(pool, 6)
    assert host.recurrent[0] is not None and host.recurrent[0].dtype == RECURRENT_DTYPE
    untouched = {s: [t.clone() for t in slot_of(pool, s)] for s in (1, 2, 3, 7)}
    assert errors(pool, host, [3, 1, 2], [1, 2, 4], [5, 4, 6]) == []
    for s, ts in untouched.items():
        assert same(slot_of(pool, s), ts), f"slot {s} was written"
    assert offload_states(pool, [1, 2], host, [3, 5]) == 2 * host.bytes_per_slot


def test_red_a_slot_copied_to_the_wrong_host_slot_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = filled(torch.float32)
    host = HostStatePool.like(pool, 6)
    assert errors(pool, host, [1, 2], [2, 3], [4, 5]) == []
    original = host_pool_mod.runs

    def shifted(ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
        for i, j, first in original(ids):
            yield i, j, first + 1

    pool = filled(torch.float32, seed=1)
    monkeypatch.setattr("cache.host_state_pool.runs", shifted)
    found = errors(pool, host, [1, 2], [2, 3], [4, 5])
    assert found and all(e.startswith("host slot") for e in found)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_bytes_are_canonical_and_round_trip(dtype: torch.dtype) -> None:
    pool = filled(dtype)
    host = HostStatePool.like(pool, 4)
    offload_states(pool, [2], host, [1])
    data = host.state_bytes(1)
    expected = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in slot_of(pool, 2))
    assert data == expected and len(data) == host.bytes_per_slot == StatePool.slot_bytes(LAYERS, dtype)
    host.load_state_bytes(3, memoryview(data))
    assert same(slot_of(host, 3), slot_of(pool, 2))
    before = [t.clone() for t in slot_of(host, 3)]
    with pytest.raises(ValueError, match="bytes"):
        host.load_state_bytes(3, data[:-4])
    assert same(slot_of(host, 3), before)
    with pytest.raises(IndexError):
        host.state_bytes(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_slot_bytes_and_back(dtype: torch.dtype) -> None:
    """The storage tier reads and fills state slots of the device pool (a hybrid node's
    state never leaves it): on CUDA too, the same bytes as the slot read on the host."""
    cpu = filled(dtype)
    device = StatePool(LAYERS, SLOTS, dtype, torch.device("cuda"))
    for dst, src in zip(device.tensors(), cpu.tensors(), strict=True):
        dst.copy_(src)
    data = slot_to_bytes(device.tensors(), 2)
    assert data == slot_to_bytes(cpu.tensors(), 2) and len(data) == device.bytes_per_slot
    slot_from_bytes(device.tensors(), 5, data, device.bytes_per_slot)
    assert same([t.cpu() for t in slot_of(device, 5)], slot_of(cpu, 2))


def test_state_allocator_and_refusals() -> None:
    pool = filled(torch.float32)
    host = HostStatePool.like(pool, 3)
    assert host.num_usable == 2 and host.allocate(3) is None and host.num_free == 2
    slots = host.allocate(2)
    assert slots == [1, 2]
    host.free([1])
    with pytest.raises(RuntimeError, match="double free"):
        host.free([1])
    with pytest.raises(ValueError, match="reserved"):
        offload_states(pool, [0], host, [1])
    with pytest.raises(ValueError, match="host slots"):
        offload_states(pool, [1, 2], host, [1])
    other = HostStatePool(LAYERS[:2], 3, torch.float32)
    with pytest.raises(ValueError, match="differ"):
        offload_states(pool, [1], other, [1])
