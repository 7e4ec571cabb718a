"""`cache.kv_dtype`: a float32 model on CPU storing float16 K/V (the default, `auto`, where
the C++ kernels run a dense Llama-family model), against the same engine storing float32.

What it changes, teacher-forced on the packaged SmolLM2 (tests/numerics_compare.py, float32
weights both), measured on an AMD EPYC AVX2 over the first three prompts: prefill mean
|Δ logprob| 5.1e-4, p99 4.6e-3; decode 3.6e-4, 1.7e-3 (all six prompts: prefill 4.2e-4,
2.9e-3; decode 3.7e-4, 2.4e-3); on an AMD EPYC AVX-512/BF16 (Zen 4) prefill 4.9e-4, 4.6e-3;
decode 3.7e-4, 2.3e-3 (kernels off, the torch path widening the rows: 5.2e-4, 4.2e-3; 3.8e-4,
2.0e-3); free-running greedy outputs equal — a K/V element
rounded to float16 moves by at most 2^-11 of itself, ~100x what float32 rounding alone
moves a logprob. Bounds: mean < 2e-3, p99 < 1e-2, every top-1 equal past a 5e-2 margin;
the planted 1% error in K measures decode mean 5.4e-3, p99 3.7e-2. Deterministic mode and
the float32 reference engines of the other tests keep float32 pools (tests/conftest.py
FLOAT32).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from cache.kv_pool import KVPool
from gpu.kernels import cpu
from kernel.config import ConfigError, load_config
from kernel.numerics_choice import resolve_kv_dtype
from tests.conftest import CONFIG, TEST_OVERRIDES
from tests.numerics_compare import PROMPTS, Bounds, NumericsOutOfBounds, check_report, evaluate, reference

CPU = torch.device("cpu")
BOUNDS = Bounds(mean=2e-3, p99=1e-2, agreement=1.0, gap=5e-2)


def _resolve(setting: str, dtype: torch.dtype = torch.float32, kernels: bool = True, attention: str = "torch",
             dense: bool = True, deterministic: bool = False) -> torch.dtype:
    config = load_config(None, {"cache.kv_dtype": setting, "deterministic": deterministic})
    return resolve_kv_dtype(config, dtype, CPU, kernels, attention, dense)


def test_auto_stores_float16_only_where_the_cpu_kernels_run_a_dense_float32_model() -> None:
    assert _resolve("auto") == torch.float16
    assert _resolve("auto", kernels=False) == torch.float32  # model.cpu_kernels off
    assert _resolve("auto", dense=False) == torch.float32  # hybrids, mixture-of-experts
    assert _resolve("auto", dtype=torch.bfloat16) == torch.bfloat16
    assert _resolve("auto", attention="triton") == torch.float32
    assert _resolve("model") == torch.float32
    assert _resolve("float16", kernels=False) == torch.float16  # asked for: the torch path widens it


@pytest.mark.parametrize("case", [
    {"dtype": torch.bfloat16}, {"attention": "triton"}, {"deterministic": True, "attention": "deterministic"},
])
def test_float16_is_refused_where_nothing_widens_it(case: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="cache.kv_dtype: float16 needs a float32 model"):
        _resolve("float16", **case)
    with pytest.raises(ConfigError, match="cache.kv_dtype"):
        load_config(None, {"cache.kv_dtype": "int8"})


def test_the_pool_rounds_what_it_stores_to_nearest_even() -> None:
    pool = KVPool(1, 2, 4, 1, 8, torch.float16, CPU, torch.float32)
    assert pool.widened and pool.compute_dtype == torch.float32
    k = torch.tensor([[[1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 70000.0, -0.0, 1e-8, 3.0, 1.0 / 3, 2.5]]])
    pool.write(0, torch.tensor([5]), k, -k)
    assert torch.equal(pool.k[0][5], k[0].to(torch.float16)) and torch.equal(pool.v[0][5], (-k[0]).to(torch.float16))
    assert pool.k[0][5, 0].tolist()[:3] == [1.0, 1.0 + 2.0**-9, float("inf")]  # ties to even; past 65504: inf


@pytest.fixture(scope="module")
def engines(smollm_engine: Any) -> Iterator[dict[str, Any]]:
    from kernel import Engine

    half = Engine(CONFIG, {**TEST_OVERRIDES, "cache.kv_dtype": "float16"})
    # Half of the usual prompts (the suite's time budget): the float32 pool's tokens, scored once.
    yield {"float16": half, "reference": reference(smollm_engine, PROMPTS[:3])}
    half.shutdown()


def test_float16_pool_is_within_its_bounds_of_the_float32_one(engines: dict[str, Any]) -> None:
    half = engines["float16"].engine.parts.runner
    assert half.pool.k[0].dtype == torch.float16
    # The C++ decode kernel reads the float16 rows where it runs; without it the torch path widens them.
    assert half.attention._use_kernel == bool(cpu.load("paged_attention"))
    report = evaluate(engines["float16"], engines["reference"], BOUNDS.gap)
    print(report)
    check_report(report, BOUNDS)


def test_a_coarser_rounding_goes_red(engines: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the float16 pool stores K 1% off (a wrong scale in the conversion); the
    bounds catch it."""
    pool = engines["float16"].engine.parts.runner.pool
    real = pool.write
    monkeypatch.setattr(pool, "write", lambda layer, slots, k, v: real(layer, slots, k * 1.01, v))
    with pytest.raises(NumericsOutOfBounds, match="teacher-forced .* out of bounds"):
        check_report(evaluate(engines["float16"], engines["reference"], BOUNDS.gap), BOUNDS)
