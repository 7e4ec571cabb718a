"""Tensor parallelism at the model level (gpu/parallel/): a model split over 2-4 ranks
(threads, tests/tp_ranks.py) gives the unsplit model's logits, prefill and a decode step
over its own KV, for heads that divide, KV heads replicated, QK-norm, QKV bias and the
row-parallel biases added after the all-reduce. Each split rule's planted bug goes red."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gpu.loader import load_checkpoint
from gpu.models.llama import LlamaModel
from gpu.parallel import shard as shard_mod
from gpu.parallel.group import TensorParallel
from gpu.parallel.shard import ShardError, check_divisible, kv_heads_of, shard_checkpoint
from kernel.registry import lookup
from tests.tiny_models import VOCAB, build_tiny, build_tiny_llama
from tests.tp_ranks import prefill_then_decode, run_ranks, sharded_logits

IDS = [5, 17, 99, 3, 250, 41, 77, 8, 300, 12, 64]


def _reference(path: Path) -> tuple[object, dict, torch.Tensor]:
    ckpt = load_checkpoint(str(path), torch.float32)
    full = lookup("model", ckpt.arch.architecture)(ckpt.arch, ckpt.weights, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        return ckpt.arch, ckpt.weights, prefill_then_decode(full, IDS)


CASES = {
    # name: (builder, ranks)
    "llama-heads-divide": (lambda f: build_tiny_llama(f, 6, 2), 2),
    "llama-kv-replicated": (lambda f: build_tiny_llama(f, 6, 1), 3),
    "llama-kv-2-over-4": (lambda f: build_tiny_llama(f, 4, 2), 4),
    "llama-biases": (lambda f: build_tiny_llama(f, 6, 3, biases=True), 3),
    "llama-odd-vocab": (lambda f: build_tiny_llama(f, 6, 3, vocab=509), 3),  # 509 rows: the last shard is padded
    "qwen2-qkv-bias": (lambda f: build_tiny("qwen2", f), 2),
    "qwen3-qk-norm": (lambda f: build_tiny("qwen3", f), 2),
    # Experts split along their intermediate width, the router whole: one all-reduce a block.
    "qwen3_moe-experts": (lambda f: build_tiny("qwen3_moe", f), 2),
    "qwen3_moe-experts-over-4": (lambda f: build_tiny("qwen3_moe", f), 4),
    "mixtral-experts": (lambda f: build_tiny("mixtral", f), 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_split_model_gives_the_whole_models_logits(case: str, tmp_path: Path) -> None:
    build, size = CASES[case]
    arch, weights, want = _reference(build(tmp_path))
    got = sharded_logits(arch, weights, size, IDS)  # type: ignore[arg-type]
    for rank, logits in enumerate(got):
        assert logits.shape == want.shape, rank
        torch.testing.assert_close(logits, want, rtol=0, atol=2e-5, msg=f"rank {rank}")
    assert all(torch.equal(got[0], g) for g in got[1:]), "every rank gathers the same logits"


def test_planted_bias_on_every_rank_goes_red(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arch, weights, want = _reference(build_tiny_llama(tmp_path, 6, 3, biases=True))

    def reduce_bias_per_rank(self: LlamaModel, partial: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert self.tp is not None
        return self.tp.all_reduce(partial if bias is None else partial + bias)  # the bug: size x bias

    monkeypatch.setattr(LlamaModel, "_reduce", reduce_bias_per_rank)
    got = sharded_logits(arch, weights, 3, IDS)  # type: ignore[arg-type]
    assert (got[0] - want).abs().max() > 1e-2


def test_planted_kv_heads_not_replicated_goes_red(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arch, weights, want = _reference(build_tiny_llama(tmp_path, 4, 2))
    # The bug: KV heads dealt round-robin instead of to the ranks whose query heads read them.
    monkeypatch.setattr(shard_mod, "kv_heads_of", lambda a, rank, size: range(rank % a.num_kv_heads,
                                                                           rank % a.num_kv_heads + 1))
    got = sharded_logits(arch, weights, 4, IDS)  # type: ignore[arg-type]
    assert (got[0] - want).abs().max() > 1e-2


def test_kv_heads_follow_the_query_heads() -> None:
    arch = load_arch(heads=8, kv=2)
    assert [list(kv_heads_of(arch, r, 4)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(kv_heads_of(arch, r, 2)) for r in range(2)] == [[0], [1]]
    assert [list(kv_heads_of(load_arch(heads=8, kv=8), r, 2)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def load_arch(heads: int, kv: int):  # type: ignore[no-untyped-def]
    from gpu.model_config import ModelArchConfig

    return ModelArchConfig("llama", VOCAB, 64, 128, 2, heads, kv, 8, 1e-6, 1e4, 256, False)


@pytest.mark.parametrize(("heads", "kv", "size", "why"), [
    (9, 3, 2, "9 attention heads"), (6, 4, 3, "4 KV heads"), (8, 2, 3, "8 attention heads"),
])
def test_a_split_that_does_not_divide_is_refused(heads: int, kv: int, size: int, why: str) -> None:
    with pytest.raises(ShardError, match=why):
        check_divisible(load_arch(heads, kv), size)


def test_4bit_blocks_split_on_whole_blocks_only() -> None:
    from gpu.quant.gguf_blocks import Q4Blocks, block_bytes, unpack_q4

    arch = load_arch(heads=4, kv=4)  # head_dim 8: o_proj's 32 input columns
    data = torch.randint(0, 255, (64, 1 * block_bytes("Q4_1")), dtype=torch.uint8)
    blocks = {"model.layers.0.self_attn.o_proj.weight": Q4Blocks("Q4_1", data),
              "model.layers.0.mlp.gate_proj.weight": Q4Blocks("Q4_1", torch.randint(0, 255, (128, 2 * 20),
                                                                                      dtype=torch.uint8))}
    weights = {n: torch.zeros(b.data.shape[0], b.in_features) for n, b in blocks.items()}
    with pytest.raises(ShardError, match="whole"):
        shard_checkpoint(arch, weights, blocks, 0, 2)  # 16 columns a rank: half a block
    wide = dict(blocks, **{"model.layers.0.self_attn.o_proj.weight": Q4Blocks("Q4_1", torch.randint(
        0, 255, (64, 2 * block_bytes("Q4_1")), dtype=torch.uint8))})
    weights = {n: torch.zeros(b.data.shape[0], b.in_features) for n, b in wide.items()}
    arch = load_arch(heads=8, kv=8)  # 64 columns: one block a rank
    parts = [shard_checkpoint(arch, weights, wide, r, 2).blocks for r in range(2)]
    whole = unpack_q4(wide["model.layers.0.self_attn.o_proj.weight"])[0]
    halves = [unpack_q4(p["model.layers.0.self_attn.o_proj.weight"])[0] for p in parts]
    assert torch.equal(torch.cat(halves, dim=1), whole)
    gates = [p["model.layers.0.mlp.gate_proj.weight"].data for p in parts]
    assert torch.equal(torch.cat(gates), wide["model.layers.0.mlp.gate_proj.weight"].data)


def test_ordered_all_reduce_sums_in_rank_order() -> None:
    """Deterministic mode's all-reduce: the same bits as adding the parts 0, 1, 2 in order."""
    parts = [torch.randn(5, 7) * 10 ** r for r in range(3)]

    def fn(rank: int, pg: object) -> torch.Tensor:
        tp = TensorParallel(rank, 3, VOCAB, 0, VOCAB, ordered=True, group=pg)
        return tp.all_reduce(parts[rank].clone())

    want = (parts[0] + parts[1]) + parts[2]
    assert all(torch.equal(got, want) for got in run_ranks(3, fn))


