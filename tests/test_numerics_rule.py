"""`model.dtype: auto` and `model.quantization: auto`: the rules of gpu/numerics.py, with
the machine's capabilities monkeypatched (AVX2-only EPYC, AVX-512 BF16 Xeon, AMX that the
kernel refuses), and what a launch resolves them to."""

from __future__ import annotations

import pytest
import torch

from gpu import numerics
from gpu.models.lfm2 import Lfm2Model
from gpu.models.llama import LlamaModel
from kernel.config import ConfigError, load_config
from kernel.model_build import storage_model_id
from kernel.numerics_choice import resolve_dtype, resolve_quantization
from kernel.tiers.storage_io import weights_fingerprint

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
AVX2_EPYC = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
XEON_BF16 = AVX2_EPYC | {"avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile"}
AMX_ONLY = AVX2_EPYC | {"avx512f", "amx_bf16", "amx_tile"}  # hypothetical: AMX without avx512_bf16


def machine(monkeypatch: pytest.MonkeyPatch, flags: frozenset[str], amx_ok: bool) -> None:
    monkeypatch.setattr(numerics, "cpu_flags", lambda: flags)
    monkeypatch.setattr(numerics, "amx_permitted", lambda: amx_ok)


@pytest.mark.parametrize(
    ("flags", "amx_ok", "expected"),
    [
        (AVX2_EPYC, False, "float32"),
        (AVX2_EPYC, True, "float32"),
        (XEON_BF16, False, "bfloat16"),  # AMX traps / refused: avx512_bf16 alone decides
        (XEON_BF16, True, "bfloat16"),
        (AMX_ONLY, False, "float32"),  # advertised but not granted by the kernel: never used
        (AMX_ONLY, True, "bfloat16"),
        (frozenset(), False, "float32"),  # no /proc/cpuinfo (not Linux)
    ],
)
def test_auto_dtype_on_cpu(monkeypatch: pytest.MonkeyPatch, flags: frozenset[str], amx_ok: bool, expected: str) -> None:
    machine(monkeypatch, flags, amx_ok)
    assert numerics.auto_dtype(CPU) == expected
    config = load_config(None, {"model.dtype": "auto"})
    assert resolve_dtype(config, CPU) == getattr(torch, expected)


def test_explicit_dtype_wins_over_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    machine(monkeypatch, AVX2_EPYC, False)
    assert resolve_dtype(load_config(None, {"model.dtype": "bfloat16"}), CPU) == torch.bfloat16
    machine(monkeypatch, XEON_BF16, True)
    assert resolve_dtype(load_config(None, {"model.dtype": "float32"}), CPU) == torch.float32


@pytest.mark.parametrize("bf16_ok", [True, False])
def test_auto_dtype_on_cuda(monkeypatch: pytest.MonkeyPatch, bf16_ok: bool) -> None:
    machine(monkeypatch, AVX2_EPYC, False)  # the host CPU does not matter on CUDA
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_ok)
    assert numerics.auto_dtype(CUDA) == ("bfloat16" if bf16_ok else "float32")


def test_auto_is_the_default() -> None:
    config = load_config(None)
    assert (config.model.dtype, config.model.quantization) == ("auto", "auto")


def test_cpu_flags_of_this_machine_are_read() -> None:
    """On Linux x86 the real /proc/cpuinfo parses to a set holding at least SSE2."""
    flags = numerics.cpu_flags()
    if flags:
        assert "sse2" in flags


@pytest.mark.parametrize(
    ("device", "has_blocks", "expected"),
    [(CPU, True, "int4"), (CPU, False, "none"), (CUDA, True, "none")],
)
def test_auto_quantization(device: torch.device, has_blocks: bool, expected: str) -> None:
    config = load_config(None, {"model.quantization": "auto"})
    assert resolve_quantization(config, device, LlamaModel, has_blocks) == expected


def test_auto_quantization_without_the_torch_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numerics, "int4_op_available", lambda: False)
    assert numerics.auto_quantization(CPU, has_q4_blocks=True) == "none"


def test_auto_quantization_leaves_hybrid_models_dense() -> None:
    config = load_config(None, {"model.quantization": "auto"})
    assert resolve_quantization(config, CPU, Lfm2Model, True) == "none"


@pytest.mark.parametrize(
    ("mode", "device", "model_cls", "message"),
    [
        ("int4", CPU, Lfm2Model, "Llama family"),
        ("int8", CUDA, LlamaModel, "CPU ops"),
    ],
)
def test_explicit_quantization_that_cannot_run_is_a_config_error(
    mode: str, device: torch.device, model_cls: type, message: str
) -> None:
    config = load_config(None, {"model.quantization": mode})
    with pytest.raises(ConfigError, match=message):
        resolve_quantization(config, device, model_cls, True)


def test_unknown_quantization_is_rejected() -> None:
    with pytest.raises(ConfigError, match="model.quantization"):
        load_config(None, {"model.quantization": "int3"})


def test_storage_model_id_names_the_quantization() -> None:
    """KV pages computed with quantized linears never meet those of the dense model."""
    weights = {"w": torch.arange(8, dtype=torch.float32)}
    ids = {q: storage_model_id(weights, q) for q in ("none", "int8", "int4")}
    assert len(set(ids.values())) == 3
    assert ids["none"] == weights_fingerprint(weights)  # unquantized keys are unchanged
    # Deterministic mode's arithmetic names its own keys (tests/test_storage_tier.py shows why).
    exact = {storage_model_id(weights, q, "det") for q in ("none", "int4")}
    assert len(exact) == 2 and not exact & set(ids.values())
