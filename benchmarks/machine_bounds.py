"""What this machine can do at best, measured here, and how close a run came to it.

Two bounds, both measured by torch in this process before any server starts:
- compute: matmul GFLOP/s at prefill shapes (a 512-token chunk through SmolLM2-sized
  linears), in fp32 and bf16, all intra-op threads; a serving run's achieved rate is
  2 x parameters x (prompt + output tokens) / wall time (attention's own FLOPs left out:
  at 100-300-token prompts they are a few per cent, so the fraction is slightly low).
- bandwidth: reading a tensor far larger than the caches (a sum), GB/s. Batch-1 decode
  reads every weight once per token, so its bound is bandwidth / weight bytes per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Prefill chunk x hidden, hidden x MLP width: the shape of most of SmolLM2's prefill FLOPs.
MATMUL_SHAPE = (512, 576, 1536)
READ_BYTES = 1 << 30  # 1 GiB: well past any last-level cache


@dataclass(frozen=True)
class Bounds:
    fp32_gflops: float
    bf16_gflops: float
    read_gb_s: float

    def gflops_for(self, dtype: str) -> float:
        """The compute bound of a system whose matmuls run `dtype`: a GGUF type name, a torch
        dtype name, or tierserve's `<compute dtype>+<quantization>` (its prefill runs the
        dense copy in the compute dtype, so that dtype's rate).

        float32: fp32's rate. Anything else — bf16, and 4-bit and 8-bit GGUF weights, which
        have no torch matmul of their own here (llama.cpp multiplies them as int8 dot
        products) — the fastest measured rate: where bf16 is emulated (AVX2-only CPUs, ~1
        GFLOP/s) a bf16 system converts to float32, and fp32's rate bounds it.
        """
        if dtype.split("+")[0].upper() in ("F32", "FLOAT32", "FP32"):
            return self.fp32_gflops
        return max(self.fp32_gflops, self.bf16_gflops)


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first-touch pages, thread pool start
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)  # a shared machine only ever makes a run slower


def matmul_gflops(dtype: torch.dtype, repeats: int = 20) -> float:
    m, k, n = MATMUL_SHAPE
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    inner = 8  # several matmuls per timing: one is ~1 ms, too close to the timer's noise
    seconds = best_seconds(lambda: [torch.mm(a, b) for _ in range(inner)], repeats)
    return 2 * m * k * n * inner / seconds / 1e9


def read_gb_s(repeats: int = 5) -> float:
    x = torch.ones(READ_BYTES // 4, dtype=torch.float32)
    return READ_BYTES / best_seconds(lambda: x.sum(), repeats) / 1e9


def measure() -> Bounds:
    return Bounds(matmul_gflops(torch.float32), matmul_gflops(torch.bfloat16), read_gb_s())


def achieved_gflops(params: int, tokens: int, seconds: float) -> float:
    """Forward FLOPs of `tokens` tokens (prompt + output) through `params` weights, per second."""
    return 2 * params * tokens / seconds / 1e9


def compute_fraction(params: int, tokens: int, seconds: float, bound_gflops: float) -> float:
    return achieved_gflops(params, tokens, seconds) / bound_gflops


def decode_bound_tok_s(weight_bytes: int, read_gb: float) -> float:
    """Batch-1 decode can't beat one full read of the weights per token."""
    return read_gb * 1e9 / weight_bytes


def bandwidth_fraction(decode_tok_s: float, weight_bytes: int, read_gb: float) -> float:
    return decode_tok_s / decode_bound_tok_s(weight_bytes, read_gb)
