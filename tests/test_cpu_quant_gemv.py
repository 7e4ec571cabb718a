"""tierserve's C++ quantized matmuls (gpu/kernels/cpu/quant_gemv.cpp) against
independent references, in every code path compiled here (AVX512-VNNI where the CPU has it, in
512-bit registers too with AVX-512 F/BW, AVX2, scalar).

- 4-bit: GGUF Q4_0 / Q4_1 blocks made by the `gguf` package's quantizer, dequantized by its
  reference code, against Int4Linear built on those blocks with the kernel
  (gpu/quant/gemv.py packs them). The kernel quantizes x to int8 per group of 32 (s =
  max|x| / 127, round half to even) and computes the exact dot product of that x with the
  checkpoint's levels, so against x quantized here the same way only float32 rounding is
  left (measured max error / max |ref| 2.3e-7; bound 1e-5); against the unquantized x the
  error is the activations' quantization (measured 4.6e-3 to 6.4e-3; bound 2e-2). bfloat16
  x: the output is rounded to bfloat16 (bound 1e-2 on top). Every instruction set gives the
  same bits, and a row's result does not depend on how many rows share the call.
- int8: the same scheme (x quantized alike, exact integer dot products) against the
  layer's dequantized weight: against quantized x measured 0.9e-7 to 3e-7 (float32), 2e-3 to
  3.4e-3 (bfloat16 output); against the unquantized x 4e-3 to 6.7e-3; same bounds.
- Shapes: SmolLM2's (K, N), an N not a multiple of the 16-row tile, an output head of 8200
  rows; M 1..8, 11 and 50 (one chunk of rows, several, more than one block).
- Planted bugs (monkeypatched into the packers): nibbles of a pair swapped, offsets dropped,
  the int8 tile's two halves of rows swapped: each turns its check red.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from gpu.quant import gemv
from gpu.quant.gguf_blocks import Q4Blocks, cat_blocks
from gpu.quant.linears import Int4Linear, Int8Linear
from tests import kernel_variants

if not gemv.available(torch.float32):
    pytest.skip("the quant_gemv C++ kernels do not build here", allow_module_level=True)

ISAS = list(torch.ops.tierserve_cpu.quant_gemv_isas())
BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
SHAPES = ((576, 576), (576, 960), (576, 1536), (1536, 576), (576, 3072), (576, 200), (576, 8200))  # (K, N)
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 11, 50)  # 50: more than one block of rows (the kernel's 48)
HEAD_ROWS = (1, 4, 11)  # for the 8200-row head, to stay quick


def rows_for(n: int) -> tuple[int, ...]:
    return ROWS if n <= 3072 else HEAD_ROWS


def q4_case(kind: str, k: int, n: int, seed: int = 0) -> tuple[Int4Linear, torch.Tensor, np.ndarray]:
    """A kernel-backed Int4Linear on gguf-quantized blocks and the gguf dequantized weight."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.02 + rng.standard_normal((n, 1)) * 0.01).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[kind])
    ref = torch.from_numpy(np.array(dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32).reshape(n, k))
    layer = Int4Linear(*cat_blocks([Q4Blocks(kind, torch.from_numpy(raw))]), torch.float32, kernels=True)
    return layer, ref, raw


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).abs().max() / ref.abs().max())


