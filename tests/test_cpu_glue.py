"""The fused C++ glue of the Llama decoder (gpu/kernels/cpu/llama_glue.cpp) against the
torch code of gpu/models/llama.py it replaces, op by op and engine-wide.

Tolerances (measured on random and extreme inputs, then given ~4x headroom):
- float32: |fused - torch| <= 2e-6 * (|inputs| scale) -- only reduction order (the norms'
  sum of squares) and fused multiply-adds differ; measured worst 2.4e-7 relative;
- bfloat16: the intermediate that torch rounds first (the normalized x before the weight
  multiply, silu(gate) before the up multiply) within 1 ulp of torch's, the rest rounded
  alike (measured: equal on all but ~4 in a million norm elements, where the float32
  statistic straddles a rounding boundary); RoPE and the residual sum bit-equal (the same
  roundings of exact products);
- engine, float32, auto vs off, teacher-forced (tests/numerics_compare.py): mean |Δ logprob|
  < 1e-5, p99 < 1e-4, every top-1 equal where the margin exceeds 1e-3 (measured on an AMD EPYC
  AVX2: max 4.8e-7 on all three, forward and reverse; the same, teacher-forced, on
  an Intel Xeon AVX-512/BF16/AMX). The planted RoPE swap measures mean 7e-4 to 8e-4, the planted norm eps
  0.08: red on the mean bound.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gpu.models import llama_glue as glue
from gpu.models.llama import LlamaModel, _apply_rope
from tests.conftest import TINY_OVERRIDES
from tests.numerics_compare import TOP, Bounds, NumericsOutOfBounds, check_report, evaluate, reference

pytestmark = pytest.mark.skipif(
    not glue.available(True, torch.float32, torch.device("cpu")),
    reason="the llama_glue extension does not build here",
)

DTYPES = (torch.float32, torch.bfloat16)
ROWS = (1, 7, 600)
WIDTHS = (64, 100, 576, 2048)  # 100: a row that is not a whole number of 16-float runs
EPS = 1e-5


class _Arch:
    rms_norm_eps = EPS


class _NormOwner:
    """A stand-in for the model: `LlamaModel._rms_norm` reads only `arch.rms_norm_eps`."""

    arch = _Arch()


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return LlamaModel._rms_norm(_NormOwner(), x, weight)  # type: ignore[arg-type]


def torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)  # as gpu/models/hybrid_common.swiglu splits it
    return F.silu(gate) * up


def assert_all(ok: torch.Tensor, fused: torch.Tensor, ref: torch.Tensor) -> None:
    bad = (~ok).nonzero()
    if bad.numel():
        at = tuple(bad[0].tolist())
        raise AssertionError(
            f"{bad.shape[0]} of {ok.numel()} elements off, first at {at}: {fused[at]} vs {ref[at]}"
        )


def same_or_nan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a == b) | (a.isnan() & b.isnan())


def assert_near(fused: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | float) -> None:
    """float32: within 2e-6 * scale, NaNs and infinities where the reference has them."""
    assert fused.dtype == ref.dtype == torch.float32 and fused.shape == ref.shape
    a, b = fused.double(), ref.double()
    close = (
        a.isfinite() & b.isfinite() & ((a - b).abs() <= 2e-6 * torch.as_tensor(scale, dtype=torch.float64))
    )
    assert_all(same_or_nan(a, b) | close, fused, ref)


def assert_one_ulp_inside(
    fused: torch.Tensor, inner: torch.Tensor, outer: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """bfloat16: fused == outer(t) for t torch's rounded intermediate `inner` or one of its
    neighbours (the one rounding a float32 summed in another order may move)."""
    up = torch.nextafter(inner, torch.full_like(inner, float("inf")))
    down = torch.nextafter(inner, torch.full_like(inner, float("-inf")))
    ok = same_or_nan(fused, outer(inner)) | same_or_nan(fused, outer(up)) | same_or_nan(fused, outer(down))
    assert_all(ok, fused, outer(inner))


def random_rows(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * 2)
    return x.to(dtype)


def extreme_rows(width: int, dtype: torch.dtype) -> torch.Tensor:
    """Zero rows, rows whose squares overflow or underflow float32, and inf / NaN entries."""
    big = 3e38 if dtype == torch.bfloat16 else 1e30
    rows = [
        torch.zeros(width),
        torch.full((width,), big),
        torch.full((width,), 1e-30),
        torch.randn(width) * 1e18,
    ]
    special = torch.randn(width)
    special[0], special[1], special[2] = float("inf"), float("-inf"), float("nan")
    return torch.stack([*rows, special]).to(dtype)


def check_norm_output(fused: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    ref = torch_rms_norm(x, weight)
    if x.dtype == torch.float32:
        assert_near(fused, ref, scale=ref.abs().double().amax(-1, keepdim=True).clamp_min(1e-30))
    else:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
        assert_one_ulp_inside(fused, normed, lambda t: weight * t)


def check_rms_norm(
    fused: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor], x: torch.Tensor
) -> None:
    weight = (torch.randn(x.shape[1], generator=torch.Generator().manual_seed(1)) + 1).to(x.dtype)
    check_norm_output(fused(x, weight, EPS), x, weight)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm_matches_torch(dtype: torch.dtype, rows: int, width: int) -> None:
    check_rms_norm(glue.rms_norm, random_rows(rows, width, dtype, seed=rows * width))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_extreme_values(dtype: torch.dtype) -> None:
    check_rms_norm(glue.rms_norm, extreme_rows(576, dtype))


def test_rms_norm_reads_strided_rows() -> None:
    wide = random_rows(7, 600, torch.float32, seed=3)
    check_rms_norm(glue.rms_norm, wide[:, 100:])


def test_a_norm_without_eps_goes_red() -> None:
    """Planted bug: eps dropped. The float32 check sees the 1e-5 it no longer adds."""

    def no_eps(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return glue.rms_norm(x, weight, 0.0)

    with pytest.raises(AssertionError, match="elements off"):
        check_rms_norm(no_eps, random_rows(7, 576, torch.float32, seed=5) * 0.01)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_matches_torch(dtype: torch.dtype, rows: int) -> None:
    h, delta = random_rows(rows, 576, dtype, seed=7), random_rows(rows, 576, dtype, seed=8)
    weight = torch.randn(576).to(dtype)
    total, normed = glue.add_rms_norm(h, delta, weight, EPS)
    assert torch.equal(total, h + delta)  # rounded to the dtype exactly as torch's add
    check_norm_output(normed, h + delta, weight)


def rope_inputs(
    rows: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(rows + dim)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    pos = torch.randint(0, 100_000, (rows,), generator=g).double()
    freqs = torch.outer(pos, 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float()
    return qkv, freqs.cos().to(dtype), freqs.sin().to(dtype)


def torch_rope(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
) -> tuple[torch.Tensor, ...]:
    dim = 2 * cos.shape[1]
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    return (
        _apply_rope(q.reshape(-1, heads, dim), cos, sin),
        _apply_rope(k.reshape(-1, kv_heads, dim), cos, sin),
        v.reshape(-1, kv_heads, dim),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 32), (32, 8, 128)])
def test_rope_matches_torch(dtype: torch.dtype, rows: int, heads: int, kv_heads: int, dim: int) -> None:
    qkv, cos, sin = rope_inputs(rows, heads, kv_heads, dim, dtype)
    fused = glue.rope(qkv, cos, sin, heads, kv_heads)
    for got, ref in zip(fused, torch_rope(qkv, cos, sin, heads, kv_heads)):
        assert got.is_contiguous() and got.shape == ref.shape
        if dtype == torch.bfloat16:
            assert torch.equal(got, ref)
        else:
            assert_near(got, ref, scale=qkv.abs().amax().item())


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_reads_cos_sin_as_views_of_one_table(dtype: torch.dtype) -> None:
    """As LlamaModel passes them: cos and sin are the halves of one gathered [T, D] table."""
    qkv, cos, sin = rope_inputs(7, 9, 3, 64, dtype)
    table = torch.cat([cos, sin], dim=-1)
    fused = glue.rope(qkv, table[:, :32], table[:, 32:], 9, 3)
    for got, ref in zip(fused, torch_rope(qkv, cos, sin, 9, 3)):
        assert (
            torch.equal(got, ref)
            if dtype == torch.bfloat16
            else torch.allclose(got, ref, rtol=0, atol=2e-6 * 8)
        )


def test_rope_rejects_a_mismatched_width() -> None:
    qkv, cos, sin = rope_inputs(3, 9, 3, 64, torch.float32)
    with pytest.raises(RuntimeError, match="width"):
        glue.rope(qkv, cos, sin, 9, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", [64, 100, 1536])
def test_silu_mul_matches_torch(dtype: torch.dtype, rows: int, inter: int) -> None:
    check_silu_mul(random_rows(rows, 2 * inter, dtype, seed=inter))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_extreme_values(dtype: torch.dtype) -> None:
    gate = torch.tensor(
        [0.0, -0.0, 1e-30, -100.0, 100.0, -88.5, 89.0, 1e4, -1e4, float("inf"), float("-inf"), float("nan")]
    )
    check_silu_mul(torch.cat([gate, torch.full_like(gate, 3.0)])[None].to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_vector_lanes_equal_the_scalar_tail(dtype: torch.dtype) -> None:
    """The vectorized SiLU * up (sixteen lanes with AVX-512, then eight) is bit-identical to
    the scalar code the row's tail runs: every value sits in all 25 places of a 25-wide row
    (16 + 8 vector lanes + 1 scalar; 3 x 8 + 1 without AVX-512). NOTE: the native decode
    step cuts rows where the torch path does not, so only this identity makes the two
    paths agree bit for bit."""
    special = [0.0, -0.0, 1e-30, -1e-40, -79.9, -80.0, -80.5, -88.7, 88.7228, 88.723, 89.0, -87.3,
               1e4, -1e4, float("inf"), float("-inf"), float("nan"), 0.5, -0.5, 3.0e38]
    values = torch.cat([torch.tensor(special), torch.randn(2000, generator=torch.Generator().manual_seed(2)) * 12])
    ups = torch.randn(values.numel(), generator=torch.Generator().manual_seed(3)) * 3
    gate_up = torch.cat([values[:, None].expand(-1, 25), ups[:, None].expand(-1, 25)], dim=1).to(dtype).contiguous()
    out = glue.silu_mul(gate_up)
    bits = out.view(torch.int32 if dtype == torch.float32 else torch.int16)
    assert torch.equal(bits[:, :24], bits[:, 24:].expand(-1, 24))


def check_silu_mul(gate_up: torch.Tensor) -> None:
    fused, ref = glue.silu_mul(gate_up), torch_silu_mul(gate_up)
    if gate_up.dtype == torch.float32:
        assert_near(fused, ref, scale=ref.abs().double().clamp_min(1e-30))
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        assert_one_ulp_inside(fused, F.silu(gate), lambda s: s * up)


def test_other_dtypes_are_refused() -> None:
    assert not glue.available(True, torch.float16, torch.device("cpu"))
    assert not glue.available(False, torch.float32, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        glue.silu_mul(torch.ones(1, 8, dtype=torch.float16))


# --- engine level: the tiny models with model.cpu_kernels auto vs off, float32 ---------------

PROMPTS = [[1, 17, 250, 33, 99, 4, 410], list(range(3, 60)), [1, 2, 3]]
PARAMS = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "return_logprob": True,
          "top_logprobs_num": TOP}
ENGINE_BOUNDS = Bounds(mean=1e-5, p99=1e-4, agreement=1.0, gap=1e-3)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, object]]:
    from kernel import Engine
    from tests.tiny_models import build_tiny

    folder: Path = build_tiny(request.param, tmp_path_factory.mktemp(f"glue_{request.param}"))
    built = {
        mode: Engine(None, {"model.path": str(folder), **TINY_OVERRIDES, "model.cpu_kernels": mode})
        for mode in ("off", "auto")
    }
    yield built
    for engine in built.values():
        engine.shutdown()  # type: ignore[attr-defined]


def fused_model(engine: object) -> LlamaModel:
    return engine.engine.parts.runner.model  # type: ignore[attr-defined,no-any-return]


def check_engines_agree(engines: dict[str, object]) -> None:
    """auto (glue) against off, teacher-forced (tests/numerics_compare.py)."""
    report = evaluate(engines["auto"], reference(engines["off"], PROMPTS, PARAMS), ENGINE_BOUNDS.gap)
    check_report(report, ENGINE_BOUNDS)


def test_engine_agrees_with_and_without_glue(engines: dict[str, object]) -> None:
    assert fused_model(engines["auto"]).fused and not fused_model(engines["off"]).fused
    check_engines_agree(engines)


def test_engine_with_a_swapped_rope_goes_red(
    engines: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planted bug: the fused RoPE gets sin for cos. The engine comparison must catch it
    (Qwen3 runs its QK-normed RoPE in torch, so plant its norm's eps instead)."""
    real_rope, real_add_norm = glue.rope, glue.add_rms_norm
    monkeypatch.setattr(glue, "rope", lambda qkv, cos, sin, h, kv: real_rope(qkv, sin, cos, h, kv))
    if fused_model(engines["auto"]).layers[0].q_norm is not None:
        monkeypatch.setattr(glue, "add_rms_norm", lambda h, d, w, eps: real_add_norm(h, d, w, 1.0))
    with pytest.raises(NumericsOutOfBounds, match="teacher-forced .* out of bounds"):
        check_engines_agree(engines)
