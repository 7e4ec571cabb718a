"""Quantized linears end to end against the float32 engine on the packaged SmolLM2 (its
linears are Q4_1 blocks, its tied embedding / output head Q8_0), 8 prompts x 32 greedy
tokens (tests/numerics_compare.py).

Measured on an AVX-512 BF16 Xeon (first divergences; agreement; max chosen-token logprob
error up to and including the first divergence) and the bounds enforced, with
`model.cpu_kernels: auto` (tierserve's C++ quantized kernels, gpu/quant/gemv.py) and, for
the default setting, `off` (torch's int4 / int8 ops):

| setting | measured | bounds |
|---|---|---|
| float32 + int4 | [32, 0, 17, 32, 32, 32, 18, 32]; 0.76; 0.146 | >= 0.5; < 0.3 |
| bfloat16 + int4 | [32, 6, 17, 32, 3, 32, 18, 21]; 0.63; 0.296 | >= 0.35; < 0.4 |
| bfloat16 + int4, kernels off | [24, 32, 17, 32, 3, 32, 18, 21]; 0.70; 0.149 | >= 0.35; < 0.4 |
| bfloat16 + int8 | [19, 6, 17, 6, 3, 32, 18, 21]; 0.48; 0.301 | >= 0.3; < 0.5 |

(The 8 prompts decode together, 8 rows a step: the kernels run the int8 output head up to 8
rows, torch's op up to 4, above which the dense head runs, so `off` is closer to float32.)

float32 + int4 computes the linears with the checkpoint's own 4-bit levels exactly (the
float32 engine dequantizes the same blocks), so its error is the int8 output head's alone;
its one divergence at token 0 is a near tie (float32's top two logprobs differ by 0.038).
The op-level numerics (tight bounds, planted nibble swap) are in tests/test_quantized_ops.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu.quant import gemv
from gpu.quant.dispatch import QuantizedWeight
from gpu.quant.linears import Int4Linear, Int8Linear
from kernel import Engine
from tests.conftest import CONFIG, TEST_OVERRIDES
from tests.numerics_compare import PARAMS, PROMPTS, compare

BOUNDS = {  # setting (dtype, quantization, model.cpu_kernels) -> (min agreement, max logprob error)
    ("float32", "int4", "auto"): (0.5, 0.3),
    ("bfloat16", "int4", "auto"): (0.35, 0.4),
    ("bfloat16", "int4", "off"): (0.35, 0.4),
    ("bfloat16", "int8", "auto"): (0.3, 0.5),
}


def check_layers(model: Any, quantization: str, kernels: bool) -> None:
    """int4: the Q4_1 linears are 4-bit, the Q8_0 output head int8; int8: all int8; each on
    the C++ kernel when they are on and build here, else on torch's op."""
    layer = model.layers[0]
    expected = Int4Linear if quantization == "int4" else Int8Linear
    for weight in (layer.qkv, layer.o, layer.gate_up, layer.down):
        assert isinstance(weight, QuantizedWeight) and isinstance(weight.quant, expected)
        assert weight.dense is not None and weight.dense.dtype == model.dtype  # many-row steps
        assert runs_kernel(weight.quant) == kernels
    assert isinstance(model.lm_head, QuantizedWeight) and isinstance(model.lm_head.quant, Int8Linear)
    assert runs_kernel(model.lm_head.quant) == kernels


def runs_kernel(layer: Int4Linear | Int8Linear) -> bool:
    return layer.kernel if isinstance(layer, Int4Linear) else layer.kernel_scales is not None


@pytest.mark.parametrize(("dtype", "quantization", "cpu_kernels"), list(BOUNDS))
def test_quantized_agrees_with_float32(
    fp32_greedy: list[dict[str, Any]], dtype: str, quantization: str, cpu_kernels: str
) -> None:
    engine = Engine(CONFIG, {**TEST_OVERRIDES, "model.dtype": dtype, "model.quantization": quantization,
                             "model.cpu_kernels": cpu_kernels})
    try:
        model = engine.engine.parts.runner.model
        assert model.dtype == getattr(torch, dtype)
        check_layers(model, quantization, cpu_kernels == "auto" and gemv.available(model.dtype))
        got = engine.generate(PROMPTS, PARAMS)
    finally:
        engine.shutdown()
    result = compare(fp32_greedy, got)  # type: ignore[arg-type]
    min_agreement, max_error = BOUNDS[(dtype, quantization, cpu_kernels)]
    assert result.agreement >= min_agreement, str(result)
    assert result.max_logprob_error < max_error, str(result)