def quantized_x(x: torch.Tensor) -> torch.Tensor:
    """x as the 4-bit kernel sees it: per row and group of 32, s * round(x * 127 / max|x|)."""
    groups = x.float().reshape(x.shape[0], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    # NOTE: `127.0 / amax` would be torch's scalar-by-tensor division, computed as 127 times
    # amax's reciprocal: one ulp off the kernel's division, and products that fall on a tie
    # then round the other way (one in ~2e6 values).
    q = torch.round(groups * (torch.full_like(amax, 127.0) / amax)).nan_to_num(0.0)  # all-zero groups stay zeros
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


def q4_outputs(layer: Int4Linear, x: torch.Tensor) -> list[torch.Tensor]:
    outs = [torch.ops.tierserve_cpu.quant_gemv_q4(x, layer.packed, layer.out_features, isa) for isa in ISAS]
    for got in outs:
        assert got.dtype == x.dtype and got.shape == (x.shape[0], layer.out_features)
    return outs


def q4_errors(layer: Int4Linear, ref: torch.Tensor, dtype: torch.dtype, quantize: bool = True) -> list[float]:
    errors = []
    for m in rows_for(layer.out_features):
        x = torch.randn(m, layer.in_features, generator=torch.Generator().manual_seed(m)).to(dtype)
        expected = (quantized_x(x) if quantize else x.double()) @ ref.double().t()
        errors += [relative_error(got, expected.float()) for got in q4_outputs(layer, x)]
    return errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_q4_kernel_matches_gguf_dequantized(kind: str, k: int, n: int, dtype: torch.dtype) -> None:
    layer, ref, _ = q4_case(kind, k, n)
    assert layer.kernel and layer.scales_and_zeros.numel() == 0  # only the kernel's format is kept
    assert max(q4_errors(layer, ref, dtype)) < BOUND[dtype]
    assert max(q4_errors(layer, ref, dtype, quantize=False)) < 2e-2  # what quantizing x costs


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_q4_kernel_is_one_function_of_each_row() -> None:
    """The same bits from every instruction set, for a row alone or among 70 (two row blocks),
    and all-zero or non-finite groups: zeros stay exact, inf / NaN give NaN rows."""
    layer, _, _ = q4_case("Q4_1", 576, 200)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(7))
    x[3, 32:64] = 0.0
    x[5] = 0.0
    x[9, 100] = float("inf")
    x[11, 7] = float("nan")
    outs = q4_outputs(layer, x)
    for other in outs[1:]:
        assert same_bits(other, outs[0])
    alone = torch.cat([torch.ops.tierserve_cpu.quant_gemv_q4(x[i : i + 1], layer.packed, 200) for i in range(70)])
    assert same_bits(alone, outs[0])
    assert torch.equal(outs[0][5], torch.zeros(200)) and outs[0][3].isfinite().all()
    assert outs[0][9].isnan().all() and outs[0][11].isnan().all()
    finite = [i for i in range(70) if i not in (9, 11)]
    assert outs[0][finite].isfinite().all()


def int8_outputs(layer: Int8Linear, x: torch.Tensor) -> list[torch.Tensor]:
    assert layer.kernel_scales is not None
    outs = [torch.ops.tierserve_cpu.quant_gemv_int8(x, layer.packed, layer.kernel_scales, isa) for isa in ISAS]
    for got in outs:
        assert got.dtype == x.dtype and got.shape == (x.shape[0], layer.out_features)
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_int8_kernel_matches_dequantized(k: int, n: int, dtype: torch.dtype) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 0.02
    layer, plain = Int8Linear.quantize(w, dtype, kernels=True), Int8Linear.quantize(w, dtype)
    assert layer.qweight.numel() == 0 and torch.equal(gemv.unpack_int8(layer.packed, n), plain.qweight)
    ref = plain.dequantize().double()  # only the kernel's layout is kept; the torch op's weight as reference
    for m in rows_for(n):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        outs = int8_outputs(layer, x)
        for got in outs:
            assert same_bits(got, outs[0])
            assert relative_error(got, (quantized_x(x) @ ref.t()).float()) < BOUND[dtype]
            assert relative_error(got, (x.double() @ ref.t()).float()) < 2e-2  # what quantizing x costs


def test_int8_kernel_is_one_function_of_each_row() -> None:
    """As the 4-bit one: a row alone or among 70, zeros exact, inf / NaN rows NaN."""
    layer = Int8Linear.quantize(torch.randn(200, 576, generator=torch.Generator().manual_seed(3)) * 0.02, torch.float32,
                                kernels=True)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(7))
    x[5] = 0.0
    x[9, 100] = float("inf")
    outs = int8_outputs(layer, x)
    scales = layer.kernel_scales
    assert scales is not None
    alone = torch.cat([gemv.int8_matmul(x[i : i + 1], layer.packed, scales) for i in range(70)])
    assert same_bits(alone, outs[0])
    assert torch.equal(outs[0][5], torch.zeros(200)) and outs[0][9].isnan().all()
    assert outs[0][[i for i in range(70) if i != 9]].isfinite().all()


