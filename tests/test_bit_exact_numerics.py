"""Deterministic mode in the fast numerics: a cache hit stays bit-identical to a cold run
in bfloat16 and with quantized linears (a representative subset of tests/test_bit_exact.py's
guards, on the tiny Llama; `int4` on a checkpoint without Q4 blocks runs int8, so int8
stands for both here, and tests/test_quantized.py covers the 4-bit op end to end).

Planted bug: per-shape dispatch in deterministic mode (the quantized op for few rows, a
dense weight for many, as the non-deterministic path does) makes a hit's few-row prefill
differ from the cold run's many-row one, and the guard goes red.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gpu.models import llama
from gpu.quant.dispatch import LinearWeight, QuantizedWeight
from kernel import Engine
from tests.conftest import HYBRID_FAMILIES
from tests.test_bit_exact import guard_branching, guard_decode_hit, guard_prefill_hit, make
from tests.test_bit_exact_hybrid import guard_prefill_hit as hybrid_prefill_hit
from tests.test_bit_exact_hybrid import make as make_hybrid

NUMERICS = {
    "bf16": {"model.dtype": "bfloat16"},
    "bf16_int8": {"model.dtype": "bfloat16", "model.quantization": "int8"},
    "fp32_int8": {"model.dtype": "float32", "model.quantization": "int8"},
}


@pytest.fixture(scope="module", params=list(NUMERICS))
def det_numerics(request: pytest.FixtureRequest, tiny_chat_folder: str) -> Iterator[tuple[str, Engine]]:
    engine = make(tiny_chat_folder, **NUMERICS[request.param])
    yield request.param, engine
    engine.shutdown()


@pytest.mark.parametrize("guard", [guard_prefill_hit, guard_decode_hit, guard_branching])
def test_cache_hit_is_bit_exact(det_numerics: tuple[str, Engine], guard: Any) -> None:
    guard(det_numerics[1])


def test_numerics_are_what_was_asked(det_numerics: tuple[str, Engine]) -> None:
    name, engine = det_numerics
    model = engine.engine.parts.runner.model
    assert model.dtype == (torch.bfloat16 if name.startswith("bf16") else torch.float32)
    quantized = isinstance(model.layers[0].qkv, QuantizedWeight)
    assert quantized == name.endswith("int8")
    if quantized:
        assert model.layers[0].qkv.dense is None  # deterministic mode keeps no dense copy


def test_red_per_shape_dispatch_in_deterministic_mode(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def planted_make_linear(dense_linear: Any, deterministic: bool, float_linear: Any = None) -> Any:
        def linear(x: torch.Tensor, weight: LinearWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
            if isinstance(weight, torch.Tensor):
                return dense_linear(x, weight, bias)
            # NOTE: a fixed threshold: where the C++ kernels take any row count (no AMX to
            # make dense prefill pay), the kernel's own max_rows would never switch.
            if x.shape[0] <= min(weight.quant.max_rows, 8):
                return weight.quant(x, bias)
            return F.linear(x, weight.quant.dequantize().to(x.dtype), bias)

        return linear

    monkeypatch.setattr(llama, "make_linear", planted_make_linear)
    engine = make(tiny_chat_folder, **NUMERICS["bf16_int8"])
    try:
        with pytest.raises(AssertionError, match="bit-exact guard"):
            guard_branching(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_hybrid_models_in_bf16_hit_bit_exact(hybrid_folders: dict[str, str], family: str) -> None:
    """Hybrid models run in bf16 (recurrent states stay float32, cache/state_pool.py) and a
    prefill hit that resumes from a cached state is bit-identical to a cold run."""
    engine = make_hybrid(hybrid_folders[family], "extra_buffer", **{"model.dtype": "bfloat16"})
    try:
        assert engine.engine.parts.runner.model.dtype == torch.bfloat16
        hybrid_prefill_hit(engine)
    finally:
        engine.shutdown()
