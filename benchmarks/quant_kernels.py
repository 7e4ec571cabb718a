"""torch's weight-only quantized ops vs tierserve's C++ kernels (gpu/quant/gemv.py), warm and
cold, per shape; run through benchmarks/quant_linear.py --kernels."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from gpu.quant import gemv
from gpu.quant.linears import Int4Linear, Int8Linear

EVICT_MB = 768  # touched before every cold call: beyond the last-level cache of the machines we use


def timed_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def build_cases(m: int, k: int, n: int) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (call, weight bytes it reads), all on the same random bfloat16 weight."""
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.02
    x = torch.randn(m, k).bfloat16()
    wb = w.bfloat16()
    i8, i4 = Int8Linear.quantize(w, torch.bfloat16), Int4Linear.quantize(w, torch.bfloat16)
    k8, k4 = Int8Linear.quantize(w, torch.bfloat16, kernels=True), Int4Linear.quantize(w, torch.bfloat16, kernels=True)
    return {
        "bf16": (lambda: F.linear(x, wb), wb.nbytes),
        "int8 op": (lambda: i8(x), i8.nbytes()),
        "int8 k": (lambda: k8(x), k8.nbytes()),
        "int4 op": (lambda: i4(x), i4.nbytes()),
        "int4 k": (lambda: k4(x), k4.nbytes()),
    }


def measure(cases: dict[str, tuple[Callable[[], object], int]], rounds: int, evict: list[torch.Tensor] | None) -> dict[str, float]:
    """Interleaved round-robin; the best time of each (robust to a shared machine's stalls)."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn, _ in cases.values():
        fn()
    for _ in range(rounds):
        for name, (fn, _) in cases.items():
            for t in evict or ():
                t.add_(1)
            times[name].append(timed_ms(fn))
    return {name: min(t) for name, t in times.items()}


def bench_kernels(ms: Sequence[int], shapes: Sequence[tuple[int, int]], rounds: int) -> None:
    if not gemv.available(torch.bfloat16):
        raise SystemExit("the quant_gemv C++ kernels do not build here")
    evict = [torch.ones((64 << 20) // 4) for _ in range(EVICT_MB // 64)]
    print(f"threads {torch.get_num_threads()}; ms (best of {rounds}), GB/s = weight bytes / time")
    print(f"{'M':>3} {'K':>5} {'N':>6} {'cache':>5} | {'bf16':>7} {'int8 op':>7} {'int8 k':>7} {'int4 op':>7} {'int4 k':>7}"
          f" | {'i8 op/k':>7} {'i4 op/k':>7} | {'i8k GB/s':>8} {'i4k GB/s':>8}")
    with torch.inference_mode():
        for m in ms:
            for k, n in shapes:
                cases = build_cases(m, k, n)
                for label, junk in (("warm", None), ("cold", evict)):
                    t = measure(cases, rounds, junk)
                    gbs = {name: cases[name][1] / t[name] / 1e6 for name in cases}
                    print(f"{m:>3} {k:>5} {n:>6} {label:>5} | " + " ".join(f"{t[c]:7.3f}" for c in cases)
                          + f" | {t['int8 op'] / t['int8 k']:7.2f} {t['int4 op'] / t['int4 k']:7.2f}"
                          + f" | {gbs['int8 k']:8.1f} {gbs['int4 k']:8.1f}", flush=True)
