"""Run anything (the whole suite, a server, a benchmark) as a CPU of another class would,
on a machine whose CPU can execute that class's code:

    TIERSERVE_EMULATE_CPU=avx2 PYTHONPATH=tests/emulate_cpu .venv/bin/python -m pytest -n 2 tests

Python imports this file at start-up (it is a `sitecustomize` on PYTHONPATH), so every
process the command starts (pytest workers, the servers the tests spawn) sees the same
machine. For the class named by TIERSERVE_EMULATE_CPU:
- the CPU flags the project reads (`gpu.numerics.cpu_flags`) lose what the class lacks, so
  the dtype, quantization and kernel choices are the class's (float32 without AVX512-BF16);
- the C++ kernels are built for the class (`gpu.kernels.cpu.cflags`; their cache is keyed
  by the flags, so each class's build is kept beside the native one).
For `avx2` also set ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (torch's own kernels).

Classes: `avx2` (AVX2 + FMA only: the AVX2 AMD EPYCs), `skylake` (AVX-512 F/CD/BW/DQ/VL, no
VNNI or BF16), `avx512-no-bf16` (this CPU less AVX512-BF16: an Ice Lake / Cascade Lake-like
Xeon). Test tooling: nothing in the product reads the variable.
"""

from __future__ import annotations

import functools
import os

_CLASSES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # class -> (flag prefixes it lacks, -march flags of its kernel build)
    "avx2": (("avx512", "amx", "avx_vnni"), ("-march=haswell",)),
    "skylake": (("avx512_", "avx512ifma", "avx512vbmi", "amx", "avx_vnni"), ("-march=skylake-avx512",)),
    "avx512-no-bf16": (("avx512_bf16", "amx"), ("-march=native", "-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-int8",
                                                 "-mno-amx-bf16")),
}


def _emulate(name: str) -> None:
    if name not in _CLASSES:
        raise SystemExit(f"TIERSERVE_EMULATE_CPU={name!r}: one of {', '.join(_CLASSES)}")
    lacks, march = _CLASSES[name]
    import gpu.kernels.cpu as kernels
    from gpu import numerics

    real = numerics.cpu_flags

    @functools.cache
    def cpu_flags() -> frozenset[str]:
        return frozenset(f for f in real() if not f.startswith(lacks))

    numerics.cpu_flags = cpu_flags
    kernels.cflags = functools.cache(lambda: kernels.build_flags(march))


if os.environ.get("TIERSERVE_EMULATE_CPU"):
    _emulate(os.environ["TIERSERVE_EMULATE_CPU"])
