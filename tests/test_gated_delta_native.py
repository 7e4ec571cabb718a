"""The gated delta rule's C++ recurrent form (gpu/kernels/cpu/gated_delta.cpp through
gpu/kernels/gated_delta.py `native_varlen`): the recurrence's values (torch's recurrent
form within float rounding), and bit for bit the same state and outputs for a request
whatever else shares its step and however its tokens were split into steps — one prefill,
chunks, or decode steps. The engine runs it for Gated DeltaNet models on CPU, in
deterministic mode too (the bit-exact hybrid suite then runs on it). Planted: decode
steps through torch's form while prefill runs natively (two arithmetics in one process)
goes red."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpu.kernels import gated_delta as gd

pytestmark = pytest.mark.skipif(not gd.native_available(torch.device("cpu")),
                                reason="the C++ gated-delta kernel does not build here")

H, DK, DV = 4, 16, 8


def inputs(tokens: int, seed: int) -> gd.DeltaInputs:
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(tokens, H, DK, generator=g), dim=-1) * DK**-0.5
    k = F.normalize(torch.randn(tokens, H, DK, generator=g), dim=-1)
    return gd.DeltaInputs(q, k, torch.randn(tokens, H, DV, generator=g), -torch.rand(tokens, H, generator=g),
                          torch.rand(tokens, H, generator=g))


def alone(x: gd.DeltaInputs, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out, states, _ = gd.native_varlen(x, state[None], [x.q.shape[0]])
    return out, states[0]


def test_values_match_torchs_recurrent_form() -> None:
    lens = [37, 1, 12, 1, 64]
    x = inputs(sum(lens), 0)
    states = torch.randn(len(lens), H, DK, DV) * 0.1
    track = [(0, 16), (2, 5), (4, 63)]
    want = gd.gated_delta_varlen(x, states, lens, [0] * len(lens), recurrent=True, track=track)
    got = gd.gated_delta_varlen(x, states, lens, [0] * len(lens), recurrent=True, track=track, native=True)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    assert torch.equal(states, states.clone()), "the input states are not modified"


def test_a_request_alone_equals_it_among_others() -> None:
    """Its outputs and state alone, and inside steps of 1-64 other requests of mixed lengths
    (prefill and decode rows), at any position: the same bits."""
    x = inputs(29, 1)
    state = torch.randn(H, DK, DV) * 0.1
    out, final = alone(x, state)
    rng = random.Random(2)
    for others in (1, 7, 64):
        lens = [rng.choice([1, 1, 3, 17, 40]) for _ in range(others)]
        at = rng.randrange(others + 1)
        lens.insert(at, 29)
        parts = [inputs(n, 10 + i) for i, n in enumerate(lens)]
        parts[at] = x
        batch = gd.DeltaInputs(*(torch.cat([p[i] for p in parts]) for i in range(5)))
        states = torch.randn(len(lens), H, DK, DV) * 0.1
        states[at] = state
        o, s, _ = gd.native_varlen(batch, states, lens)
        start = sum(lens[:at])
        assert torch.equal(o[start : start + 29], out) and torch.equal(s[at], final), (others, at)


@pytest.mark.parametrize("split", [[29], [16, 13], [8, 8, 8, 5], [1] * 29])
def test_chunks_and_decode_steps_reach_the_same_bits(split: list[int]) -> None:
    x = inputs(29, 3)
    state = torch.randn(H, DK, DV) * 0.1
    whole_out, whole_state = alone(x, state)
    outs, s, start = [], state, 0
    for n in split:
        o, s = alone(x.rows(slice(start, start + n)), s)
        outs.append(o)
        start += n
    assert torch.equal(torch.cat(outs), whole_out) and torch.equal(s, whole_state)
    # A tracked state is the one a run stopping there ends with.
    _, _, tracked = gd.native_varlen(x, state[None], [29], [(0, 8)])
    assert torch.equal(tracked[0], alone(x.rows(slice(0, 8)), state)[1])


def test_red_decode_through_torchs_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: one-token steps through torch's `recurrent_step` while prefill runs
    natively, as a process mixing the two forms would: the state reached by decode steps
    is not the one a prefill reaches."""
    real = gd.native_varlen

    def mixed(x: gd.DeltaInputs, states: torch.Tensor, extend_lens: list[int], track: list[tuple[int, int]] = ()):  # type: ignore[no-untyped-def]
        if all(n == 1 for n in extend_lens):
            out, s = gd.recurrent_step(x, states)
            return out, s, states.new_empty((0, *states.shape[1:]))
        return real(x, states, extend_lens, track)

    monkeypatch.setattr(gd, "native_varlen", mixed)
    x = inputs(12, 4)
    state = torch.randn(H, DK, DV) * 0.1
    _, whole = gd.native_varlen(x, state[None], [12])[:2]
    s = state[None]
    for t in range(12):
        _, s, _ = gd.native_varlen(x.rows(slice(t, t + 1)), s, [1])
    assert not torch.equal(s, whole)


def test_the_engine_runs_it_in_deterministic_mode(tmp_path: Path) -> None:
    from kernel import Engine
    from tests.conftest import HYBRID_OVERRIDES
    from tests.tiny_hybrid import build_tiny_qwen3_5

    folder = str(build_tiny_qwen3_5(tmp_path))
    for kernels, native in (("auto", True), ("off", False)):
        e = Engine(None, {**HYBRID_OVERRIDES, "model.path": folder, "deterministic": True,
                          "model.cpu_kernels": kernels})
        try:
            assert e.engine.parts.runner.model.native_recurrence is native
        finally:
            e.shutdown()
