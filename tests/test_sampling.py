from __future__ import annotations

import math

import pytest
import torch

from gpu.sampling import SamplingBatch, apply_penalties, gumbel_noise, mix_seed, sample
from kernel.sampling_params import SamplingParams

CPU = torch.device("cpu")


def build(params: list[SamplingParams], vocab: int, seeds: list[int] | None = None,
          steps: list[int] | None = None, prompts: list[list[int]] | None = None,
          outputs: list[list[int]] | None = None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(params, seeds or [0] * n, steps or [0] * n,
                               prompts or [[] for _ in range(n)], outputs or [[] for _ in range(n)],
                               vocab, CPU)


def random_logits(b: int, v: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax() -> None:
    logits = random_logits(5, 50)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5, top_logprobs_num=3)] * 5
    batch = build(params, 50, prompts=[[1, 2]] * 5)
    before = logits.clone()
    out = sample(logits, batch)
    assert torch.equal(logits, before), "sample must not modify its input"
    penalized = apply_penalties(logits, batch)
    assert out.token_ids == penalized.argmax(-1).tolist()
    raw = torch.log_softmax(logits, -1)
    for i, t in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, t].item(), abs=1e-6)
        top = raw[i].topk(3)
        assert [t for t, _ in out.top_logprobs[i]] == top.indices.tolist()
        assert [lp for _, lp in out.top_logprobs[i]] == pytest.approx(top.values.tolist(), abs=1e-6)


def test_all_greedy_batch_builds_no_tensors() -> None:
    batch = build([SamplingParams(temperature=0.0)] * 3, 10)
    assert batch.all_greedy and not batch.any_penalty and batch.temperature is None


def test_ties_pick_lowest_id() -> None:
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0]])
    assert sample(logits, build([SamplingParams(temperature=0.0)], 4)).token_ids == [1]


def test_top_logprobs_only_where_asked() -> None:
    params = [SamplingParams(top_logprobs_num=2), SamplingParams(), SamplingParams(top_logprobs_num=4)]
    out = sample(random_logits(3, 20), build(params, 20))
    assert [len(t) for t in out.top_logprobs] == [2, 0, 4]


def test_top_k_1_equals_greedy() -> None:
    logits = random_logits(8, 100, seed=1)
    out = sample(logits, build([SamplingParams(temperature=1.3, top_k=1)] * 8, 100, seeds=list(range(8))))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_keeps_only_top_token() -> None:
    logits = random_logits(4, 100, seed=2)
    for step in range(20):
        batch = build([SamplingParams(top_p=1e-6)] * 4, 100, seeds=[1, 2, 3, 4], steps=[step] * 4)
        assert sample(logits, batch).token_ids == logits.argmax(-1).tolist()


def test_top_p_keeps_nucleus() -> None:
    # probs 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps exactly the first two tokens.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {sample(logits, build([SamplingParams(top_p=0.7)], 4, seeds=[9], steps=[s])).token_ids[0]
            for s in range(300)}
    assert seen == {0, 1}


def test_top_k_keeps_k_tokens() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, 2.5]])
    seen = {sample(logits, build([SamplingParams(top_k=2, temperature=5.0)], 5, seeds=[1], steps=[s]))
            .token_ids[0] for s in range(300)}
    assert seen == {1, 4}


def test_min_p_filters_relative_to_max() -> None:
    # probs 0.4, 0.3, 0.2, 0.1: min_p 0.6 keeps p >= 0.24, i.e. tokens 0 and 1.
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    seen = {sample(logits, build([SamplingParams(min_p=0.6)], 4, seeds=[5], steps=[s])).token_ids[0]
            for s in range(300)}
    assert seen == {0, 1}


def test_repetition_penalty_hf_style_over_prompt_and_output() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    batch = build([SamplingParams(repetition_penalty=2.0)], 5, prompts=[[0, 1]], outputs=[[1, 4]])
    got = apply_penalties(logits, batch)
    assert got.tolist() == [[1.0, -4.0, 2.0, -2.0, 0.5]]


