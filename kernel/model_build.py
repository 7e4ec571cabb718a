"""Load a checkpoint and build its model under a config's numerics: the target model, and
a draft model for speculative decoding (kernel/speculative/draft_build.py)."""

from __future__ import annotations

from typing import Any, NamedTuple

import structlog
import torch

from gpu.loader import load_checkpoint
from gpu.model_config import ModelArchConfig
from gpu.parallel.group import TensorParallel
from gpu.parallel.shard import ShardError, shard_checkpoint
from gpu.quant.dispatch import QuantSpec
from gpu.tokenizer import Tokenizer
from kernel import registry
from kernel.config import Config, ConfigError
from kernel.numerics_choice import (
    Numerics,
    log_numerics,
    resolve_dtype,
    resolve_moe,
    resolve_quantization,
    use_cpu_kernels,
    use_native_recurrence,
    wants_blocks,
)
from kernel.tiers.storage_io import weights_fingerprint

log = structlog.get_logger("tierserve")


class BuiltModel(NamedTuple):
    model: Any
    arch: ModelArchConfig  # the model's own: a tensor-parallel rank's local head counts
    tokenizer: Tokenizer | None
    dtype: torch.dtype
    quantization: str
    cpu_kernels: bool
    model_id: str  # the weights' storage fingerprint ("" unless asked for)


def storage_model_id(weights: dict[str, torch.Tensor], quantization: str, exact: str = "") -> str:
    """The weights' fingerprint, plus the quantization when there is one: quantized linears
    compute other KV from the same file, so their pages must never be served to (or from)
    a server without it. `exact` (deterministic mode's arithmetic, `exact_numerics`): its
    pages and states are a cold run's bits only on a server computing the same way, so
    they get keys of their own (a default-mode page is a miss there, not a hit with other
    bits: seen with the packaged model's default bf16 + int4, whose default-mode prefill
    runs the dense copy where deterministic mode runs the 4-bit op)."""
    parts = [weights_fingerprint(weights)]
    parts += [quantization] if quantization != "none" else []
    parts += [exact] if exact else []
    return "+".join(parts)


def exact_numerics(config: Config, model: Any, cpu_kernels: bool) -> str:
    """'' outside deterministic mode; in it, a name for its arithmetic: "det", plus
    ".native_delta" with a Gated DeltaNet model on the C++ recurrence (its states' bits are
    not torch's form's) and ".cpu_chained" where the C++ kernels run (their bits are not
    the torch fallbacks'; attention in the chained form, whose bits are not those of the
    decode kernel that deterministic mode ran before it, so older pages stay misses)."""
    if not config.deterministic:
        return ""
    native_delta = ".native_delta" if getattr(model, "native_recurrence", False) else ""
    return "det" + native_delta + (".cpu_chained" if cpu_kernels else "")


def build_model(config: Config, device: torch.device, fingerprint: bool = False, rank: int = 0) -> BuiltModel:
    """`config.model`'s checkpoint as a model of its registered architecture (with
    parallel.tp_size > 1: rank `rank`'s shard of it)."""
    dtype = resolve_dtype(config, device)
    ckpt = load_checkpoint(config.model.path, dtype, keep_blocks=wants_blocks(config))
    arch, weights, blocks = ckpt.arch, ckpt.weights, ckpt.blocks
    model_cls = registry.lookup("model", arch.architecture)
    quantization = resolve_quantization(config, device, model_cls, bool(ckpt.blocks))
    log_numerics(config, Numerics(dtype, quantization))
    cpu_kernels = use_cpu_kernels(config, device)
    extra: dict[str, Any] = {}
    size = config.parallel.tp_size
    if size > 1:
        if not getattr(model_cls, "accepts_tp", False):
            raise ConfigError(f"parallel.tp_size: {arch.architecture} models have no tensor-parallel split yet")
        try:
            shard = shard_checkpoint(arch, weights, blocks, rank, size)
        except ShardError as exc:
            raise ConfigError(f"parallel.tp_size {size}: {exc}") from None
        arch, weights, blocks = shard.arch, shard.weights, shard.blocks
        extra["tp"] = TensorParallel(rank, size, arch.vocab_size, shard.vocab_start, shard.vocab_chunk,
                                     ordered=config.deterministic)
    if quantization != "none":
        extra["quantization"] = QuantSpec(
            quantization, blocks, keep_dense=not config.deterministic, cpu_kernels=cpu_kernels
        )
    if getattr(model_cls, "accepts_cpu_kernels", False):
        extra["cpu_kernels"] = cpu_kernels
    if getattr(model_cls, "accepts_moe", False):
        extra["moe"] = resolve_moe(config, device, cpu_kernels)
    model = model_cls(arch, weights, dtype, device, deterministic=config.deterministic, **extra)
    if hasattr(model, "native_recurrence"):  # Gated DeltaNet models (gpu/models/qwen3_5.py)
        model.native_recurrence = use_native_recurrence(config, device)
        log.info("gated_delta", form="native recurrent" if model.native_recurrence else
                 "recurrent" if config.deterministic else "chunked")
    model_id = storage_model_id(ckpt.weights, quantization, exact_numerics(config, model, cpu_kernels)) if fingerprint else ""
    return BuiltModel(model, arch, ckpt.tokenizer, dtype, quantization, cpu_kernels, model_id)
