"""Deterministic mode on the packaged model's default numerics (bf16 or float32 as the CPU
allows, int4 + int8 linears), where everything runs the C++ kernels: every linear, the
glue, attention for every token (gpu/attention/deterministic_paged.py) and the native
decode step (graphs.mode cpu). The bit-exact guards of tests/test_bit_exact.py hold there,
the native step gives the eager path's bits, and a decode step that disagrees with
prefill is caught.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from gpu.attention.deterministic_paged import PagedDeterministicAttention
from gpu.graphs.cpu_step import CpuStepRunner
from gpu.kernels import cpu
from gpu.models import llama_cpu_step
from gpu.quant.dispatch import QuantizedWeight
from kernel import Engine
from tests.conftest import CONFIG, TINY_OVERRIDES
from tests.test_bit_exact import GREEDY, SAMPLED, guard_branching, guard_decode_hit, guard_prefill_hit, tokens

if not all(cpu.load(name) for name in ("paged_attention", "quant_gemv", "llama_glue", "decode_step")):
    pytest.skip("the C++ CPU kernels are off or do not build here", allow_module_level=True)

# The tiny engines' scheduling (4-token pages, 32-token chunks: the guards' page arithmetic),
# on the packaged model with its default numerics.
SETTINGS = {**{k: v for k, v in TINY_OVERRIDES.items() if not k.startswith("model.")}, "cache.kv_dtype": "auto",
            "deterministic": True, "cache.prefix": "radix", "model.quantization": "int4"}


def runner(engine: Engine) -> Any:
    return engine.engine.parts.runner  # type: ignore[attr-defined]


def make(**extra: Any) -> Engine:
    return Engine(CONFIG, {**SETTINGS, **extra})


@pytest.fixture(scope="module")
def det() -> Iterator[Engine]:
    engine = make(**{"debug.check_invariants": False})
    yield engine
    engine.shutdown()


def replays(engine: Engine) -> int:
    graphs = runner(engine).graphs
    return sum(graphs.replays.values()) if isinstance(graphs, CpuStepRunner) else 0


def test_everything_runs_the_kernels(det: Engine) -> None:
    """The guards below would prove little on a fallback: check what runs."""
    model = runner(det).model
    assert isinstance(runner(det).attention, PagedDeterministicAttention)
    assert isinstance(runner(det).graphs, CpuStepRunner)
    assert model.fused
    linears = [model.lm_head] + [w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(isinstance(w, QuantizedWeight) and w.quant.row_invariant and w.dense is None for w in linears)


@pytest.mark.parametrize("guard", [guard_prefill_hit, guard_decode_hit, lambda e: guard_branching(e, noise=15)],
                         ids=["prefill-hit", "decode-hit", "branching-among-others"])
def test_bit_exact_guards(det: Engine, guard: Any) -> None:
    before = replays(det)
    guard(det)
    assert replays(det) > before, "the native decode step never ran"


def test_native_step_gives_the_eager_bits(det: Engine) -> None:
    """The same requests (mixed lengths, a batch of them) with graphs.mode off: every
    decode through the layered path over the same kernels; tokens and logprobs `==`."""
    prompts = [tokens(40 + i, n) for i, n in enumerate((3, 17, 40, 150, 9))]
    params = [GREEDY, SAMPLED, GREEDY, SAMPLED, GREEDY]
    eager = make(**{"graphs.mode": "off"})
    try:
        assert runner(eager).graphs is None
        assert det.flush_cache() and eager.flush_cache()
        before = replays(det)
        got = det.generate(prompts, params)
        assert replays(det) > before
        want = eager.generate(prompts, params)
    finally:
        eager.shutdown()
    for out, ref in zip(got, want):  # type: ignore[arg-type]
        assert out["output_ids"] == ref["output_ids"]
        assert out["meta_info"]["output_token_logprobs"] == ref["meta_info"]["output_token_logprobs"]


def test_red_decode_step_reading_a_key_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the native step's metadata one key short (each decode misses its newest
    cached key), so decode-written K/V differ from a cold prefill's: the decode-hit guard
    (turn 2 reuses turn 1's answer) goes red."""
    real = PagedDeterministicAttention.paged_decodes

    def short(self: PagedDeterministicAttention) -> Any:
        loc, step = real(self)
        return loc, step._replace(seq_lens=(step.seq_lens - 1).clamp(min=1))

    monkeypatch.setattr(PagedDeterministicAttention, "paged_decodes", short)
    engine = make(**{"debug.check_invariants": False})
    try:
        with pytest.raises(AssertionError, match="bit-exact guard"):
            guard_decode_hit(engine)
    finally:
        engine.shutdown()


def test_red_decode_step_in_the_decode_kernels_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the native step attends in the paged decode kernel's arithmetic while prefill
    runs the chained form, so decode-written K/V differ from a cold prefill's in the last
    bits: the decode-hit guard goes red. In float32 (with bf16 the two forms' last-bit
    differences seldom survive the rounding of the attention's output)."""
    f32 = {"debug.check_invariants": False, "model.dtype": "float32"}
    engine = make(**f32)
    try:
        guard_decode_hit(engine)  # unplanted: green
    finally:
        engine.shutdown()
    real = llama_cpu_step.build
    monkeypatch.setattr(llama_cpu_step, "build", lambda model, pool, chained=False: real(model, pool, False))
    engine = make(**f32)
    try:
        with pytest.raises(AssertionError, match="bit-exact guard"):
            guard_decode_hit(engine)
    finally:
        engine.shutdown()
