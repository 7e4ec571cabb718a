"""Run a kernel test file again with the C++ kernels built for another CPU than this one
(opt-in: `TIERSERVE_KERNEL_VARIANTS=1`, ~30-60 s of build per target), in a child process
with its own kernel cache, so the code paths of CPUs the suite's machine is not (AVX2-only,
plain x86-64, an AVX-512 CPU without AMX) are checked against the same references here.
The targets must be ones this CPU can execute."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpu.numerics import cpu_flags

# id -> the -march flags of the build (the rest of cpu.cflags() stays)
TARGETS = {
    "avx2": ("-march=haswell",),
    "scalar": ("-march=x86-64",),
    # Zen 4-like (GCC 12 has no znver4): AVX-512 with VNNI and BF16, no AMX
    "avx512-no-amx": ("-march=znver3", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512cd",
                      "-mavx512vnni", "-mavx512bf16"),
}

RUN = """
import functools, sys
import pytest
import gpu.kernels.cpu as cpu
march = {march!r}
cpu.cflags = functools.cache(lambda: cpu.build_flags(march))
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", {test!r}, "-k", "not engine and not other_cpus"]))
"""

opt_in = pytest.mark.skipif(os.environ.get("TIERSERVE_KERNEL_VARIANTS") != "1", reason="set TIERSERVE_KERNEL_VARIANTS=1")


def run_for(target: str, test_file: str, cache: Path) -> None:
    """`test_file`'s tests (but engine and variant tests) with the kernels built for `target`."""
    march = TARGETS[target]
    needed = {"avx512f", "avx512_vnni", "avx512_bf16"} if target == "avx512-no-amx" else set()
    if not needed <= cpu_flags():
        pytest.skip(f"this CPU cannot run code built for {target}")
    code = RUN.format(march=march, test=test_file)
    env = {**os.environ, "TIERSERVE_CACHE": str(cache)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=Path(__file__).resolve().parent.parent)
