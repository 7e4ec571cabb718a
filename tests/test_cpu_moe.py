"""`moe: cpu` (gpu/moe/cpu_moe.py over gpu/kernels/cpu/moe_experts.cpp): the routed experts
of a few-token step in one C++ call. Its values against `moe: torch` (the same weights and
routing; within float rounding: another sum order and SiLU), a token's bits independent of
the tokens beside it where the build says so (AVX-512), the fallbacks (many tokens,
quantized experts), `model.moe: auto`'s choice, and the engine against `moe: torch`.
Planted: a routing weight dropped, a token's outputs summed in its routing order, the
wrong expert's weights — each red."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gpu.kernels import cpu
from gpu.moe import cpu_moe
from gpu.moe.cpu_moe import CpuMoE
from gpu.moe.routing import Routing, softmax_topk
from gpu.moe.torch_moe import Experts, TorchMoE
from tests import kernel_variants

pytestmark = pytest.mark.skipif(not cpu.load(cpu_moe.KERNELS), reason="the C++ CPU kernels are not built here")

# A hidden size and width that leave scalar tails after every vector body (16, 32 lanes).
HIDDEN, WIDTH, EXPERTS, TOP_K = 72, 40, 6, 3


def experts(dtype: torch.dtype, seed: int = 0) -> Experts:
    torch.manual_seed(seed)
    return Experts(gate_up=[(torch.randn(2 * WIDTH, HIDDEN) / 4).to(dtype) for _ in range(EXPERTS)],
                   down=[(torch.randn(HIDDEN, WIDTH) / 3).to(dtype) for _ in range(EXPERTS)])


def step(tokens: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, Routing]:
    torch.manual_seed(seed)
    x = torch.randn(tokens, HIDDEN).to(dtype)
    return x, softmax_topk(torch.randn(tokens, EXPERTS).to(dtype), TOP_K, True)


def reference(x: torch.Tensor, routing: Routing, weights: Experts) -> torch.Tensor:
    """`moe: torch` in float64 (the op's inputs, exactly): what both approximate."""
    wide = Experts([torch.as_tensor(w).double() for w in weights.gate_up],
                   [torch.as_tensor(w).double() for w in weights.down])
    return TorchMoE._grouped(F.linear, x.double(), Routing(routing.experts, routing.weights.double()), wide)


def close(out: torch.Tensor, x: torch.Tensor, routing: Routing, weights: Experts) -> bool:
    """Near (below) the float64 reference."""
    return near(out, reference(x, routing, weights))


def near(out: torch.Tensor, expected: torch.Tensor) -> bool:
    """float32: within float32 summation error. bf16: the intermediate roundings (gate, up,
    silu, product, down output: half a bf16 step each, carried through the down sums)
    measured against the output's scale: elementwise within 12 bf16 steps of the output's
    rms, on average within 1.5 (`moe: torch` meets the same bound)."""
    error = (out.double() - expected.double()).abs()
    if out.dtype == torch.float32:
        return bool((error <= 1e-5 * (1 + expected.double().abs())).all())
    step = 2.0**-8 * float(expected.double().pow(2).mean().sqrt())
    return bool(error.max() <= 12 * step and error.mean() <= 1.5 * step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2, 7, 17, 40])  # 40 x top 3 over 6 experts: groups of ~20, two passes
