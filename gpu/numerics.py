"""Which compute dtype and weight quantization to use, decided from what the machine can do.

`model.dtype: auto` (the default) follows one rule, with no timing at start-up:

- CUDA: bfloat16 where the device supports it (`torch.cuda.is_bf16_supported()`), else float32.
- CPU: bfloat16 where the processor has native bf16 dot products: the `avx512_bf16` flag,
  or AMX (`amx_bf16` + `amx_tile`) that the kernel lets this process use (arch_prctl
  permission for the tile data; asking executes no AMX instruction, so a machine that
  advertises AMX and would trap on it cannot crash here). Otherwise float32: on an
  AVX2-only CPU bf16 matmuls are emulated and slower than float32.

`model.quantization: auto` (the default): `int4` when the device is a CPU, torch has the
4-bit CPU op and the checkpoint stores its linears as GGUF Q4_0/Q4_1 blocks (they are
then served as they are, nothing is requantized); otherwise `none`. `int8` is never
picked automatically (it requantizes the checkpoint's weights).
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Collection
from functools import cache

import torch

_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


@cache
def cpu_flags() -> frozenset[str]:
    """The first processor's flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


@cache
def amx_permitted() -> bool:
    """Whether Linux grants this process AMX tile state (a syscall, no AMX instruction)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False


def cpu_has_native_bf16(flags: Collection[str], amx_ok: bool) -> bool:
    if "avx512_bf16" in flags:
        return True
    return {"amx_bf16", "amx_tile"} <= set(flags) and amx_ok


def auto_dtype(device: torch.device) -> str:
    """The `model.dtype` that `auto` resolves to on `device` (the rule in the module doc)."""
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    if cpu_has_native_bf16(cpu_flags(), amx_permitted()):
        return "bfloat16"
    return "float32"


def int4_op_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


def int8_op_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def auto_quantization(device: torch.device, has_q4_blocks: bool) -> str:
    """The `model.quantization` that `auto` resolves to (the rule in the module doc)."""
    if device.type == "cpu" and has_q4_blocks and int4_op_available():
        return "int4"
    return "none"
