"""llama.cpp's `llama-server` and `llama-quantize`, built once from the tree vendored in a
pinned `llama-cpp-python` sdist and cached (`$TIERSERVE_BENCH_CACHE`, default
~/.cache/tierserve-bench); later runs reuse the binaries and the requantized models.

Built with the machine's native flags (so AVX-512/BF16 here, AVX2 on an AVX2-only AMD
machine) but without AMX: some VMs advertise AMX in cpuid and trap on its first tile
instruction. `-march=native` alone would enable it, so the AMX ISA flags are switched off
explicitly and the linked binary is disassembled to prove that no tile instruction is in
it (the result is cached beside the binary).

Where the CPU advertises AMX, `build_amx` builds a second tree (`build-amx/`) with it, the
peer an AMX machine deserves (ggml's AMX int8 kernels for Q4_0 / Q4_1 / Q8_0 weights), once
a probe has run tile instructions in a child process (`amx_runs`: it traps there, not in a
server); it returns None with the reason where the CPU does not grant AMX.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from benchmarks.serving import Progress

LLAMA_CPP_PYTHON = "0.3.36"  # the pinned sdist; its vendor/llama.cpp is what gets built
TARGETS = ("llama-server", "llama-quantize")
NO_AMX = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
# Every AMX instruction mnemonic objdump prints (tile config, loads/stores, dot products).
AMX_MNEMONIC = re.compile(rb"\b(ldtilecfg|sttilecfg|tileloadd|tileloaddt1|tilestored|tilezero|tilerelease|tdp\w+)\b")
NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")


@dataclass(frozen=True)
class LlamaCpp:
    root: Path  # the extracted sdist
    amx: bool = False  # built with AMX (build-amx/), else with the AMX flags switched off
    avx2: bool = False  # built for AVX2-only CPUs (build-avx2/): GGML_NATIVE off, ggml's x86-64 AVX2 set

    @property
    def source(self) -> Path:
        return self.root / "vendor" / "llama.cpp"

    @property
    def build_dir(self) -> Path:
        return self.root / ("build-amx" if self.amx else "build-avx2" if self.avx2 else "build")

    def binary(self, name: str) -> Path:
        return self.build_dir / "bin" / name

    @property
    def models(self) -> Path:
        return self.root / "models"


def cache_root() -> Path:
    return Path(os.environ.get("TIERSERVE_BENCH_CACHE", "~/.cache/tierserve-bench")).expanduser()


def fetch_source(cache: Path, only: tuple[str, ...] = ("",)) -> LlamaCpp:
    """Download the pinned sdist with pip and unpack its vendored llama.cpp (once); `only`:
    just those paths under it (CONVERTER: the Python converter)."""
    tree = LlamaCpp(cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}")
    # NOTE: a marker per selection, written after the whole extraction, so an interrupted
    # unpack is redone rather than half-used; the full tree serves every selection.
    marker = tree.root / (".extracted-" + hashlib.sha1("\0".join(only).encode()).hexdigest()[:12])
    full = tree.root / (".extracted-" + hashlib.sha1(b"").hexdigest()[:12])
    if marker.exists() or full.exists():
        return tree
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not archive.exists():
        print(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist (vendored llama.cpp)")
        run_checked([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                     f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(cache)])
    prefixes = tuple(f"{tree.root.name}/vendor/llama.cpp/{path}" for path in only)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefixes)]
        tar.extractall(cache, members=members, filter="data")
    marker.touch()
    return tree


# The pinned converter and what it imports from its own tree (its gguf-py comes first on its path).
CONVERTER = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


# One Python process runs the converter once per job: its imports (torch, transformers:
# ~4 s on a 2-core machine) are paid once, not per file. `prelude` runs first (a caller's
# fix-up of a library the converter uses). Each run is the script as `__main__` with its
# own argv; a SystemExit of 0 or None is a finished run.
CONVERT_MANY = """
import json, os, runpy, sys
script, jobs = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, os.path.dirname(script))
for argv in jobs:
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise
"""


class Conversion(NamedTuple):
    folder: Path
    out: Path
    args: tuple[str, ...] = ("--outtype", "f32")  # the converter's other flags


def convert_hf(folder: Path, out: Path, outtype: str = "f32", cache: Path | None = None) -> Path:
    """A Hugging Face checkpoint folder converted to GGUF by the pinned llama.cpp's
    `convert_hf_to_gguf.py` (its tokenizer must be one the converter knows)."""
    convert_many([Conversion(folder, out, ("--outtype", outtype))], cache=cache)
    return out


def convert_many(jobs: Sequence[Conversion], prelude: str = "", cache: Path | None = None) -> None:
    """Every job's folder converted to its `out` file, in order, in one converter process."""
    tree = fetch_source(cache or cache_root(), CONVERTER)
    argv = [[str(job.folder), "--outfile", str(job.out), *job.args] for job in jobs]
    run_checked([sys.executable, "-c", prelude + CONVERT_MANY, str(tree.source / CONVERTER[0]), json.dumps(argv)])