def test_matches_torch_moe(dtype: torch.dtype, tokens: int) -> None:
    weights = experts(dtype)
    x, routing = step(tokens, dtype)
    out = cpu_moe.run_op(x, routing, weights)
    assert out.dtype == dtype and out.shape == x.shape
    assert close(out, x, routing, weights)
    torch_out = TorchMoE()(F.linear, x, routing, weights)  # the torch implementation meets the same bound
    assert close(torch_out, x, routing, weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_is_the_same_bits_whatever_shares_its_step(dtype: torch.dtype) -> None:
    if not cpu_moe.row_invariant():
        pytest.skip("the AVX2 kernel unrolls one row further than several (outside deterministic mode only)")
    weights = experts(dtype)
    x, routing = step(33, dtype)
    alone = torch.cat([cpu_moe.run_op(x[t : t + 1], Routing(routing.experts[t : t + 1], routing.weights[t : t + 1]),
                                      weights) for t in range(33)])
    assert torch.equal(cpu_moe.run_op(x, routing, weights), alone)


def test_red_a_routing_weight_dropped() -> None:
    weights = experts(torch.float32)
    x, routing = step(7, torch.float32)
    dropped = routing.weights.clone()
    dropped[:, -1] = 0  # each token's last expert's output lost
    assert not close(cpu_moe.run_op(x, Routing(routing.experts, dropped), weights), x, routing, weights)


def test_red_the_wrong_expert() -> None:
    weights = experts(torch.float32)
    x, routing = step(7, torch.float32)
    shifted = Experts(list(weights.gate_up[1:]) + [weights.gate_up[0]], weights.down)  # gate_up of expert e + 1
    assert not close(cpu_moe.run_op(x, routing, shifted), x, routing, weights)


def test_red_a_sum_order_that_depends_on_the_step() -> None:
    """Planted: each token's outputs added largest expert group first (an order the step's
    other tokens decide; built from one-slot calls of the op): the invariance guard above
    goes red — a token alone (every group of one) sums in another order than in the step."""
    if not cpu_moe.row_invariant():
        pytest.skip("the invariance guard runs on AVX-512 builds")
    weights = experts(torch.float32)
    x, routing = step(33, torch.float32)

    def largest_group_first(x: torch.Tensor, routing: Routing) -> torch.Tensor:
        sizes = torch.bincount(routing.experts.reshape(-1), minlength=EXPERTS).tolist()
        rows = []
        for t in range(len(x)):
            total = torch.zeros(1, HIDDEN)
            for slot in sorted(range(TOP_K), key=lambda s: (-sizes[int(routing.experts[t, s])], int(routing.experts[t, s]))):
                one = Routing(routing.experts[t : t + 1, slot : slot + 1], routing.weights[t : t + 1, slot : slot + 1])
                total = total + cpu_moe.run_op(x[t : t + 1], one, weights)
            rows.append(total)
        return torch.cat(rows)

    alone = torch.cat([largest_group_first(x[t : t + 1], Routing(routing.experts[t : t + 1], routing.weights[t : t + 1]))
                       for t in range(33)])
    assert not torch.equal(largest_group_first(x, routing), alone)


def quantized_experts(mode: str, dtype: torch.dtype) -> Experts:
    """The kernels' int8 or 4-bit experts (hidden 96, width 64: whole groups of 32)."""
    from gpu.quant.dispatch import QuantizedWeight
    from gpu.quant.linears import Int4Linear, Int8Linear

    cls = Int8Linear if mode == "int8" else Int4Linear
    torch.manual_seed(4)
    return Experts(
        gate_up=[QuantizedWeight(cls.quantize(torch.randn(128, 96) / 4, dtype, kernels=True), None) for _ in range(EXPERTS)],
        down=[QuantizedWeight(cls.quantize(torch.randn(96, 64) / 3, dtype, kernels=True), None) for _ in range(EXPERTS)],
    )


def quantized_step(tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, Routing]:
    torch.manual_seed(tokens)
    return torch.randn(tokens, 96).to(dtype), softmax_topk(torch.randn(tokens, EXPERTS).to(dtype), TOP_K, True)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_experts_match_torch_moe(mode: str, dtype: torch.dtype) -> None:
    """The packed experts in one call against `moe: torch` running the same quantized
    linears (the same kernels' products; another SiLU and sum order)."""
    from gpu.quant.dispatch import make_linear

    weights = quantized_experts(mode, dtype)
    impl = CpuMoE()
    for tokens in (1, 7, 40):
        x, routing = quantized_step(tokens, dtype)
        assert isinstance(impl.plan(x, weights), cpu_moe.QuantizedExperts)
        assert near(impl(make_linear(F.linear, False), x, routing, weights),
                    TorchMoE()(make_linear(F.linear, False), x, routing, weights))


def test_token_limits_per_format() -> None:
    """Dense and 4-bit experts up to MAX_TOKENS, int8 ones up to MAX_TOKENS_INT8."""
    impl = CpuMoE()
    for mode, limit in (("int8", cpu_moe.MAX_TOKENS_INT8), ("int4", cpu_moe.MAX_TOKENS)):
        weights = quantized_experts(mode, torch.bfloat16)
        assert impl.plan(torch.zeros(limit[torch.bfloat16], 96, dtype=torch.bfloat16), weights) is not None
        assert impl.plan(torch.zeros(limit[torch.bfloat16] + 1, 96, dtype=torch.bfloat16), weights) is None


def test_red_an_int4_block_read_with_the_wrong_scale() -> None:
    """Planted: expert 0's first tile read with its first group's scales doubled: red."""
    from gpu.quant.dispatch import make_linear

    weights = quantized_experts("int4", torch.float32)
    x, routing = quantized_step(7, torch.float32)
    assert (routing.experts == 0).any()
    plan = cpu_moe.plan_for(weights, torch.float32)
    assert isinstance(plan, cpu_moe.QuantizedExperts)
    wrong = plan.gate_up[0].clone()
    scales = wrong[0, :32].view(torch.float16)  # tile 0, group 0: the 16 rows' d (fp16)
    scales.mul_(2)
    planted = plan._replace(gate_up=[wrong, *plan.gate_up[1:]])
    expected = TorchMoE()(make_linear(F.linear, False), x, routing, weights)
    assert near(cpu_moe.run_quantized_op(x, routing, plan), expected)
    assert not near(cpu_moe.run_quantized_op(x, routing, planted), expected)


def test_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """More than MAX_TOKENS tokens, or quantized experts the kernels do not hold (torch's
    int8 op): `moe: torch`'s path."""
    from gpu.quant.dispatch import QuantizedWeight
    from gpu.quant.linears import Int8Linear

    calls: list[int] = []
    real = cpu_moe.run_op
    def counted(x: torch.Tensor, r: Routing, e: Experts) -> torch.Tensor:
        calls.append(len(x))
        return real(x, r, e)

    monkeypatch.setattr(cpu_moe, "run_op", counted)
    impl = CpuMoE()
    weights = experts(torch.float32)
    most = cpu_moe.MAX_TOKENS[torch.float32]
    for tokens in (3, most, most + 1):
        x, routing = step(tokens, torch.float32)
        assert close(impl(F.linear, x, routing, weights), x, routing, weights)
    assert calls == [3, most]
    quantized = Experts([QuantizedWeight(Int8Linear.quantize(torch.as_tensor(w), torch.float32), None)
                         for w in weights.gate_up],
                        weights.down)
    from gpu.quant.dispatch import make_linear

    x, routing = step(3, torch.float32)
    impl(make_linear(F.linear, False), x, routing, quantized)
    assert calls == [3, most]


def test_auto_picks_it_outside_deterministic_mode_only() -> None:
    from kernel.config import ConfigError, load_config
    from kernel.numerics_choice import resolve_moe

    cpu_dev = torch.device("cpu")
    assert resolve_moe(load_config(None, {}), cpu_dev, True) == "cpu"
    assert resolve_moe(load_config(None, {}), cpu_dev, False) == "torch"  # model.cpu_kernels off
    assert resolve_moe(load_config(None, {"deterministic": True}), cpu_dev, True) == "torch"
    assert resolve_moe(load_config(None, {"graphs.mode": "emulate"}), cpu_dev, True) == "dense"
    assert resolve_moe(load_config(None, {"model.moe": "torch"}), cpu_dev, True) == "torch"
    with pytest.raises(ConfigError, match="model.moe: cpu"):
        resolve_moe(load_config(None, {"model.moe": "cpu", "deterministic": True}), cpu_dev, True)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.tiny_models import build_tiny

    return str(build_tiny("qwen3_moe", Path(tmp_path_factory.mktemp("cpu_moe")) / "qwen3_moe"))


@pytest.fixture(scope="module")
def moe_folder_32(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Experts 64 wide (whole groups of 32: the kernels' int8 tiles take them)."""
    from tests.tiny_models import build_tiny

    folder = Path(tmp_path_factory.mktemp("cpu_moe_32")) / "qwen3_moe"
    return str(build_tiny("qwen3_moe", folder, shape={"moe_intermediate_size": 64}))


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_engine_matches_torch_moe(moe_folder: str, moe_folder_32: str, quantization: str) -> None:
    """The engine with `moe: cpu` (float32; dense, or int8 experts in the kernels' tiles)
    against `moe: torch`: the same greedy tokens and logprobs within float32 rounding,
    prompts batched and decoded together; nothing leaked (the suite's leak check)."""
    from kernel import Engine
    from tests.conftest import FLOAT32
    from tests.test_moe import prompt

    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "return_logprob": True}
    prompts = [prompt(i, 5 + 6 * i) for i in range(4)]
    outs: dict[str, Any] = {}
    for moe in ("torch", "cpu"):
        folder = moe_folder if quantization == "none" else moe_folder_32
        engine = Engine(None, {**FLOAT32, "model.path": folder, "model.moe": moe, "cache.num_pages": 128,
                               "cache.page_size": 4, "model.quantization": quantization})
        try:
            impl = engine.engine.parts.runner.model.moe.impl
            assert type(impl).__name__ == ("CpuMoE" if moe == "cpu" else "TorchMoE")
            if moe == "cpu":  # the op takes this model's experts
                block = next(iter(engine.engine.parts.runner.model.moe.blocks.values()))
                assert impl.plan(torch.zeros(1, block.router.shape[1]), block.experts) is not None
            outs[moe] = engine.generate(prompts, params)
        finally:
            engine.shutdown()
    for a, b in zip(outs["torch"], outs["cpu"]):
        assert a["output_ids"] == b["output_ids"]
        la = [lp for lp, *_ in a["meta_info"]["output_token_logprobs"]]
        lb = [lp for lp, *_ in b["meta_info"]["output_token_logprobs"]]
        assert max(abs(p - q) for p, q in zip(la, lb)) < 1e-4


@kernel_variants.opt_in
@pytest.mark.parametrize("target", list(kernel_variants.TARGETS))
def test_code_paths_of_other_cpus(target: str, tmp_path: Path) -> None:
    """This file's tests again with the kernel built for other CPUs (AVX2-only, plain x86-64,
    AVX-512 without AMX): opt-in, tests/kernel_variants.py."""
    kernel_variants.run_for(target, __file__, tmp_path)