def test_planted_sparse_block_not_all_reduced_goes_red(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sparse layer's experts hold a slice of their width: forgetting the block's
    all-reduce (a separate path from the dense MLP's) leaves each rank a partial sum."""
    from gpu.models.llama_moe import Qwen3MoeModel

    arch, weights, want = _reference(build_tiny("qwen3_moe", tmp_path))
    monkeypatch.setattr(Qwen3MoeModel, "_mlp", lambda self, i, layer, x: (
        self.moe.forward(i, self.linear, x) if i in self.moe else LlamaModel._mlp(self, i, layer, x)))
    got = sharded_logits(arch, weights, 2, IDS)  # type: ignore[arg-type]
    assert (got[0] - want).abs().max() > 1e-2


def _qwen3_next_in_proj(arch: object, weights: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    from types import SimpleNamespace

    from gpu.models.hybrid_common import Weights
    from gpu.models.hybrid_moe import Qwen3NextModel

    return Qwen3NextModel._in_proj(SimpleNamespace(arch=arch), Weights(weights, torch.float32, torch.device("cpu")),
                                   prefix)  # type: ignore[arg-type]


def _in_proj_rows_of(arch: object, fused: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The rows of the whole fused [q | k | v | z | b | a] projection that rank's heads read."""
    a: Any = arch
    hk, hv, dk, dv = a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim
    pieces, start = [], 0
    for unit, heads in ((dk, hk), (dk, hk), (dv, hv), (dv, hv), (1, hv), (1, hv)):
        per = heads // size
        pieces.append(fused[start + rank * per * unit : start + (rank + 1) * per * unit])
        start += heads * unit
    return torch.cat(pieces)


@pytest.mark.parametrize("planted", [False, True])
def test_qwen3_next_fused_projections_split_by_key_head_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              planted: bool) -> None:
    """in_proj_qkvz / in_proj_ba are grouped by key head: a rank's slice, reordered as the
    model does at load, is exactly its heads' rows of the whole model's projection. Planted:
    split as if [q | k | v | z] were contiguous segments (Qwen3.5's layout) — red."""
    from tests.tiny_hybrid import build_tiny_qwen3_next

    ckpt = load_checkpoint(str(build_tiny_qwen3_next(tmp_path)), torch.float32)
    prefix = "model.layers.0.linear_attn."
    whole = _qwen3_next_in_proj(ckpt.arch, ckpt.weights, prefix)
    if planted:
        a = ckpt.arch
        hk, hv, dk, dv = a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim

        def segments(rules: Any, name: str, shape: torch.Size) -> Any:
            if name.endswith("in_proj_qkvz.weight"):
                mine_k, mine_v = rules.mine(hk), rules.mine(hv)
                return shard_mod.Split(0, (shard_mod.Part(dk, hk, mine_k), shard_mod.Part(dk, hk, mine_k),
                                           shard_mod.Part(dv, hv, mine_v), shard_mod.Part(dv, hv, mine_v)))
            return real(rules, name, shape)

        real = shard_mod._Rules.split
        monkeypatch.setattr(shard_mod._Rules, "split", segments)
    same = []
    for rank in range(2):
        shard = shard_checkpoint(ckpt.arch, ckpt.weights, {}, rank, 2)
        mine = _qwen3_next_in_proj(shard.arch, shard.weights, prefix)
        same.append(torch.equal(mine, _in_proj_rows_of(ckpt.arch, whole, rank, 2)))
    assert all(same) != planted
