"""tierserve's C++ CPU kernels, built on this machine on first use.

Each `<name>.cpp` in this folder (with the headers of this folder it includes) is one
extension, compiled by torch's JIT extension loader (`torch.utils.cpp_extension.load`)
with `-O3 -march=native -ffp-contract=off` (AMX off: it traps on some VMs) and OpenMP, and cached under
`~/.cache/tierserve/cpu_kernels` (or `$TIERSERVE_CACHE/cpu_kernels`), keyed by the
sources, the flags, the CPU, torch's and Python's versions; a later start loads the cached
library in well under a second.

The cache keeps one entry per key, `cpu_kernels/<name>-<key>/`, written once and never
rebuilt or replaced by another key's build: every install on the machine with the same key
(a checkout's `.venv`, another environment) loads the same library, and installs whose
keys differ keep their entries side by side (old ones stay; delete the folder to reclaim
them). An entry is compiled in a private folder and published with one rename, so a
concurrent build of the same key never sees a half-built entry. Its ops register themselves as `torch.ops.tierserve_cpu.*`
(`TORCH_LIBRARY_FRAGMENT(tierserve_cpu, m)`), so callers go through the dispatcher like
any aten op.

`model.cpu_kernels: auto` (the default) uses them on CPU outside deterministic mode;
`off`, a machine without a C++ compiler, or a failed build run the plain-torch code
instead (a failed build logs `cpu_kernels_unavailable` once and is not retried in the
process). NOTE: the kernels are not used in deterministic mode, whose bit-exactness
rests on the batch-invariant torch paths — except `gated_delta`, whose arithmetic per
(request, head) is fixed by construction (kernel/numerics_choice.py `use_native_recurrence`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
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
    """Native code for this CPU, without AMX where the compiler knows the switches.

    NOTE: `-ffp-contract=off`: the compiler never fuses a * b + c into one FMA on its own.
    Every FMA the kernels rely on is written out (`std::fma`, intrinsics); left to the
    compiler, fusing depends on how each translation unit inlines and vectorizes the shared
    `*_core.h` code, so the native decode step (decode_step.cpp) and the per-op kernels it
    must equal bit for bit rounded differently on AVX-512 (a Xeon, float32 attention),
    though they agreed on AVX2."""
    no_amx = _NO_AMX if _compiler_accepts(list(_NO_AMX)) else ()
    return build_flags(("-march=native",)) + no_amx  # NOTE: this order: the flags key the cache


def build_flags(target: tuple[str, ...]) -> tuple[str, ...]:
    """The kernels' compiler flags for the CPU that `target` (-march and -m switches) names:
    also how tests build them for another CPU (tests/kernel_variants.py, tests/emulate_cpu)."""
    return ("-O3", *target, "-ffp-contract=off", "-fopenmp")


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


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _headers(source: Path) -> list[Path]:
    """The headers of this folder that `source` includes (`#include "x.h"`), directly or
    through another one: the sources of its build besides itself."""
    found: list[Path] = []
    todo = [source]
    while todo:
        for name in _LOCAL_INCLUDE.findall(todo.pop().read_text(encoding="utf-8")):
            header = source.parent / name
            if header.is_file() and header not in found:
                found.append(header)
                todo.append(header)
    return sorted(found)


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


def entry_dir(name: str, key: str) -> Path:
    """The cache entry of kernel `name` built with `key`: one folder per (name, key)."""
    return cache_dir() / f"{name}-{key}"


def library_path(name: str, key: str) -> Path:
    """The shared library an entry holds (the name torch's loader gives it)."""
    return entry_dir(name, key) / f"tierserve_{name}_{key}.so"


def switched_off() -> bool:
    """`TIERSERVE_CPU_KERNELS=off`: the operator's switch (and the suite's, to run its torch
    fallback everywhere): no kernel loads, as if none built, and `model.cpu_kernels` is off."""
    return os.environ.get("TIERSERVE_CPU_KERNELS", "").strip().lower() == "off"


def load(name: str) -> bool:
    """Load the cached build of `<name>.cpp` (building it first if this key has no entry);
    True when its ops are registered. False, building nothing, while switched off."""
    return not switched_off() and _load(name)


@functools.cache
def _load(name: str) -> bool:
    source = SOURCES / f"{name}.cpp"
    started = time.perf_counter()
    try:
        key = _digest(source)
        library = library_path(name, key)
        if library.is_file():
            _load_library(library)
            built = False
        else:
            _build_entry(name, key, source)
            built = True
    except Exception as exc:  # noqa: BLE001 - any build failure means: run the torch code
        log.warning("cpu_kernels_unavailable", kernels=name, reason=str(exc).strip().splitlines()[-1:])
        return False
    log.info("cpu_kernels_ready", kernels=name, built=built, seconds=round(time.perf_counter() - started, 2))
    return True


def _load_library(library: Path) -> None:
    torch.ops.load_library(str(library))


def _build_entry(name: str, key: str, source: Path) -> None:
    """Compile `source` in a private folder beside the entries, load it, and publish the
    folder as the key's entry with one rename (or drop it where a concurrent build of the
    same key published first: both builds are of the same key, so either is the entry)."""
    entry = entry_dir(name, key)
    entry.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".build-{entry.name}-", dir=entry.parent))
    work.chmod(0o755)  # mkdtemp's 0700 would hide the entry from other users of a shared cache
    try:
        # Compiled from a copy in the build folder, so the build never depends on (nor is
        # redone for) the path of the checkout or install it came from.
        for file in (source, *_headers(source)):
            shutil.copyfile(file, work / file.name)
        _compile(f"tierserve_{name}_{key}", work / source.name, work)
        _publish(work, entry, library_path(name, key))
    finally:
        # The library stays mapped once loaded, so dropping a losing build is safe.
        shutil.rmtree(work, ignore_errors=True)


def _publish(work: Path, entry: Path, library: Path) -> None:
    """Rename `work` to `entry`. A complete entry (its library there) is never replaced;
    a folder without one (left by a failed or interrupted build) is moved aside first."""
    for _ in range(2):
        try:
            os.rename(work, entry)  # fails where `entry` exists and is not empty
            return
        except OSError:
            if library.is_file():
                log.info("cpu_kernels_entry_exists", entry=str(entry))  # a concurrent build won
                return
        leftover = Path(tempfile.mkdtemp(prefix=f".stale-{entry.name}-", dir=entry.parent))
        try:
            os.rename(entry, leftover / entry.name)
        except OSError:
            pass  # another process moved it, or published meanwhile: try again
        shutil.rmtree(leftover, ignore_errors=True)


def _compile(module: str, source: Path, build: Path) -> None:
    """torch's JIT loader: compile and link `source` in `build` with ninja, then load it."""
    from torch.utils import cpp_extension

    _ensure_ninja_on_path()
    cpp_extension.load(
        name=module, sources=[str(source)], extra_cflags=list(cflags()), extra_ldflags=["-fopenmp"],
        build_directory=str(build), is_python_module=False, verbose=False,
    )


def names() -> list[str]:
    """Every kernel extension of this folder."""
    return sorted(p.stem for p in SOURCES.glob("*.cpp"))