def run_checked(cmd: list[str], **kwargs: object) -> str:
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    if done.returncode != 0:
        shown = " ".join("<inline script>" if "\n" in arg else arg for arg in cmd[:4])
        raise SystemExit(f"{shown} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return str(done.stdout)


def compiler_accepts(flags: tuple[str, ...]) -> bool:
    """An old compiler without AMX flags can't emit AMX either; then the flags are left out."""
    probe = subprocess.run(["cc", *flags, "-x", "c", "-E", "-"], check=False, input="", capture_output=True, text=True)
    return probe.returncode == 0


def cmake_args(tree: LlamaCpp) -> list[str]:
    no_amx = " ".join(NO_AMX) if compiler_accepts(NO_AMX) and not tree.amx else ""
    return [
        "cmake", "-S", str(tree.source), "-B", str(tree.build_dir), "-G", "Ninja",
        # Without GGML_NATIVE, ggml enables SSE4.2, AVX, AVX2, BMI2, FMA and F16C: a Haswell-class CPU.
        "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", f"-DGGML_NATIVE={'OFF' if tree.avx2 else 'ON'}",
        # The GGML_AMX_* switches only matter without GGML_NATIVE; the ISA flags stop -march=native.
        *(f"-DGGML_AMX_{part}={'ON' if tree.amx else 'OFF'}" for part in ("TILE", "INT8", "BF16")),
        f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}",
        "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",  # no downloads
        "-DLLAMA_OPENSSL=OFF",
    ]


def compile_targets(tree: LlamaCpp, jobs: int, show: bool, targets: tuple[str, ...] = TARGETS) -> None:
    """ninja, with its `[n/N]` lines turned into a progress bar."""
    cmd = ["ninja", "-C", str(tree.build_dir), f"-j{jobs}", *targets]
    progress = Progress("llama.cpp", 1, show)
    tail: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail = (tail + [line])[-40:]
            if m := NINJA_STEP.match(line):
                progress.total, progress.done = int(m[2]), int(m[1]) - 1
                progress.tick()
    progress.close()
    if proc.returncode != 0:
        raise SystemExit("llama.cpp build failed:\n" + "".join(tail))


def tile_mnemonics(binary: Path) -> list[str] | None:
    """The AMX instructions in `binary` (None where objdump fails)."""
    dump = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(binary)], check=False, capture_output=True)
    return sorted({m.decode() for m in AMX_MNEMONIC.findall(dump.stdout)}) if dump.returncode == 0 else None


def check_no_amx(binary: Path) -> None:
    """Disassemble once; a binary with a tile instruction would trap on these VMs."""
    stamp = binary.with_name(binary.name + ".no-amx")
    if stamp.exists() and stamp.stat().st_mtime >= binary.stat().st_mtime:
        return
    found = tile_mnemonics(binary)
    if found is None:
        print(f"warning: objdump failed on {binary.name}; AMX-free build not verified")
        return
    if found:
        raise SystemExit(f"{binary} contains AMX instructions {found}; it would trap here")
    stamp.touch()


