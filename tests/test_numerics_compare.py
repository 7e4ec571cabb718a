"""The teacher-forced scorer (tests/numerics_compare.py) on hand-made scores: which
positions count for top-1 agreement (only past the reference's margin gap), the mean and
p99 of |Δ logprob|, and each bound going red with its own message."""

from __future__ import annotations

import pytest

from tests.numerics_compare import Bounds, Numerics, NumericsOutOfBounds, Scored, check, measure

GAP = 0.5


def scored(rows: list[tuple[float, float, int, int]]) -> Scored:
    """Rows of (chosen logprob, runner-up logprob, top id, runner-up id); token = top id."""
    return Scored([a for a, _, _, _ in rows], [[(a, i), (b, j)] for a, b, i, j in rows])


REF = scored([(-0.1, -3.0, 5, 6)] * 99 + [(-0.70, -0.72, 1, 2)])  # 99 clear winners, one near tie


def test_a_flipped_near_tie_does_not_count_a_flipped_winner_does() -> None:
    tie_flipped = scored([(-0.1, -3.0, 5, 6)] * 99 + [(-0.70, -0.69, 2, 1)])
    result = measure([REF], [tie_flipped], GAP)
    assert (result.positions, result.confident, result.agreement) == (100, 99, 1.0)
    winner_flipped = scored([(-0.1, -3.0, 6, 5)] + [(-0.1, -3.0, 5, 6)] * 98 + [(-0.70, -0.72, 1, 2)])
    assert measure([REF], [winner_flipped], GAP).agreement == pytest.approx(98 / 99)


def test_mean_and_p99_of_the_differences() -> None:
    got = scored([(-0.1, -3.0, 5, 6)] * 98 + [(-0.3, -3.0, 5, 6), (-1.7, -0.72, 1, 2)])
    result = measure([REF], [got], GAP)
    assert result.mean == pytest.approx((0.2 + 1.0) / 100)
    assert result.p99 == pytest.approx(0.2) and result.worst == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (Numerics(100, 0.2, 0.3, 0.4, 99, 1.0), r"mean \|Δ logprob\| 2.00e-01 >= 0.1"),
        (Numerics(100, 0.01, 0.6, 0.7, 99, 1.0), r"p99 \|Δ logprob\| 6.00e-01 >= 0.5"),
        (Numerics(100, 0.01, 0.1, 0.2, 99, 0.9), r"top-1 agreement 0.9000 < 0.95"),
        (Numerics(100, 0.01, 0.1, 0.2, 0, 0.0), r"top-1 agreement 0.0000 < 0.95"),  # nothing to agree on
    ],
)
def test_each_bound_goes_red_with_its_message(result: Numerics, message: str) -> None:
    bounds = Bounds(mean=0.1, p99=0.5, agreement=0.95, gap=GAP)
    check(Numerics(100, 0.01, 0.1, 0.2, 99, 0.99), bounds, "x")
    with pytest.raises(NumericsOutOfBounds, match=r"teacher-forced x out of bounds: .*" + message):
        check(result, bounds, "x")
