"""`moe: triton` (gpu/moe/triton_moe.py, gpu/kernels/triton_moe.py): values against `moe:
torch`, a token's bits independent of its batch, no host read (static shapes), planted
bookkeeping and combine bugs red, and the tiny Qwen3-MoE checkpoint in the engine, eager
and in emulated graph buckets. In the Triton interpreter on CPU (tiny shapes: it is slow);
compiled on CUDA.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:  # as the other triton tests: set before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from gpu.kernels import triton_moe as kernels
from gpu.moe.routing import Routing
from gpu.moe.torch_moe import Experts, TorchMoE
from gpu.moe.triton_moe import TritonMoE
from kernel import Engine
from tests.conftest import GRAPHS_EMULATE, graph_replays
from tests.test_moe import make, prompt
from tests.tiny_models import build_tiny

DEVICE = torch.device("cuda" if CUDA else "cpu")
# hidden not a multiple of BLOCK_K and width under BLOCK_N: the K and column masks matter.
HIDDEN, WIDTH, NUM_EXPERTS, TOP_K = 40, 24, 6, 2


def make_experts(seed: int, dtype: torch.dtype = torch.float32) -> Experts:
    g = torch.Generator().manual_seed(seed)
    return Experts(
        gate_up=[(torch.randn(2 * WIDTH, HIDDEN, generator=g) / 4).to(dtype).to(DEVICE) for _ in range(NUM_EXPERTS)],
        down=[(torch.randn(HIDDEN, WIDTH, generator=g) / 3).to(dtype).to(DEVICE) for _ in range(NUM_EXPERTS)],
    )


def make_inputs(tokens: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, Routing]:
    """x and a skewed top-2 routing: experts 4 and 5 get no token, expert 3 three in four
    (more than a block of them at 40 tokens), the rest spread over 0-2."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for t in range(tokens):
        first = 3 if t % 4 else int(torch.randint(0, 3, (1,), generator=g))
        others = [e for e in range(4) if e != first]
        rows.append([first, others[int(torch.randint(0, 3, (1,), generator=g))]])
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=g), dim=-1).to(dtype)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    return x.to(DEVICE), Routing(torch.tensor(rows, dtype=torch.int64).view(tokens, TOP_K).to(DEVICE), weights.to(DEVICE))


def triton_moe(x: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
    return TritonMoE()(F.linear, x, routing, experts)  # type: ignore[no-any-return]


def torch_moe(x: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
    return TorchMoE()(F.linear, x, routing, experts)


def matches_torch(tokens: int = 40, seed: int = 1) -> bool:
    x, routing = make_inputs(tokens, seed)
    experts = make_experts(seed)
    return torch.allclose(triton_moe(x, routing, experts), torch_moe(x, routing, experts), atol=1e-5, rtol=1e-5)


# ---- values ---------------------------------------------------------------------------
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_matches_torch_float32(tokens: int) -> None:
    x, routing = make_inputs(tokens, seed=tokens)
    experts = make_experts(seed=tokens)
    got = triton_moe(x, routing, experts)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, torch_moe(x, routing, experts), atol=1e-5, rtol=1e-5)


def test_matches_torch_bfloat16() -> None:
    if not CUDA:
        pytest.skip("the Triton interpreter's bf16 tl.dot reads bf16 operands as integers "
                    "(tests/test_triton_invariant.py); checked compiled on CUDA")
    x, routing = make_inputs(40, seed=2, dtype=torch.bfloat16)
    experts = make_experts(seed=2, dtype=torch.bfloat16)
    got = triton_moe(x, routing, experts)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), torch_moe(x, routing, experts).float(), atol=3e-2, rtol=3e-2)


def test_no_tokens() -> None:
    x, routing = make_inputs(0, seed=0)
    assert triton_moe(x, routing, make_experts(0)).shape == (0, HIDDEN)


