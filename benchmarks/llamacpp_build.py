"""llama.cpp's `llama-server` and `llama-quantize`, built once from the tree vendored in a
pinned `llama-cpp-python` sdist and cached (`$TIERSERVE_BENCH_CACHE`, default
~/.cache/tierserve-bench); later runs reuse the binaries and the requantized models.

Built with the machine's native flags (so AVX-512/BF16 here, AVX2 on an AVX2-only AMD
machine) but never AMX: these VMs advertise AMX in cpuid and trap on its first tile
instruction. `-march=native` alone would enable it, so the AMX ISA flags are switched off
explicitly and the linked binary is disassembled to prove that no tile instruction is in
it (the result is cached beside the binary).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

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

    @property
    def source(self) -> Path:
        return self.root / "vendor" / "llama.cpp"

    @property
    def build_dir(self) -> Path:
        return self.root / "build"

    def binary(self, name: str) -> Path:
        return self.build_dir / "bin" / name

    @property
    def models(self) -> Path:
        return self.root / "models"


def cache_root() -> Path:
    return Path(os.environ.get("TIERSERVE_BENCH_CACHE", "~/.cache/tierserve-bench")).expanduser()


def fetch_source(cache: Path) -> LlamaCpp:
    """Download the pinned sdist with pip and unpack its vendored llama.cpp (once)."""
    tree = LlamaCpp(cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}")
    if (tree.source / "CMakeLists.txt").exists():
        return tree
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not archive.exists():
        print(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist (vendored llama.cpp)")
        run_checked([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                     f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(cache)])
    prefix = f"{tree.root.name}/vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(cache, members=members, filter="data")
    return tree


def run_checked(cmd: list[str], **kwargs: object) -> str:
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return str(done.stdout)


def compiler_accepts(flags: tuple[str, ...]) -> bool:
    """An old compiler without AMX flags can't emit AMX either; then the flags are left out."""
    probe = subprocess.run(["cc", *flags, "-x", "c", "-E", "-"], check=False, input="", capture_output=True, text=True)
    return probe.returncode == 0


def cmake_args(tree: LlamaCpp) -> list[str]:
    no_amx = " ".join(NO_AMX) if compiler_accepts(NO_AMX) else ""
    return [
        "cmake", "-S", str(tree.source), "-B", str(tree.build_dir), "-G", "Ninja",
        "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
        # The GGML_AMX_* switches only matter without GGML_NATIVE; the ISA flags stop -march=native.
        "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
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


def check_no_amx(binary: Path) -> None:
    """Disassemble once; a binary with a tile instruction would trap on these VMs."""
    stamp = binary.with_name(binary.name + ".no-amx")
    if stamp.exists() and stamp.stat().st_mtime >= binary.stat().st_mtime:
        return
    dump = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(binary)], check=False, capture_output=True)
    if dump.returncode != 0:
        print(f"warning: objdump failed on {binary.name}; AMX-free build not verified")
        return
    if found := sorted({m.decode() for m in AMX_MNEMONIC.findall(dump.stdout)}):
        raise SystemExit(f"{binary} contains AMX instructions {found}; it would trap here")
    stamp.touch()


def build(cache: Path, jobs: int, show_progress: bool, targets: tuple[str, ...] = TARGETS) -> LlamaCpp:
    """The pinned tree with `targets` built (only those: one configure serves every caller);
    the first target is the one smoke-checked with `--version`."""
    tree = fetch_source(cache)
    if not (tree.build_dir / "build.ninja").exists():
        print(f"configuring llama.cpp (llama-cpp-python {LLAMA_CPP_PYTHON}) in {tree.build_dir}")
        run_checked(cmake_args(tree))
    # Built once: delete the build folder to rebuild (ninja would re-run the server's
    # always-dirty UI step on every call).
    if not all(tree.binary(t).exists() for t in targets):
        print(f"building {', '.join(targets)} with {jobs} jobs (once; cached in {tree.root})")
        compile_targets(tree, jobs, show_progress, targets)
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