def test_frequency_and_presence_penalties_over_output_only() -> None:
    logits = torch.zeros(1, 5)
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)]
    batch = build(params, 5, prompts=[[0, 0, 0]], outputs=[[1, 1, 1, 2]])
    assert apply_penalties(logits, batch).tolist() == [[0.0, -2.5, -1.5, 0.0, 0.0]]


def test_penalties_apply_per_row() -> None:
    logits = torch.ones(3, 4)
    params = [SamplingParams(), SamplingParams(presence_penalty=1.0), SamplingParams(repetition_penalty=2.0)]
    batch = build(params, 4, prompts=[[0], [0], [0]], outputs=[[1], [1], [1]])
    assert apply_penalties(logits, batch).tolist() == [[1, 1, 1, 1], [1, 0, 1, 1], [0.5, 0.5, 1, 1]]


def test_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    batch = build([SamplingParams(temperature=0.0, frequency_penalty=1.0)], 3, outputs=[[0]])
    assert sample(logits, batch).token_ids == [1]


def test_same_seed_and_step_same_token_whatever_the_batch() -> None:
    vocab = 1000
    row = random_logits(1, vocab, seed=3)[0] * 0.3  # flat enough that draws vary
    target = SamplingParams(temperature=1.0, top_p=0.95, min_p=0.01)
    other = [SamplingParams(temperature=0.0), SamplingParams(top_k=5), SamplingParams(frequency_penalty=1.0)]
    for step in range(3):
        alone = sample(row.unsqueeze(0), build([target], vocab, seeds=[42], steps=[step])).token_ids[0]
        for size in (2, 5, 9):
            for pos in (0, size // 2, size - 1):
                logits = random_logits(size, vocab, seed=step * 31 + size)
                logits[pos] = row
                params = [other[i % 3] for i in range(size)]
                params[pos] = target
                seeds = [7 + i for i in range(size)]
                seeds[pos] = 42
                steps = [step + 3 * i for i in range(size)]
                steps[pos] = step
                outs = [[i] for i in range(size)]
                got = sample(logits, build(params, vocab, seeds, steps, outputs=outs)).token_ids[pos]
                assert got == alone


def test_different_seeds_draw_differently() -> None:
    logits = torch.zeros(2, 500)
    draws = [sample(logits, build([SamplingParams()] * 2, 500, seeds=[1, 2], steps=[s, s])).token_ids
             for s in range(50)]
    assert sum(a != b for a, b in draws) >= 45
    assert len({a for a, _ in draws}) >= 40  # steps of one seed differ too


def test_noise_rows_independent_and_key_mix_spreads() -> None:
    keys = [mix_seed(1, s) for s in range(4)]
    assert len(set(keys)) == 4
    full = gumbel_noise(keys, 64, CPU)
    assert torch.equal(full[2], gumbel_noise([keys[2]], 64, CPU)[0])
    assert torch.isfinite(full).all()


def test_empirical_distribution_matches_softmax() -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = torch.log(probs).repeat(500, 1)
    counts = torch.zeros(4)
    for chunk in range(8):  # 8 x 500 = 4000 draws, each at its own (seed, step)
        batch = build([SamplingParams()] * 500, 4, seeds=[chunk] * 500, steps=list(range(500)))
        for t in sample(logits, batch).token_ids:
            counts[t] += 1
    freq = counts / counts.sum()
    # 4 standard deviations of a binomial proportion at n=4000.
    tol = 4 * math.sqrt(0.25 / 4000)
    assert torch.allclose(freq, probs, atol=tol), freq


def test_temperature_sharpens() -> None:
    logits = torch.log(torch.tensor([0.3, 0.7])).repeat(2000, 1)
    batch = build([SamplingParams(temperature=0.25)] * 2000, 2, seeds=[3] * 2000, steps=list(range(2000)))
    share = sum(sample(logits, batch).token_ids) / 2000
    expected = 0.7**4 / (0.7**4 + 0.3**4)
    assert abs(share - expected) < 0.03


def test_shape_mismatch_rejected() -> None:
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 5), build([SamplingParams()], 5))
