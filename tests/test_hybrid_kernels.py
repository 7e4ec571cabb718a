"""Hybrid-model kernels and state pool: gated delta rule (chunked vs recurrent, prefill vs
decode bit for bit), the carried conv window, StatePool's allocator and copies, HybridStep."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cache.state_pool import LayerStateShape, StatePool
from gpu.kernels.gated_delta import (
    DeltaInputs,
    chunk_prefill,
    gated_delta_varlen,
    recurrent_prefill,
    recurrent_step,
)
from gpu.kernels.short_conv import short_conv_varlen
from gpu.models.hybrid_step import HybridStep

H, DK, DV = 4, 16, 8


Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _inputs(length: int, seed: int = 0) -> Inputs:
    """Delta-rule inputs as the model makes them: unit keys, scaled queries, g <= 0."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(length, H, DK, generator=gen), dim=-1) * DK**-0.5
    k = F.normalize(torch.randn(length, H, DK, generator=gen), dim=-1)
    v = torch.randn(length, H, DV, generator=gen)
    g = -torch.rand(length, H, generator=gen) * 0.5
    beta = torch.rand(length, H, generator=gen)
    state = torch.randn(H, DK, DV, generator=gen) * 0.3
    return q, k, v, g, beta, state


def _reference_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule written out in float64, one token and one head at a time."""
    s = state.double().clone()
    out = torch.empty(q.shape[0], H, DV, dtype=torch.float64)
    for t in range(q.shape[0]):
        for h in range(H):
            s[h] *= torch.exp(g[t, h].double())
            kt = k[t, h].double()
            s[h] += torch.outer(kt, beta[t, h].double() * (v[t, h].double() - s[h].T @ kt))
            out[t, h] = s[h].T @ q[t, h].double()
    return out, s


@pytest.mark.parametrize(
    ("start", "length"), [(0, 1), (0, 64), (0, 150), (5, 17), (40, 88), (64, 70), (100, 3)]
)
def test_chunked_matches_recurrent(start: int, length: int) -> None:
    q, k, v, g, beta, s0 = _inputs(length, seed=start + length)
    ref_out, ref_state = _reference_recurrence(q, k, v, g, beta, s0)
    rec_out, rec_state = recurrent_prefill(DeltaInputs(q, k, v, g, beta), s0)
    chk_out, chk_state = chunk_prefill(DeltaInputs(q, k, v, g, beta), s0, start_pos=start)
    assert (rec_out.double() - ref_out).abs().max() < 1e-5
    assert (rec_state.double() - ref_state).abs().max() < 1e-5
    assert (chk_out - rec_out).abs().max() < 1e-4
    assert (chk_state - rec_state).abs().max() < 1e-4


def test_chunk_grid_is_anchored_at_position_zero() -> None:
    """A prompt split on a multiple of 64 runs the very same chunks as an unsplit one (bit
    for bit); any other split agrees to rounding."""
    q, k, v, g, beta, s0 = _inputs(200, seed=1)
    whole_out, whole_state = chunk_prefill(DeltaInputs(q, k, v, g, beta), s0, 0)
    for split in (64, 128, 1, 40, 100, 199):
        out1, s1 = chunk_prefill(DeltaInputs(q[:split], k[:split], v[:split], g[:split], beta[:split]), s0, 0)
        out2, s2 = chunk_prefill(
            DeltaInputs(q[split:], k[split:], v[split:], g[split:], beta[split:]), s1, split
        )
        out = torch.cat([out1, out2])
        if split % 64 == 0:
            assert torch.equal(out, whole_out) and torch.equal(s2, whole_state), split
        assert (out - whole_out).abs().max() < 1e-5 and (s2 - whole_state).abs().max() < 1e-5


def test_recurrent_prefill_equals_decode_steps_bitwise() -> None:
    """N tokens of recurrent prefill == N one-token updates, each in a batch with other
    requests (decode), bit for bit: the state does not depend on how it was reached."""
    n = 40
    q, k, v, g, beta, s0 = _inputs(n, seed=2)
    pre_out, pre_state = recurrent_prefill(DeltaInputs(q, k, v, g, beta), s0)
    others = _inputs(n, seed=3)
    s = s0
    for t in range(n):
        batch = [
            torch.stack([others[i][t], x[t], others[i][(t + 1) % n]])
            for i, x in enumerate((q, k, v, g, beta))
        ]
        states = torch.stack([others[5], s, others[5] * 2])
        out, new = recurrent_step(DeltaInputs(batch[0], batch[1], batch[2], batch[3], batch[4]), states)
        assert torch.equal(out[1], pre_out[t]), t
        s = new[1]
    assert torch.equal(s, pre_state)


def test_varlen_step_matches_per_request_kernels() -> None:
    """A mixed step (two prefills, two decodes) == each request alone; recurrent mode bit for bit."""
    lens, prefixes = [30, 1, 70, 1], [0, 9, 50, 128]
    per_req = [_inputs(n, seed=10 + i) for i, n in enumerate(lens)]
    q, k, v, g, beta = (torch.cat([r[j] for r in per_req]) for j in range(5))
    states = torch.stack([r[5] for r in per_req])
    for recurrent in (True, False):
        out, new_states = gated_delta_varlen(
            DeltaInputs(q, k, v, g, beta), states, lens, prefixes, recurrent=recurrent
        )
        start = 0
        for i, (n, p) in enumerate(zip(lens, prefixes)):
            r = per_req[i]
            if recurrent:
                ref_out, ref_state = recurrent_prefill(DeltaInputs(*r[:5]), r[5])
                assert torch.equal(out[start : start + n], ref_out) and torch.equal(new_states[i], ref_state)
            else:
                x, s0 = DeltaInputs(*r[:5]), r[5]
                ref_out, ref_state = chunk_prefill(x, s0, start_pos=p) if n > 1 else recurrent_prefill(x, s0)
                assert (out[start : start + n] - ref_out).abs().max() < 1e-6
                assert (new_states[i] - ref_state).abs().max() < 1e-6
            start += n
    assert not torch.equal(new_states, states)  # the input states are left as they were


@pytest.mark.parametrize("kernel", [3, 4])
def test_carried_conv_window_equals_conv_over_whole_sequence(kernel: int) -> None:
    gen = torch.Generator().manual_seed(kernel)
    channels, total = 6, 34
    x = torch.randn(total, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    bias = torch.randn(channels, generator=gen)
    ref = F.conv1d(x.T[None], weight[:, None, :], bias, padding=kernel - 1, groups=channels)[0, :, :total].T
    outputs = {}
    for chunks in ([34], [1, 1, 2, 10, 20], [2, 30, 1, 1], [16, 18]):
        window = torch.zeros(1, channels, kernel - 1)
        pieces, start = [], 0
        for n in chunks:
            y, window = short_conv_varlen(x[start : start + n], window, [n], weight, bias)
            pieces.append(y)
            start += n
        out = torch.cat(pieces)
        assert (out - ref).abs().max() < 1e-5
        assert torch.equal(window[0], x[-(kernel - 1) :].T)  # the window is the last raw inputs
        outputs[tuple(chunks)] = out
    first = next(iter(outputs.values()))
    assert all(torch.equal(o, first) for o in outputs.values())  # chunking changes no bit


def test_conv_batched_requests_are_independent() -> None:
    gen = torch.Generator().manual_seed(0)
    channels, kernel, lens = 5, 4, [7, 1, 2, 12]
    x = torch.randn(sum(lens), channels, generator=gen)
    windows = torch.randn(len(lens), channels, kernel - 1, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    y, new = short_conv_varlen(x, windows, lens, weight)
    start = 0
    for i, n in enumerate(lens):
        yi, wi = short_conv_varlen(x[start : start + n], windows[i : i + 1], [n], weight)
        assert torch.equal(y[start : start + n], yi) and torch.equal(new[i], wi[0])
        start += n


def _pool(num_slots: int = 4) -> StatePool:
    shapes = [LayerStateShape(12, 3, (H, DK, DV)), LayerStateShape(8, 2, None)]
    return StatePool(shapes, num_slots, torch.bfloat16, torch.device("cpu"))


def test_state_pool_allocator() -> None:
    pool = _pool(4)
    assert pool.num_usable == 3 and pool.num_free == 3
    slots = [pool.allocate() for _ in range(3)]
    assert sorted(s for s in slots if s is not None) == [1, 2, 3]  # slot 0 is never handed out
    assert pool.allocate() is None and pool.num_free == 0
    pool.free(2)
    with pytest.raises(RuntimeError, match="twice"):
        pool.free(2)
    with pytest.raises(RuntimeError, match="reserved"):
        pool.free(0)
    assert pool.allocate() == 2 and pool.is_allocated(2)


def test_state_pool_tensors_copy_zero_bytes() -> None:
    pool = _pool(4)
    assert pool.conv[0].shape == (4, 12, 3) and pool.conv[0].dtype == torch.bfloat16
    assert pool.recurrent_of(0).shape == (4, H, DK, DV) and pool.recurrent_of(0).dtype == torch.float32
    assert pool.recurrent[1] is None
    with pytest.raises(KeyError):
        pool.recurrent_of(1)
    total = sum(t.nbytes for t in pool.conv) + pool.recurrent_of(0).nbytes
    assert pool.bytes_per_slot * pool.num_slots == total
    for t in (pool.conv[0], pool.conv[1], pool.recurrent_of(0)):
        t[1].normal_()
    pool.copy(1, 3)
    assert all(torch.equal(t[1], t[3]) for t in (pool.conv[0], pool.conv[1], pool.recurrent_of(0)))
    pool.zero(1)
    assert all(not t[1].any() for t in (pool.conv[0], pool.conv[1], pool.recurrent_of(0)))
    assert pool.conv[1][3].any()  # zeroing one slot leaves the copy alone


def test_hybrid_step_loads_fresh_as_zero_and_checks_slots() -> None:
    pool = _pool(4)
    pool.conv[0][2].fill_(1.0)
    step = HybridStep.build([3, 1], [0, 5], [2, 2], [1, 3], torch.device("cpu"))
    loaded = step.load(pool.conv[0])
    assert not loaded[0].any() and bool((loaded[1] == 1).all())  # prefix 0 ignores its src slot
    step.store(pool.conv[0], torch.full_like(loaded, 7.0))
    assert bool(
        (pool.conv[0][1] == 7).all() and (pool.conv[0][3] == 7).all() and (pool.conv[0][2] == 1).all()
    )
    with pytest.raises(ValueError, match="same state slot"):
        HybridStep.build([1, 1], [4, 4], [1, 2], [3, 3], torch.device("cpu"))
    HybridStep.build([1, 1], [4, 4], [1, 2], [0, 0], torch.device("cpu"))  # padding rows share slot 0
