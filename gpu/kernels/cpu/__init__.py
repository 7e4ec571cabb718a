"""tierserve's C++ CPU kernels, built on this machine on first use.

Each `<name>.cpp` in this folder (with the `<name>*.h` headers it may include) is one
extension, compiled by torch's JIT extension loader (`torch.utils.cpp_extension.load`)
with `-O3 -march=native` (AMX off: it traps on some VMs) and OpenMP, and cached under
`~/.cache/tierserve/cpu_kernels` (or `$TIERSERVE_CACHE/cpu_kernels`), keyed by the
sources, the flags, the CPU and torch; a later start loads the cached library in well
under a second. Its ops register themselves as `torch.ops.tierserve_cpu.*`
(`TORCH_LIBRARY_FRAGMENT(tierserve_cpu, m)`), so callers go through the dispatcher like
any aten op.

`model.cpu_kernels: auto` (the default) uses them on CPU outside deterministic mode;
`off`, a machine without a C++ compiler, or a failed build run the plain-torch code
instead (a failed build logs `cpu_kernels_unavailable` once and is not retried in the
process). NOTE: the kernels are never used in deterministic mode, whose bit-exactness
rests on the batch-invariant torch paths.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import structlog
import torch

log = structlog.get_logger("tierserve")

SOURCES = Path(__file__).resolve().parent
_NO_AMX = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")


def cache_dir() -> Path:
    root = os.environ.get("TIERSERVE_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "tierserve") / "cpu_kernels"


@functools.cache
def cflags() -> tuple[str, ...]:
    """Native code for this CPU, without AMX where the compiler knows the switches."""
    flags = ["-O3", "-march=native", "-fopenmp"]
    if _compiler_accepts(list(_NO_AMX)):
        flags += _NO_AMX
    return tuple(flags)


def _compiler_accepts(flags: list[str]) -> bool:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return False
    probe = subprocess.run(
        [cxx, *flags, "-x", "c++", "-fsyntax-only", "-"], input="int main() { return 0; }\n",
        capture_output=True, text=True, check=False,
    )
    return probe.returncode == 0


def _cpu_signature() -> str:
    """What native code depends on: the CPU's flags (and model), not just its name."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _headers(source: Path) -> list[Path]:
    """The headers `<name>.cpp` includes: `<name>*.h` beside it."""
    return sorted(source.parent.glob(f"{source.stem}*.h"))


def _digest(source: Path) -> str:
    h = hashlib.sha256(source.read_bytes())
    for header in _headers(source):
        h.update(header.read_bytes())
    for part in (*cflags(), _cpu_signature(), torch.__version__, sys.version):
        h.update(part.encode())
    return h.hexdigest()[:16]


def _ensure_ninja_on_path() -> None:
    """torch's loader runs `ninja`; a venv's ninja (the `ninja` package) is not on PATH
    unless the venv is activated."""
    if shutil.which("ninja") is None:
        os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def load(name: str) -> bool:
    """Build (or load the cached build of) `<name>.cpp`; True when its ops are registered."""
    from torch.utils import cpp_extension

    source = SOURCES / f"{name}.cpp"
    started = time.perf_counter()
    try:
        _ensure_ninja_on_path()
        build = cache_dir() / f"{name}-{_digest(source)}"
        build.mkdir(parents=True, exist_ok=True)
        # Compiled from a copy inside the build folder: ninja rebuilds when a command line
        # changes, and the checkout's own path would make every checkout rebuild.
        for file in (source, *_headers(source)):
            copy = build / file.name
            if not copy.exists() or copy.read_bytes() != file.read_bytes():
                shutil.copyfile(file, copy)
        cpp_extension.load(
            name=f"tierserve_{name}_{build.name.rsplit('-', 1)[1]}", sources=[str(build / source.name)],
            extra_cflags=list(cflags()), extra_ldflags=["-fopenmp"], build_directory=str(build),
            is_python_module=False, verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure means: run the torch code
        log.warning("cpu_kernels_unavailable", kernels=name, reason=str(exc).strip().splitlines()[-1:])
        return False
    log.info("cpu_kernels_ready", kernels=name, seconds=round(time.perf_counter() - started, 2))
    return True


def names() -> list[str]:
    """Every kernel extension of this folder."""
    return sorted(p.stem for p in SOURCES.glob("*.cpp"))