# ---- the padded order -----------------------------------------------------------------
def test_align_groups_each_pair_once_in_its_experts_blocks() -> None:
    _, routing = make_inputs(40, seed=3)
    plan = kernels.align(routing.experts, NUM_EXPERTS)
    pairs, block = routing.experts.numel(), kernels.BLOCK_M
    ids, block_expert = plan.sorted_pairs.cpu(), plan.block_expert.cpu()
    real = ids[ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair once
    assert torch.equal(ids[ids >= pairs], torch.full_like(ids[ids >= pairs], pairs))  # padding marked P
    flat = routing.experts.reshape(-1).cpu()
    for b, expert in enumerate(block_expert.tolist()):
        rows = ids[b * block : (b + 1) * block]
        rows = rows[rows < pairs]
        if expert == NUM_EXPERTS:
            assert not len(rows)  # an unused block holds no pair
        assert torch.equal(flat[rows], torch.full_like(rows, expert))
    for e in range(NUM_EXPERTS):  # within an expert, token order
        mine = real[flat[real] == e]
        assert torch.equal(mine, mine.sort().values)
    assert set(block_expert.tolist()) == {0, 1, 2, 3, NUM_EXPERTS}  # 4 and 5 have no block


def test_bookkeeping_sizes_depend_only_on_tokens_topk_experts() -> None:
    """All tokens on two experts, or spread over six: the same sizes, from (T, k, E) alone."""
    tokens = 13
    piled = torch.tensor([[0, 1]] * tokens, device=DEVICE)
    spread = torch.stack([torch.arange(2, device=DEVICE) + 2 * (t % 3) for t in range(tokens)])
    size = kernels.padded_size(tokens, TOP_K, NUM_EXPERTS)
    for experts in (piled, spread):
        plan = kernels.align(experts, NUM_EXPERTS)
        assert plan.sorted_pairs.shape == (size,) and plan.block_expert.shape == (size // kernels.BLOCK_M,)
    assert size == -(-(tokens * TOP_K + NUM_EXPERTS * (kernels.BLOCK_M - 1)) // kernels.BLOCK_M) * kernels.BLOCK_M


def test_no_host_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call reads nothing of the routing on the host: every tensor -> Python value
    conversion raises during it (on CUDA, any synchronizing call too)."""
    x, routing = make_inputs(40, seed=4)
    experts = make_experts(4)
    impl = TritonMoE()
    impl.stacked(experts)  # the one-off stacking, before the step (the graph runner's warm-up)
    want = torch_moe(x, routing, experts)

    def host_read(*args: Any) -> Any:
        raise AssertionError("host read in the MoE step")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    if CUDA:
        torch.cuda.set_sync_debug_mode("error")
    try:
        got = impl(F.linear, x, routing, experts)
    finally:
        if CUDA:
            torch.cuda.set_sync_debug_mode("default")
        monkeypatch.undo()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_red_host_read_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the group sizes read on the host (as `moe: torch` does): the guard trips."""
    align = kernels.align

    def reads_counts(experts: torch.Tensor, num_experts: int) -> Any:
        torch.bincount(experts.reshape(-1), minlength=num_experts).tolist()
        return align(experts, num_experts)

    monkeypatch.setattr(kernels, "align", reads_counts)
    # On CUDA the sync debug mode may trip first (bincount syncs), as a RuntimeError.
    with pytest.raises((AssertionError, RuntimeError), match="host read|synchroniz"):
        test_no_host_read(monkeypatch)


# ---- batch invariance -----------------------------------------------------------------
def test_a_tokens_bits_do_not_depend_on_its_batch() -> None:
    """Token 0's output alone, first in a batch of 14 and 10th in another 14 (other
    tokens, so other block neighbours and another row within its blocks): equal bits."""
    x, routing = make_inputs(28, seed=5)
    experts = make_experts(5)
    impl = TritonMoE()

    def run(rows: list[int]) -> torch.Tensor:
        picked = torch.tensor(rows, device=DEVICE)
        return impl(F.linear, x[picked], Routing(routing.experts[picked], routing.weights[picked]), experts)

    alone = run([0])
    assert torch.equal(run(list(range(14)))[:1], alone)
    assert torch.equal(run(list(range(14, 23)) + [0] + list(range(23, 27)))[9:10], alone)


@pytest.mark.skipif(CUDA, reason="compiled, a float32 tile accumulates K in order by FMA whatever BLOCK_K "
                                 "(tests/test_triton_invariant.py): this plant changes no bit there")
def test_red_tile_chosen_by_the_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: a K tile picked by the token count (as an autotuner would): the partial
    sums then run in another grouping in batches, and the invariance check goes red."""
    fused = kernels.fused_moe

    def by_batch(x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        monkeypatch.setattr(kernels, "BLOCK_K", 16 if len(x) > 1 else 32)
        return fused(x, *args)

    monkeypatch.setattr(kernels, "fused_moe", by_batch)
    with pytest.raises(AssertionError):
        test_a_tokens_bits_do_not_depend_on_its_batch()


# ---- planted bugs ---------------------------------------------------------------------
def planted_align(change: Callable[[kernels.Alignment, int], kernels.Alignment]) -> Callable[..., Any]:
    align = kernels.align
    return lambda experts, num_experts: change(align(experts, num_experts), experts.numel())


def test_red_block_expert_off_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    def shift(plan: kernels.Alignment, pairs: int) -> kernels.Alignment:
        used = plan.block_expert < NUM_EXPERTS
        return plan._replace(block_expert=torch.where(used, (plan.block_expert + 1) % NUM_EXPERTS, plan.block_expert))

    assert matches_torch()
    monkeypatch.setattr(kernels, "align", planted_align(shift))
    assert not matches_torch()


def test_red_padding_rows_not_marked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: padding positions hold pair 0 instead of the marker: every padded block
    computes token 0 through its own expert and writes it over pair 0's row."""

    def unmarked(plan: kernels.Alignment, pairs: int) -> kernels.Alignment:
        ids = plan.sorted_pairs
        return plan._replace(sorted_pairs=torch.where(ids == pairs, torch.zeros_like(ids), ids))

    monkeypatch.setattr(kernels, "align", planted_align(unmarked))
    assert not matches_torch()


@pytest.mark.parametrize("how", ["dropped", "twice"])
def test_red_routing_weight_in_the_combine(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    combine = kernels.combine

    def planted(pair_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return combine(pair_out, torch.ones_like(weights) if how == "dropped" else weights * weights)

    monkeypatch.setattr(kernels, "combine", planted)
    assert not matches_torch()


# ---- the implementation's contract ----------------------------------------------------
def test_quantized_experts_are_refused() -> None:
    from gpu.quant.dispatch import QuantizedWeight
    from gpu.quant.linears import Int8Linear

    experts = make_experts(6)
    dense = experts.gate_up[0]
    assert isinstance(dense, torch.Tensor)
    quantized = QuantizedWeight(Int8Linear.quantize(dense.cpu(), dense.dtype), None)
    x, routing = make_inputs(3, seed=6)
    with pytest.raises(ValueError, match="model.quantization: none"):
        triton_moe(x, routing, experts._replace(gate_up=[quantized, *experts.gate_up[1:]]))


def test_stacked_weights_cached_per_experts() -> None:
    impl, first, second = TritonMoE(), make_experts(7), make_experts(8)
    stacked = impl.stacked(first)
    assert impl.stacked(first) is stacked  # built once
    assert not torch.equal(impl.stacked(second).gate_up, stacked.gate_up)  # another model's: its own
    assert stacked.gate_up.shape == (NUM_EXPERTS, 2 * WIDTH, HIDDEN) and stacked.down.is_contiguous()


@pytest.mark.skipif(CUDA, reason="the kernels run compiled on CUDA")
def test_compiled_kernels_refused_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "INTERPRETED", False)
    x, routing = make_inputs(2, seed=9)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_moe(x, routing, make_experts(9))


# ---- in the engine --------------------------------------------------------------------
PARAMS = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "return_logprob": True}
PROMPTS = [prompt(1, 13), prompt(2, 5), prompt(3, 20)]


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny("qwen3_moe", Path(tmp_path_factory.mktemp("triton_moe")) / "qwen3_moe"))


def run_engine(folder: str, **extra: Any) -> tuple[list[dict[str, Any]], Engine]:
    engine = make(folder, **extra)
    try:
        outs = engine.generate(PROMPTS, PARAMS)
    finally:
        engine.shutdown()
    assert isinstance(outs, list)
    return outs, engine


@pytest.fixture(scope="module")
def reference(moe_folder: str) -> Iterator[list[dict[str, Any]]]:
    yield run_engine(moe_folder, **{"model.moe": "torch"})[0]


def same_greedy_run(outs: list[dict[str, Any]], refs: list[dict[str, Any]]) -> None:
    for out, ref in zip(outs, refs, strict=True):
        assert out["output_ids"] == ref["output_ids"]
        got = [lp for lp, *_ in out["meta_info"]["output_token_logprobs"]]
        want = [lp for lp, *_ in ref["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(want, abs=1e-4)


def test_engine_matches_torch_moe(moe_folder: str, reference: list[dict[str, Any]]) -> None:
    same_greedy_run(run_engine(moe_folder, **{"model.moe": "triton"})[0], reference)


def test_engine_graph_buckets(moe_folder: str, reference: list[dict[str, Any]]) -> None:
    """Accepted by the graph runner (static shapes; `moe: torch` is refused there), and its
    replayed steps, padding rows routed like tokens, give the eager reference's tokens."""
    outs, engine = run_engine(moe_folder, **GRAPHS_EMULATE,
                              **{"model.moe": "triton", "model.attention": "deterministic"})
    same_greedy_run(outs, reference)
    replays = graph_replays(engine)
    assert replays["decode"] > 0 and replays["prefill"] > 0
