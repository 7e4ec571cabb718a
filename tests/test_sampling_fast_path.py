"""Sampling computes logprobs only for the rows that ask for them: no log_softmax at all
when none does (the common greedy case), and the same values as a full pass when some do."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from gpu import sampling
from gpu.sampling import SamplingBatch, argmax_rows, sample
from kernel import Engine
from kernel.request import Request
from kernel.sampling_params import SamplingParams
from kernel.scheduling.step_loop import sampling_row

CPU = torch.device("cpu")
VOCAB = 300


def build(params: list[SamplingParams], want: list[bool] | None) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        list(range(n)),
        [3] * n,
        [[] for _ in range(n)],
        [[] for _ in range(n)],
        VOCAB,
        CPU,
        want_logprobs=want,
    )


def logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(7)) * 4


def test_no_row_asking_runs_no_log_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    x = logits(4)

    def boom(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("log_softmax ran although no row asked for logprobs")

    monkeypatch.setattr(torch, "log_softmax", boom)
    out = sample(x, build([SamplingParams(temperature=0.0)] * 4, [False] * 4))
    assert out.token_ids == x.argmax(-1).tolist()
    assert all(math.isnan(lp) for lp in out.logprobs)  # never a plausible value
    assert out.top_logprobs == [[]] * 4


def test_rows_asking_get_the_full_pass_values() -> None:
    x = logits(6)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=0.0, top_logprobs_num=3),
        SamplingParams(temperature=1.1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5),
    ]
    want = [True, False, False, True, False, True]  # row 2 asks through top_logprobs_num
    full, part = sample(x, build(params, None)), sample(x, build(params, want))
    assert part.token_ids == full.token_ids
    for i in range(6):
        if want[i] or params[i].top_logprobs_num:
            assert part.logprobs[i] == full.logprobs[i]  # the same row-wise op: `==`
        else:
            assert math.isnan(part.logprobs[i])
    assert part.top_logprobs[2] == full.top_logprobs[2] and len(part.top_logprobs[2]) == 3
    assert [len(t) for i, t in enumerate(part.top_logprobs) if i != 2] == [0] * 5


def test_want_logprobs_length_checked() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        build([SamplingParams()] * 2, [True])


@pytest.mark.parametrize(
    ("fields", "asks"),
    [({}, False), ({"return_logprob": True}, True), ({"top_logprobs_num": 2}, True)],
)
def test_sampling_row_asks_for_logprobs_as_the_request_does(fields: dict[str, object], asks: bool) -> None:
    req = Request(rid="r", prompt_ids=[1, 2, 3], params=SamplingParams.from_dict(fields), seed=0)
    assert sampling_row(req).logprobs is asks


def test_engine_tokens_same_with_and_without_logprobs(tiny_engine: Engine) -> None:
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = tiny_engine.generate("Count with me", greedy)
    asked = tiny_engine.generate("Count with me", {**greedy, "return_logprob": True})
    assert isinstance(plain, dict) and isinstance(asked, dict)
    assert plain["output_ids"] == asked["output_ids"]
    lps = [lp for lp, _ in asked["meta_info"]["output_token_logprobs"]]
    assert len(lps) == 12 and all(lp <= 0.0 and not math.isnan(lp) for lp in lps)


def test_argmax_rows_is_argmax_ties_and_nan_included() -> None:
    x = torch.randn(64, 5000, generator=torch.Generator().manual_seed(1))
    x[3, [10, 20, 4999]] = 100.0  # ties: the first one wins
    x[5, :] = 1.0  # a row of ties
    x[7, 123] = float("nan")  # NaN propagates as the maximum
    x[9, 4999] = float("inf")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x)[3] == 10 and argmax_rows(x)[5] == 0 and argmax_rows(x)[7] == 123


# Each setting that keeps a greedy row off the plain argmax (the first is plain).
NOT_PLAIN = [
    {}, {"repetition_penalty": 1.5}, {"frequency_penalty": 1.0}, {"presence_penalty": 1.0},
    {"logit_bias": {7: 30.0}}, {"top_logprobs_num": 2}, {"temperature": 0.8},
]


def outcome(result: Any) -> tuple[object, ...]:
    return result.token_ids, [repr(x) for x in result.logprobs], result.top_logprobs  # NaN == NaN here


@pytest.mark.parametrize("extra", NOT_PLAIN, ids=lambda e: next(iter(e), "plain"))
def test_plain_greedy_batches_build_no_tensors_and_pick_the_same(extra: dict[str, object],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of plain greedy rows (no logprobs, penalty, bias or grammar) is built without
    a tensor; every other batch takes the full build, and both sample what the full build
    samples (a fast path that also took one of the others goes red below)."""
    rows = [SamplingParams(**{"temperature": 0, **extra}), SamplingParams(temperature=0)]  # type: ignore[arg-type]
    history = [[5, 9, 9, 40], [7]]

    def built() -> SamplingBatch:
        return SamplingBatch.build(rows, [1, 2], [3, 3], history, history, VOCAB, CPU, want_logprobs=[False, False])

    x = logits(2)
    for r in range(2):  # the seen tokens lead by less than any penalty takes off
        x[r, [5, 9, 40]] = x[r].max() + 0.01
    if "temperature" in extra:
        x[0] = 0.0  # a flat row: the draw is almost surely not its argmax (token 0)
    fast = built()
    with monkeypatch.context() as m:
        m.setattr(sampling, "plain_greedy", lambda *_: False)  # the full build, always
        full = built()
    assert outcome(sample(x, fast)) == outcome(sample(x, full))
    with monkeypatch.context() as m:
        tensors: list[object] = []
        m.setattr(sampling, "to_device", lambda *a: tensors.append(a) or torch.tensor(a[0], dtype=a[1]))
        built()
    assert (tensors == []) == (not extra), "only a plain greedy batch is built without tensors"
    if extra:  # planted: a fast path that ignored the setting samples what the full build does not
        monkeypatch.setattr(sampling, "plain_greedy", lambda *_: True)
        assert outcome(sample(x, built())) != outcome(sample(x, full))
