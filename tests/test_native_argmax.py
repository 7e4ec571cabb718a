"""Greedy sampling's C++ argmax (gpu/kernels/cpu/sampling.cpp) returns exactly torch's
`argmax(dim=-1)`: the first index of ties (+0 and -0 tie), a row's first NaN, 0 for a row
of -inf, over row lengths that are and are not whole vectors; and the engine uses it on
CPU with the kernels on, never in deterministic mode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu.sampling import argmax_rows, native_argmax_ready
from tests import kernel_variants

CPU = torch.device("cpu")
READY = native_argmax_ready(True, CPU)
needs_kernel = pytest.mark.skipif(not READY, reason="the sampling extension does not build here")
NAN, INF = float("nan"), float("inf")
LENGTHS = (1, 7, 8, 31, 64, 65, 5000, 49152, 49159)


def hard_rows(n: int, seed: int) -> torch.Tensor:
    """Rows built to tell argmax implementations apart: ties (first / last / spread),
    signed zeros, infinities, NaN early / late / among maxima, all -inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, n, generator=g)
    last = n - 1
    x[1, :] = 1.0  # every element ties
    x[2, [0, last]] = 50.0  # first and last tie
    x[3, [last // 2, last]] = 50.0
    x[4, :] = 0.0
    x[4, ::2] = -0.0  # +0 and -0 tie: torch counts them equal
    x[5, :] = -INF
    x[6, last] = INF
    x[6, last // 3] = INF
    x[7, last] = NAN  # NaN in the tail
    x[8, [last // 2, last]] = NAN  # the first of two NaNs
    x[9, 0] = 100.0
    x[9, last] = NAN  # NaN wins over a bigger number before it
    x[10, :] = -INF
    x[10, last] = -1e38
    x[11, last // 4] = 3.4e38  # the largest finite float
    return x


@needs_kernel
@pytest.mark.parametrize("n", LENGTHS)
def test_native_argmax_is_torch_argmax(n: int) -> None:
    for seed in range(3):
        x = hard_rows(n, seed)
        assert torch.equal(argmax_rows(x, native=True), x.argmax(dim=-1)), (n, seed)


@needs_kernel
def test_native_argmax_takes_views_and_many_rows() -> None:
    x = torch.randn(70, 3000, generator=torch.Generator().manual_seed(4))
    x[::5, 17] = 9.0
    x[::5, 2500] = 9.0
    view = x[:, 1:2999]  # not contiguous: the wrapper copies it
    assert torch.equal(argmax_rows(view, native=True), view.argmax(dim=-1))
    assert torch.equal(argmax_rows(x[3:4], native=True), x[3:4].argmax(dim=-1))


@needs_kernel
def test_the_cases_tell_wrong_argmaxes_apart() -> None:
    """Planted: a last-of-ties argmax and a NaN-skipping one both differ from torch's on
    these rows, so the equality above would go red for either."""
    x = hard_rows(65, 0)
    expected = x.argmax(dim=-1)
    last_of_ties = x.size(1) - 1 - x.flip(-1).argmax(dim=-1)
    nan_skipping = torch.nan_to_num(x, nan=-INF).argmax(dim=-1)
    assert not torch.equal(last_of_ties, expected)
    assert not torch.equal(nan_skipping, expected)


def test_other_dtypes_and_the_default_take_torchs_path() -> None:
    x = torch.randn(3, 100, dtype=torch.bfloat16)
    assert torch.equal(argmax_rows(x, native=True), x.argmax(dim=-1))
    y = hard_rows(33, 1)
    assert torch.equal(argmax_rows(y), y.argmax(dim=-1))


def test_switched_off_and_non_cpu_never_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not native_argmax_ready(False, CPU)
    assert not native_argmax_ready(True, torch.device("meta"))
    monkeypatch.setenv("TIERSERVE_CPU_KERNELS", "off")
    assert not native_argmax_ready(True, CPU)


@needs_kernel
def test_the_engine_samples_with_it_on_cpu(tiny_engine, tiny_det_engine) -> None:  # type: ignore[no-untyped-def]
    """The tiny engine (kernels on: auto) picks greedy tokens in C++, in deterministic mode
    too (an argmax has no arithmetic to reorder), and the output is the torch path's."""
    runner = tiny_engine.engine.parts.runner
    assert runner.native_argmax
    assert tiny_det_engine.engine.parts.runner.native_argmax
    greedy = {"max_new_tokens": 10, "temperature": 0.0}
    fast = tiny_engine.generate("Count with me", greedy)
    runner.native_argmax = False
    try:
        slow = tiny_engine.generate("Count with me", greedy)
    finally:
        runner.native_argmax = True
    assert fast["output_ids"] == slow["output_ids"]


@kernel_variants.opt_in
@pytest.mark.parametrize("target", list(kernel_variants.TARGETS))
def test_vector_paths_of_other_cpus(target: str, tmp_path: Path) -> None:
    """This file's kernel tests again with the kernel built for other CPUs (AVX2-only,
    plain x86-64: the scalar path, AVX-512 without AMX): opt-in, tests/kernel_variants.py."""
    kernel_variants.run_for(target, __file__, tmp_path)
