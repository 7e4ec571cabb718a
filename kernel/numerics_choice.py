"""Resolve `model.dtype` and `model.quantization` (either may be `auto`) for one launch.

The rules live in gpu/numerics.py; this module applies them to a config and says why a
requested combination cannot run (a ConfigError naming the key).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import structlog
import torch

from gpu.kernels import cpu as cpu_kernels
from gpu.kernels import gated_delta
from gpu.numerics import auto_dtype, auto_quantization, int4_op_available, int8_op_available
from kernel.config import Config, ConfigError

log = structlog.get_logger("tierserve")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Numerics(NamedTuple):
    dtype: torch.dtype
    quantization: str  # "none" | "int8" | "int4" (resolved)


def resolve_dtype(config: Config, device: torch.device) -> torch.dtype:
    name = config.model.dtype
    return DTYPES[auto_dtype(device) if name == "auto" else name]


def wants_blocks(config: Config) -> bool:
    """Whether the loader should keep a GGUF's raw Q4 blocks (auto may pick int4)."""
    return config.model.quantization in ("auto", "int4")


def resolve_quantization(config: Config, device: torch.device, model_cls: Any, has_q4_blocks: bool) -> str:
    mode = config.model.quantization
    quantizable = bool(getattr(model_cls, "quantizable", False))
    if mode == "auto":
        return auto_quantization(device, has_q4_blocks) if quantizable else "none"
    if mode == "none":
        return mode
    if not quantizable:
        raise ConfigError(f"model.quantization: {mode} is supported for the Llama family only")
    if device.type != "cpu":
        raise ConfigError(f"model.quantization: {mode} runs torch's CPU ops; the model runs on {device.type}")
    if not (int4_op_available() if mode == "int4" else int8_op_available()):
        raise ConfigError(f"model.quantization: {mode} needs a torch with the {mode} CPU matmul op")
    return mode


def use_native_recurrence(config: Config, device: torch.device) -> bool:
    """Whether a Gated DeltaNet model runs its delta rule through the C++ recurrent form
    (gpu/kernels/gated_delta.py `native_varlen`). NOTE: unlike the other C++ kernels, in
    deterministic mode too: its arithmetic per (request, head) is fixed, so a state is the
    same bits however the tokens were batched or chunked."""
    on = config.model.cpu_kernels == "auto" and not cpu_kernels.switched_off()
    return on and gated_delta.native_available(device)


def use_cpu_kernels(config: Config, device: torch.device) -> bool:
    """Whether the model, its quantized linears and the attention backend try tierserve's
    C++ CPU kernels (gpu/kernels/cpu/: each falls back to torch ops if its build fails).

    NOTE: invariant 7: in deterministic mode too, where each consumer takes only the
    kernels whose rows depend on their own inputs alone (the quantized matmuls, the Llama
    glue, paged attention for every token, the native decode step built on them); the
    few-row float GEMV sums in another order than the tiled GEMMs and stays off there."""
    on = config.model.cpu_kernels == "auto" and device.type == "cpu"
    return on and not cpu_kernels.switched_off()


def resolve_moe(config: Config, device: torch.device, cpu_kernels_on: bool) -> str:
    """model.moe resolved (a registered `moe` implementation). NOTE: invariant 7: `cpu`'s
    C++ op sums in its own order (and on AVX2 a row's sums depend on the rows beside it),
    so deterministic mode never runs it; `auto` there is `torch` (or `dense` for graphs)."""
    name = config.model.moe
    if name == "cpu" and config.deterministic:
        raise ConfigError("model.moe: cpu runs outside deterministic mode (its C++ op is not batch-invariant "
                          "on every CPU); use torch, or dense for graphs")
    if name != "auto":
        return name
    if config.graphs.mode in ("emulate", "cuda"):
        return "dense"  # static shapes
    return "cpu" if cpu_kernels_on and device.type == "cpu" and not config.deterministic else "torch"


def resolve_kv_dtype(config: Config, dtype: torch.dtype, device: torch.device, cpu_kernels: bool,
                     attention: str, dense_llama: bool) -> torch.dtype:
    """cache.kv_dtype resolved for a model computing in `dtype` with attention backend
    `attention`. float16 storage needs a float32 model on CPU under the torch backend
    (which widens what it reads); `auto` picks it only where the C++ kernels run a dense
    Llama-family model (the native decode step and the paged kernel read float16 pools)."""
    setting = config.cache.kv_dtype
    narrow_ok = dtype == torch.float32 and device.type == "cpu" and attention == "torch" and not config.deterministic
    if setting == "auto":
        return torch.float16 if narrow_ok and cpu_kernels and dense_llama else dtype
    if setting == "float16" and dtype != torch.float16 and not narrow_ok:
        raise ConfigError(
            "cache.kv_dtype: float16 needs a float32 model on CPU with the torch attention backend, outside "
            f"deterministic mode (here: {str(dtype).removeprefix('torch.')} on {device.type}, attention {attention}, "
            f"deterministic {config.deterministic}); use model or auto"
        )
    return torch.float16 if setting == "float16" else dtype


def log_numerics(config: Config, numerics: Numerics) -> None:
    log.info(
        "numerics",
        dtype=str(numerics.dtype).removeprefix("torch."),
        dtype_setting=config.model.dtype,
        quantization=numerics.quantization,
        quantization_setting=config.model.quantization,
    )
