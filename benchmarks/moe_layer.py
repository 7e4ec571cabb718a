"""One MoE layer's routed experts: `moe: cpu` (the C++ op) against `moe: torch`, same process.

Random experts shaped like benchmarks/moe.py's model (40 experts, hidden 1024, width 512,
top 6), random routing; for each dtype, expert format (`--formats`: dense, or int8 / int4
in the C++ kernels' tiles, as `model.quantization` builds them) and token count, the best
of `--runs` timed calls of each implementation and their ratio. The torch side runs the
model's linear (float: the few-row C++ GEMV up to its row limit, F.linear beyond;
quantized: the layers' own op), as the engine does outside deterministic mode.

    .venv/bin/python benchmarks/moe_layer.py
    .venv/bin/python benchmarks/moe_layer.py --tokens 1 8 32 --dtypes bfloat16 --formats dense int4
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu.kernels import cpu
from gpu.moe.cpu_moe import KERNELS, CpuMoE
from gpu.moe.routing import softmax_topk
from gpu.moe.torch_moe import Experts, TorchMoE
from gpu.quant import few_rows
from gpu.quant.dispatch import LinearWeight, QuantizedWeight, make_linear
from gpu.quant.linears import Int4Linear, Int8Linear


def best_ms(fn: Callable[[], object], runs: int) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def weight(rows: int, cols: int, dtype: torch.dtype, form: str) -> LinearWeight:
    w = torch.randn(rows, cols) * 0.03
    if form == "dense":
        return w.to(dtype)
    layer = (Int8Linear if form == "int8" else Int4Linear).quantize(w, dtype, kernels=True)
    return QuantizedWeight(layer, None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=40)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--formats", nargs="+", choices=("dense", "int8", "int4"), default=["dense", "int8", "int4"])
    p.add_argument("--runs", type=int, default=10)
    args = p.parse_args()
    if not (cpu.load(KERNELS) and cpu.load(few_rows.KERNELS)):
        raise SystemExit("the C++ CPU kernels did not build here")
    torch.manual_seed(0)
    linear = make_linear(F.linear, False, few_rows.linear)
    reference = TorchMoE()
    print(f"{args.experts} experts [{2 * args.width} x {args.hidden}] + [{args.hidden} x {args.width}], "
          f"top {args.top_k}; torch threads {torch.get_num_threads()}; best of {args.runs}, ms")
    print("dtype    | experts | tokens | moe: torch | moe: cpu | torch / cpu")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for form in args.formats:
            experts = Experts(
                gate_up=[weight(2 * args.width, args.hidden, dtype, form) for _ in range(args.experts)],
                down=[weight(args.hidden, args.width, dtype, form) for _ in range(args.experts)],
            )
            op = CpuMoE()
            for tokens in args.tokens:
                x = torch.randn(tokens, args.hidden, dtype=dtype)
                routing = softmax_topk(torch.randn(tokens, args.experts, dtype=dtype), args.top_k, True)
                if op.plan(x, experts) is None:
                    print(f"{name:8} | {form:7} | {tokens:6} | (moe: cpu runs torch's path here)")
                    continue
                torch_ms = best_ms(lambda x=x, r=routing, e=experts: reference(linear, x, r, e), args.runs)  # type: ignore[misc]
                op_ms = best_ms(lambda x=x, r=routing, e=experts, m=op: m(linear, x, r, e), args.runs)  # type: ignore[misc]
                print(f"{name:8} | {form:7} | {tokens:6} | {torch_ms:10.2f} | {op_ms:8.2f} | {torch_ms / op_ms:10.2f}x",
                      flush=True)


if __name__ == "__main__":
    main()
