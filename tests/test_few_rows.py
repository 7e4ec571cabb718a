"""The few-row float32 / bfloat16 linear (gpu/quant/few_rows.py over
gpu/kernels/cpu/dense_gemv.cpp): the same products as F.linear up to float32 summation order
(bf16: rounded once at the end), for every row count its passes take (passes of 8 rows, 16
with AVX-512, and a rest; more than MAX_ROWS[dtype] go to F.linear), widths with and without
a scalar tail, and biases; the Llama family's float weights use it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu.quant import few_rows
from tests import kernel_variants

pytestmark = pytest.mark.skipif(not few_rows.available(True, torch.float32, torch.device("cpu")),
                                reason="the C++ CPU kernels are not built here")


def agrees(linear: Any, rows: int, k: int, n: int, bias: bool) -> bool:
    torch.manual_seed(rows * 1000 + k)
    x, w = torch.randn(rows, k), torch.randn(n, k)
    b = torch.randn(n) if bias else None
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    # float32 sums of k products of ~N(0, 1) terms: a few ulps of sqrt(k) each.
    return torch.allclose(linear(x, w, b).double(), ref, rtol=0, atol=1e-5 * k**0.5)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 16, 17, 33])
@pytest.mark.parametrize("k", [8, 64, 1027])  # 1027: a scalar tail after the vector body
def test_matches_f_linear(rows: int, k: int) -> None:
    assert agrees(few_rows.linear, rows, k, 37, bias=rows % 2 == 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_among_any_rows(dtype: torch.dtype) -> None:
    """With AVX-512 each row runs the same operations whatever the pass's other rows, so a
    speculative verify step of k + 1 rows gives a row what a one-row step gives it."""
    if torch.ops.tierserve_cpu.dense_gemv_pass_rows() != 16:
        pytest.skip("the AVX2 path (8-row passes) unrolls one row further than several")
    torch.manual_seed(3)
    x, w = torch.randn(33, 1027).to(dtype), torch.randn(37, 1027).to(dtype)
    alone = torch.cat([torch.ops.tierserve_cpu.dense_gemv(x[i : i + 1], w) for i in range(33)])
    for rows in (2, 5, 9, 16, 33):
        assert torch.equal(torch.ops.tierserve_cpu.dense_gemv(x[:rows], w), alone[:rows])


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("k", [8, 64, 1027])
def test_bf16_is_the_float32_sum_rounded_once(rows: int, k: int) -> None:
    """bf16 x and w: the kernel's output is the exact product sum (float64 of the bf16
    inputs) rounded to bf16, but for float32 summation error: within one bf16 step."""
    torch.manual_seed(rows * 1000 + k)
    x, w = torch.randn(rows, k).bfloat16(), torch.randn(37, k).bfloat16()
    exact = torch.nn.functional.linear(x.double(), w.double())
    out = torch.ops.tierserve_cpu.dense_gemv(x, w)
    assert out.dtype == torch.bfloat16
    step = exact.abs().clamp(min=1e-3) * 2.0**-7  # a bf16 ulp at the value (8 significant bits)
    assert ((out.double() - exact).abs() <= step + 1e-5 * k**0.5).all()


def test_red_bf16_weights_read_as_truncated_floats(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard above against a kernel that drops the weights' last mantissa bits: red."""
    torch.manual_seed(5)
    x, w = torch.randn(3, 64).bfloat16(), torch.randn(37, 64).bfloat16()
    exact = torch.nn.functional.linear(x.double(), w.double())
    coarse = (w.view(torch.int16) & ~0x7).view(torch.bfloat16)  # 3 of 7 mantissa bits lost
    out = torch.ops.tierserve_cpu.dense_gemv(x, coarse)
    assert not ((out.double() - exact).abs() <= exact.abs().clamp(min=1e-3) * 2.0**-7 + 1e-5 * 8).all()


def spy_kernel(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows of every call of the kernel."""
    calls: list[int] = []
    real = few_rows._kernel

    def spy(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, w)

    monkeypatch.setattr(few_rows, "_kernel", spy)
    return calls


@pytest.mark.parametrize("dtype", few_rows.DTYPES)
def test_the_kernel_runs_for_few_rows_only(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    calls = spy_kernel(monkeypatch)
    most = few_rows.MAX_ROWS[dtype]
    for rows in (1, most, most + 1):
        few_rows.linear(torch.randn(rows, 16, dtype=dtype), torch.randn(4, 16, dtype=dtype))
    assert calls == [1, most]


def test_red_a_dropped_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard above with a kernel that drops the last column of the sum: red."""
    monkeypatch.setattr(few_rows, "_kernel", lambda x, w: torch.nn.functional.linear(x[:, :-1], w[:, :-1]))
    assert not agrees(few_rows.linear, 3, 1027, 37, bias=False)


def test_float32_llama_uses_it_outside_deterministic_mode(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu.loader import load_checkpoint
    from gpu.models.llama import LlamaModel

    ckpt = load_checkpoint(tiny_chat_folder, torch.float32)
    calls = spy_kernel(monkeypatch)
    for deterministic in (False, True):
        model = LlamaModel(ckpt.arch, ckpt.weights, torch.float32, torch.device("cpu"), deterministic=deterministic,
                           cpu_kernels=True)
        w = model.layers[0].down
        assert isinstance(w, torch.Tensor)
        model.linear(torch.randn(2, w.shape[1]), w)
        assert calls == [2], (deterministic, calls)  # the deterministic model added no call


@kernel_variants.opt_in
@pytest.mark.parametrize("target", list(kernel_variants.TARGETS))
def test_code_paths_of_other_cpus(target: str, tmp_path: Path) -> None:
    """This file's tests again with the kernel built for other CPUs (AVX2-only, plain x86-64,
    AVX-512 without AMX): opt-in, tests/kernel_variants.py."""
    kernel_variants.run_for(target, __file__, tmp_path)