def test_auto_runs_a_compiled_path() -> None:
    """'auto' runs a path compiled here: the 512-bit one only where it measured faster than the
    256-bit one (the measurement picks, and every path gives the same bits, tested above)."""
    auto = gemv.auto_isa()
    assert auto in ISAS
    if "vnni512" in ISAS:
        assert auto in ("vnni512", "vnni")
    else:
        assert auto == ISAS[0]


def test_layers_run_the_kernel_and_match_the_torch_ops() -> None:
    """The layer call (any leading shape, a bias) equals the kernel and stays close to torch's op."""
    layer, ref, raw = q4_case("Q4_1", 576, 960)
    torch_op = Int4Linear(*cat_blocks([Q4Blocks("Q4_1", torch.from_numpy(raw))]), torch.float32)
    x, bias = torch.randn(2, 3, 576), torch.randn(960)
    got = layer(x, bias)
    assert torch.equal(got.reshape(6, 960), gemv.q4_matmul(x.reshape(6, 576), layer.packed, 960) + bias)
    assert relative_error(got.reshape(6, 960), torch_op(x.reshape(6, 576), bias)) < 2e-2  # x quantized: see above
    assert relative_error(layer.dequantize(), ref) < 1e-6
    w = torch.randn(960, 576) * 0.02
    rows = x.reshape(6, 576)
    int8 = Int8Linear.quantize(w, torch.float32, kernels=True)
    assert int8.kernel_scales is not None
    assert torch.equal(int8(rows), gemv.int8_matmul(rows, int8.packed, int8.kernel_scales))
    assert relative_error(int8(rows), Int8Linear.quantize(w, torch.float32)(rows)) < 2e-2  # x quantized


