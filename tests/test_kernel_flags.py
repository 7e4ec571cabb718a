"""The C++ kernels' compiler flags never let the compiler fuse a * b + c on its own
(gpu/kernels/cpu/__init__.py `cflags`, `-ffp-contract=off`).

Why it matters: the native decode step and the per-op kernels compile the same `*_core.h`
code in different translation units; with fusing left to the compiler, each unit fused
where its inlining and vectorization allowed, and on an AVX-512 Xeon the step's float32
attention stopped being bit-identical to the op's (tests/test_cpu_decode_step.py went red
there, while AVX2 machines agreed). Here a one-line function is compiled with the kernels'
flags and run on inputs where a fused and an unfused a * b + c round apart; the red test
compiles it with contraction allowed and shows the difference is visible.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpu.kernels import cpu

SOURCE = 'extern "C" float mul_add(float a, float b, float c) { return a * b + c; }\n'
# a * b = 1 + 2^-11 + 2^-24 exactly; rounded to float32 (a tie, to even) it is 1 + 2^-11, so
# mul then add gives 0 while one fused multiply-add keeps 2^-24.
A = B = 1.0 + 2.0**-12
C = -(1.0 + 2.0**-11)

CXX = os.environ.get("CXX", "c++")
pytestmark = pytest.mark.skipif(shutil.which(CXX) is None, reason="no C++ compiler")


def mul_add_built_with(flags: list[str], folder: Path) -> float:
    source, library = folder / "mul_add.cpp", folder / "mul_add.so"
    source.write_text(SOURCE)
    subprocess.run([CXX, *flags, "-shared", "-fPIC", str(source), "-o", str(library)], check=True)
    fn = ctypes.CDLL(str(library)).mul_add
    fn.restype = ctypes.c_float
    fn.argtypes = [ctypes.c_float] * 3
    return float(fn(A, B, C))


def without_fma_fusing(flags: list[str], folder: Path) -> None:
    got = mul_add_built_with(flags, folder)
    if got != 0.0:
        raise AssertionError(f"a * b + c compiled with {flags} was fused into one FMA (gave {got!r}, unfused 0.0)")


def test_the_kernels_flags_keep_multiply_and_add_apart(tmp_path: Path) -> None:
    without_fma_fusing(list(cpu.cflags()), tmp_path)


def test_red_flags_that_allow_contraction_fuse(tmp_path: Path) -> None:
    flags = [f for f in cpu.cflags() if not f.startswith("-ffp-contract")] + ["-ffp-contract=fast", "-mfma"]
    with pytest.raises(AssertionError, match="was fused into one FMA"):
        without_fma_fusing(flags, tmp_path)