def build(
    cache: Path, jobs: int, show_progress: bool, targets: tuple[str, ...] = TARGETS, amx: bool = False,
    avx2: bool = False,
) -> LlamaCpp:
    """The pinned tree with `targets` built (only those: one configure serves every caller);
    the first target is the one smoke-checked with `--version`. `avx2`: for AVX2-only CPUs,
    the peer of tierserve run as one (tests/emulate_cpu, TIERSERVE_EMULATE_CPU=avx2)."""
    tree = LlamaCpp(fetch_source(cache).root, amx, avx2)
    if not (tree.build_dir / "build.ninja").exists():
        print(f"configuring llama.cpp (llama-cpp-python {LLAMA_CPP_PYTHON}) in {tree.build_dir}")
        run_checked(cmake_args(tree))
    # Built once: delete the build folder to rebuild (ninja would re-run the server's
    # always-dirty UI step on every call).
    if not all(tree.binary(t).exists() for t in targets):
        print(f"building {', '.join(targets)} with {jobs} jobs (once; cached in {tree.root})")
        compile_targets(tree, jobs, show_progress, targets)
    if not amx:  # the AMX build's tile instructions are checked by build_amx instead
        for target in targets:
            check_no_amx(tree.binary(target))
    smoke = [str(tree.binary(targets[0])), "--version"]
    version = subprocess.run(smoke, check=False, capture_output=True, text=True)
    if version.returncode != 0:  # the smoke check: the binary starts on this CPU
        raise SystemExit(f"{targets[0]} --version failed ({version.returncode}): {version.stderr[-500:]}")
    return tree


def requantize(tree: LlamaCpp, source: Path, ftype: str) -> Path:
    """`source` converted to `ftype` (F32, BF16, ...) with llama-quantize, cached by name."""
    out = tree.models / f"{source.stem}.{ftype}.gguf"
    if out.exists():
        return out
    tree.models.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    run_checked([str(tree.binary("llama-quantize")), "--allow-requantize", str(source), str(partial), ftype])
    partial.rename(out)  # a killed run never leaves a half-written model that looks finished
    return out


# ldtilecfg of one 16 x 64-byte tile, tilezero, tilerelease, after asking Linux for the tile
# state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), as ggml does.
AMX_PROBE = r"""
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 3;
  uint8_t cfg[64];
  memset(cfg, 0, sizeof cfg);
  cfg[0] = 1;          /* palette 1 */
  cfg[16] = 64;        /* tile 0: 64 bytes a row */
  cfg[48] = 16;        /* tile 0: 16 rows */
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
  __asm__ volatile("tilezero %%tmm0" ::);
  __asm__ volatile("tilerelease" ::);
  return 0;
}
"""


def amx_runs(work: Path) -> str | None:
    """None where this CPU runs tile instructions (a compiled probe, in a child process),
    else why not."""
    from gpu.numerics import cpu_flags  # the repo is on sys.path for every benchmark

    if not {"amx_tile", "amx_int8"} <= cpu_flags():
        return "the CPU does not advertise AMX"
    work.mkdir(parents=True, exist_ok=True)
    source, probe = work / "amx_probe.c", work / "amx_probe"
    source.write_text(AMX_PROBE)
    built = subprocess.run(["cc", "-O1", "-mamx-tile", str(source), "-o", str(probe)], check=False, capture_output=True, text=True)
    if built.returncode != 0:
        return f"the compiler cannot build the AMX probe: {built.stderr.strip()[-200:]}"
    ran = subprocess.run([str(probe)], check=False, capture_output=True)
    if ran.returncode == 3:
        return "Linux refused the tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    if ran.returncode != 0:
        return f"a tile instruction trapped (probe exit {ran.returncode})"
    return None


def build_amx(cache: Path, jobs: int, show_progress: bool, targets: tuple[str, ...] = TARGETS) -> LlamaCpp | None:
    """The tree built with AMX where the CPU runs it, else None (the reason is printed)."""
    if why := amx_runs(cache / "amx_probe"):
        print(f"no AMX llama.cpp build: {why}")
        return None
    tree = build(cache, jobs, show_progress, targets, amx=True)
    if not tile_mnemonics(tree.binary(targets[0])):
        print("no AMX llama.cpp build: the compiler emitted no tile instruction with -march=native")
        return None
    return tree