@pytest.mark.parametrize(("isas", "flags", "granted", "every_batch"), [
    (["vnni", "avx2", "scalar"], {"avx512_vnni", "avx512_bf16"}, False, True),  # Zen 4: no AMX
    (["vnni", "avx2", "scalar"], {"avx512_vnni", "amx_bf16", "amx_tile"}, True, False),  # bf16 GEMMs on AMX
    (["vnni", "avx2", "scalar"], {"avx512_vnni", "amx_bf16", "amx_tile"}, False, True),  # AMX not granted
    (["avx2", "scalar"], {"avx2"}, False, False),  # vpmaddwd: the crossover
])
def test_int8_takes_every_bf16_batch_only_with_vnni_and_no_amx(monkeypatch: pytest.MonkeyPatch, isas: list[str],
                                                              flags: set[str], granted: bool, every_batch: bool) -> None:
    from gpu import numerics
    from gpu.quant.linears import UNLIMITED

    monkeypatch.setattr(gemv, "compiled_isas", lambda: isas)
    monkeypatch.setattr(numerics, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(numerics, "amx_permitted", lambda: granted)
    assert gemv.int8_outruns_bf16_gemms() == every_batch
    layer = Int8Linear.quantize(torch.randn(32, 64), torch.bfloat16, kernels=True)
    assert layer.max_rows == (UNLIMITED if every_batch else Int8Linear.kernel_max_rows)
    assert Int8Linear.quantize(torch.randn(32, 64), torch.float32, kernels=True).max_rows == 64


@pytest.mark.parametrize(("flags", "granted", "every_batch"), [
    ({"avx512_vnni", "avx512_bf16"}, False, True),  # Zen 4: bf16 GEMMs without AMX
    ({"avx512_vnni", "amx_bf16", "amx_tile"}, True, False),  # bf16 GEMMs on AMX: the dense copy above 24 rows
    ({"avx512_vnni", "amx_bf16", "amx_tile"}, False, True),  # AMX advertised, not granted
    ({"avx2"}, False, True),
])
def test_int4_keeps_a_dense_copy_only_against_bf16_gemms_on_amx(monkeypatch: pytest.MonkeyPatch, flags: set[str],
                                                               granted: bool, every_batch: bool) -> None:
    from gpu import numerics
    from gpu.quant.dispatch import QuantizedWeight, QuantSpec, build_linear
    from gpu.quant.linears import UNLIMITED

    monkeypatch.setattr(numerics, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(numerics, "amx_permitted", lambda: granted)
    assert gemv.bf16_gemms_on_amx() == (not every_batch)
    _, ref, raw = q4_case("Q4_1", 64, 32)
    spec = QuantSpec("int4", {"w": Q4Blocks("Q4_1", torch.from_numpy(raw))}, keep_dense=True, cpu_kernels=True)
    built = build_linear(spec, ["w"], ref.to(torch.bfloat16))
    assert isinstance(built, QuantizedWeight) and isinstance(built.quant, Int4Linear)
    assert built.quant.max_rows == (UNLIMITED if every_batch else Int4Linear.kernel_max_rows_amx)
    assert (built.dense is None) == every_batch  # many-row batches run the dense copy only on AMX
    fp32 = build_linear(spec, ["w"], ref)  # float32 GEMMs never run on AMX tiles
    assert isinstance(fp32, QuantizedWeight) and fp32.dense is None and fp32.quant.max_rows == UNLIMITED


def test_without_kernels_the_torch_ops_run() -> None:
    layer, _, _ = q4_case("Q4_0", 576, 96)
    plain = Int4Linear.quantize(layer.dequantize(), torch.bfloat16)
    assert not plain.kernel and plain.scales_and_zeros.numel() > 0
    assert Int8Linear.quantize(torch.randn(96, 576), torch.bfloat16).kernel_scales is None


def swapped_pairs(nibbles: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    n, k = nibbles.shape
    swapped = nibbles.reshape(n, k // 2, 2).flip(-1).reshape(n, k)
    return ORIGINAL_PACK(swapped, scales, offsets)


def dropped_offsets(nibbles: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return ORIGINAL_PACK(nibbles, scales, torch.zeros_like(offsets))


ORIGINAL_PACK = gemv.pack_q4


@pytest.mark.parametrize("planted", [swapped_pairs, dropped_offsets])
def test_red_planted_packing_bugs(monkeypatch: pytest.MonkeyPatch, planted: object) -> None:
    monkeypatch.setattr(gemv, "pack_q4", planted)
    layer, ref, _ = q4_case("Q4_1", 576, 200)
    assert min(q4_errors(layer, ref, torch.float32)) > 100 * BOUND[torch.float32]


def swapped_halves(q: torch.Tensor) -> torch.Tensor:
    k = q.shape[1]
    packed = ORIGINAL_PACK_INT8(q).reshape(-1, k // 2, 2, 16)
    return packed.flip(2).reshape(-1, k * 16).contiguous()


ORIGINAL_PACK_INT8 = gemv.pack_int8


def test_red_planted_int8_packing_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(200, 576, generator=torch.Generator().manual_seed(5)) * 0.02
    expected_weight = Int8Linear.quantize(w, torch.float32).dequantize().double()  # no kernel: q as it is
    monkeypatch.setattr(gemv, "pack_int8", swapped_halves)
    layer = Int8Linear.quantize(w, torch.float32, kernels=True)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(6))
    assert relative_error(int8_outputs(layer, x)[0], (quantized_x(x) @ expected_weight.t()).float()) > 100 * BOUND[torch.float32]


@kernel_variants.opt_in
@pytest.mark.parametrize("target", list(kernel_variants.TARGETS))
def test_code_paths_of_other_cpus(target: str, tmp_path: Path) -> None:
    """This file's tests again with the kernels built for other CPUs (AVX2-only, plain
    x86-64, AVX-512 with VNNI but no AMX): opt-in, tests/kernel_variants.py."""
    kernel_variants.run_for(target, __file__, tmp_path)
