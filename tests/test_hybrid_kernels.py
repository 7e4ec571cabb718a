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
    chunk_prefill_tracked,
    gated_delta_static,
    gated_delta_varlen,
    native_available,
    recurrent_prefill,
    recurrent_prefill_tracked,
    recurrent_step,
)
from gpu.kernels.short_conv import short_conv_static, short_conv_varlen, short_conv_windows_at
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
    before = states.clone()
    for recurrent in (True, False):
        out, new_states, _ = gated_delta_varlen(
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
    assert torch.equal(states, before)  # the input states are left as they were


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


# States tracked inside a chunk: each equals what a run stopping there leaves.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_windows_at_interior_points(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    channels, kernel, lens = 6, 4, [7, 1, 12]
    x = torch.randn(sum(lens), channels, generator=gen).to(dtype)
    windows = torch.randn(len(lens), channels, kernel - 1, generator=gen).to(dtype)
    weight = torch.randn(channels, kernel, generator=gen)
    points = [(0, 1), (0, 2), (0, 3), (0, 6), (1, 1), (2, 2), (2, 4), (2, 11), (2, 12)]
    at = short_conv_windows_at(x, windows, lens, points)
    assert at.shape == (len(points), channels, kernel - 1) and at.dtype == dtype
    starts = [0, 7, 8]
    for m, (r, n) in enumerate(points):  # a run of only the first n tokens
        _, stopped = short_conv_varlen(x[starts[r] : starts[r] + n], windows[r : r + 1], [n], weight)
        assert torch.equal(at[m], stopped[0]), (r, n)
    assert short_conv_windows_at(x, windows, lens, []).shape == (0, channels, kernel - 1)
    with pytest.raises(ValueError, match="not inside"):
        short_conv_windows_at(x, windows, lens, [(1, 2)])


def _rows(x: DeltaInputs, n: int) -> DeltaInputs:
    return x.rows(slice(0, n))


@pytest.mark.parametrize("start", [0, 40, 64, 100])
def test_chunked_tracked_states_equal_stopped_runs(start: int) -> None:
    """On the 64 grid (absolute) the tracked state is the stopped run's bit for bit; off
    it, the stopped run's last partial chunk is rerun: equal to rounding at least."""
    length = 190
    q, k, v, g, beta, s0 = _inputs(length, seed=start)
    x = DeltaInputs(q, k, v, g, beta)
    ends = sorted({n for n in (1, 24, 28, 60, 64, 88, 100, 128, 156, 189) if 0 < n < length})
    out, final, tracked = chunk_prefill_tracked(x, s0, start, ends)
    plain_out, plain_final = chunk_prefill(x, s0, start)
    assert torch.equal(out, plain_out) and torch.equal(final, plain_final)  # tracking changes nothing
    for m, n in enumerate(ends):
        _, stopped = chunk_prefill(_rows(x, n), s0, start)
        if (start + n) % 64 == 0:
            assert torch.equal(tracked[m], stopped), n
        assert (tracked[m] - stopped).abs().max() < 1e-5, n
    _, rec_final, rec_tracked = recurrent_prefill_tracked(x, s0, ends)
    assert torch.equal(rec_final, recurrent_prefill(x, s0)[1])
    for m, n in enumerate(ends):
        assert torch.equal(rec_tracked[m], recurrent_prefill(_rows(x, n), s0)[1]), n
    for bad in ([0], [length], [64, 64], [100, 64]):
        with pytest.raises(ValueError, match="must increase"):
            chunk_prefill_tracked(x, s0, start, bad)


def test_varlen_tracked_states_equal_stopped_steps() -> None:
    """A mixed step tracking states inside two prefills (on and off the 64 grid, one token
    in) == a step of that request stopping there; the step's own results are unchanged."""
    lens, prefixes = [150, 1, 70], [0, 9, 40]
    per_req = [_inputs(n, seed=20 + i) for i, n in enumerate(lens)]
    x = DeltaInputs(*(torch.cat([r[j] for r in per_req]) for j in range(5)))
    states = torch.stack([r[5] for r in per_req])
    track = [(0, 64), (0, 100), (0, 128), (2, 1), (2, 24), (2, 60)]
    for recurrent in (True, False):
        out, new, tracked = gated_delta_varlen(x, states, lens, prefixes, recurrent=recurrent, track=track)
        plain_out, plain_new, none = gated_delta_varlen(x, states, lens, prefixes, recurrent=recurrent)
        assert torch.equal(out, plain_out) and torch.equal(new, plain_new) and none.shape[0] == 0
        for m, (r, n) in enumerate(track):
            xr = DeltaInputs(*per_req[r][:5])
            _, stopped, _ = gated_delta_varlen(_rows(xr, n), states[r : r + 1], [n], [prefixes[r]], recurrent)
            if recurrent or (prefixes[r] + n) % 64 == 0 or n == 1:
                assert torch.equal(tracked[m], stopped[0]), (recurrent, r, n)
            assert (tracked[m] - stopped[0]).abs().max() < 1e-5
    with pytest.raises(ValueError, match="not inside"):
        gated_delta_varlen(x, states, lens, prefixes, recurrent=False, track=[(1, 1)])


def test_hybrid_step_track_checks_and_stores() -> None:
    cpu = torch.device("cpu")
    plain = HybridStep.build([3, 1], [0, 5], [2, 2], [1, 3], cpu)
    assert plain.track == () and plain.track_points == () and plain.track_slots.numel() == 0
    step = HybridStep.build([100, 1], [30, 5], [2, 2], [1, 0], cpu, track=[[(64, 4), (100, 5)], []])
    assert step.track_points == ((0, 34), (0, 70)) and step.track_slots.tolist() == [4, 5]
    pool = torch.zeros(6, 2)
    step.store_tracked(pool, torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
    assert pool[4].tolist() == [1, 1] and pool[5].tolist() == [2, 2] and not pool[:4].any()
    bad = {
        "not inside": [[(30, 4)], []],  # end_len == prefix_len
        "not inside ": [[(130, 4)], []],  # end_len == prefix_len + extend_len
        "increase": [[(64, 4), (64, 5)], []],
        "tracked twice": [[(40, 4), (64, 4)], []],
        "reserved": [[(40, -1)], []],
        "also dst": [[(40, 1)], []],
        "entries": [[(40, 4)]],
    }
    for match, track in bad.items():
        with pytest.raises(ValueError, match=match.strip()):
            HybridStep.build([100, 1], [30, 5], [2, 2], [1, 0], cpu, track=track)
    with pytest.raises(ValueError, match="also dst"):  # slot 0 is the padding rows' dst
        HybridStep.build([100, 1], [30, 5], [2, 2], [1, 0], cpu, track=[[(40, 0)], []])


def test_forward_batch_carries_state_track() -> None:
    from gpu.forward_batch import ForwardBatch, PrefillChunk

    chunks = [PrefillChunk(tuple(range(150)), 1, 0, 0, 2, ((64, 3), (128, 4))), PrefillChunk((5,), 2, 9, 5, 5)]
    batch = ForwardBatch.build(chunks, [])
    assert batch.state_track == (((64, 3), (128, 4)), ())
    assert PrefillChunk((1,), 1, 0).state_track == ()
    # The runner hands it to the model's step.
    from types import SimpleNamespace
    from typing import Any

    from gpu.model_runner import ModelRunner

    model: Any = SimpleNamespace(device=torch.device("cpu"), arch=SimpleNamespace(vocab_size=10))
    runner = ModelRunner(model, None, None, _pool(6))  # type: ignore[arg-type]
    step = runner.hybrid_step(batch)
    assert step.track_points == ((0, 64), (0, 128)) and step.track_slots.tolist() == [3, 4]
    assert runner.hybrid_step(ForwardBatch.build(chunks[1:], [])).track_points == ()


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
def test_static_forms_equal_the_varlen_forms(native: bool) -> None:
    """A verify bucket's static forms (lengths as a tensor, request slots of 0 tokens
    too): the recurrent varlen form's outputs and final states, the state after every
    token equal to its tracked state (the last one to the final state), the conv's
    outputs, windows and per-token windows equal to `short_conv_windows_at`'s — bit for
    bit; an empty slot keeps its state."""
    if native and not native_available(torch.device("cpu")):
        pytest.skip("the C++ gated-delta kernel does not build here")
    gen = torch.Generator().manual_seed(11)
    lens = [3, 1, 0, 5, 2]
    live = [r for r, n in enumerate(lens) if n]
    tokens, heads, dk, dv = sum(lens), 2, 8, 4
    x = DeltaInputs(torch.randn(tokens, heads, dk, generator=gen), torch.randn(tokens, heads, dk, generator=gen),
                    torch.randn(tokens, heads, dv, generator=gen), -torch.rand(tokens, heads, generator=gen),
                    torch.rand(tokens, heads, generator=gen))
    states = torch.randn(len(lens), heads, dk, dv, generator=gen)
    track = [(i, n) for i, r in enumerate(live) for n in range(1, lens[r])]
    want_out, want_states, want_tracked = gated_delta_varlen(
        x, states[live], [lens[r] for r in live], [0] * len(live), recurrent=True, track=track, native=native)
    out, final, after = gated_delta_static(x, states, torch.tensor(lens), max(lens), native=native)
    assert torch.equal(out, want_out) and torch.equal(final[live], want_states) and torch.equal(final[2], states[2])
    last = torch.tensor(lens).cumsum(0)[live] - 1
    tracked_rows = [t for t in range(tokens) if t not in set(last.tolist())]
    assert torch.equal(after[last], want_states) and torch.equal(after[tracked_rows], want_tracked)
    channels, width = 6, 3
    xc, windows = torch.randn(tokens, channels, generator=gen), torch.randn(len(lens), channels, width, generator=gen)
    weight, bias = torch.randn(channels, width + 1, generator=gen), torch.randn(channels, generator=gen)
    y, new, per_token = short_conv_static(xc, windows, torch.tensor(lens), weight, bias)
    want_y, want_new = short_conv_varlen(xc, windows[live], [lens[r] for r in live], weight, bias)
    points = [(i, n) for i, r in enumerate(live) for n in range(1, lens[r] + 1)]
    assert torch.equal(y, want_y) and torch.equal(new[live], want_new) and torch.equal(new[2], windows[2])
    assert torch.equal(per_token, short_conv_windows_at(xc, windows[live], [lens[r] for r in live], points))
