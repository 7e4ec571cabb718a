"""The torch attention backend against a dense per-request reference: mixed steps of
decodes (several length groups), prefix-extends and fresh prefills, over shuffled pages
whose table rows have stale tails. The backend's metadata is built for the whole step at
once (no per-request tensors), so this pins what each request reads and writes. With the
C++ kernels (`KERNELS`): decodes through the paged decode kernel, prefill chunks through
the chained one (gpu/attention/paged_decode.py)."""

from __future__ import annotations

import math

import pytest
import torch

from gpu.attention import paged_decode
from gpu.attention.torch_backend import TorchAttention
from gpu.kernels import cpu
from tests.paged_layout import Case, Shape, lay_out

PAGE, HEADS, KV_HEADS, DIM = 4, 6, 2, 8

MIXED: Case = [(37, 1), (3, 1), (0, 9), (12, 5), (64, 1), (20, 1), (0, 1), (5, 1), (8, 4)]


KERNELS = pytest.param(True, marks=pytest.mark.skipif(not cpu.load(paged_decode.KERNEL),
                                                     reason="the C++ paged attention kernel does not build here"))


def setup(
    case: Case, seed: int, kernels: bool = False
) -> tuple[TorchAttention, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    lay = lay_out(case, Shape(PAGE, HEADS, KV_HEADS, DIM), seed)
    return TorchAttention(lay.pool, lay.table, cpu_kernels=kernels), lay.q, lay.k, lay.v, lay.rows


def reference(attn: TorchAttention, case: Case, rows: list[int], q: torch.Tensor) -> torch.Tensor:
    """Dense causal attention per request over the pool (after the backend wrote the new K/V)."""
    out, tok, group = torch.empty_like(q), 0, HEADS // KV_HEADS
    for row, (prefix, extend) in zip(rows, case):
        slots = attn.req_to_token[row, : prefix + extend]
        keys = attn.pool.k[0][slots].double().repeat_interleave(group, 1)  # [L, H, D]
        vals = attn.pool.v[0][slots].double().repeat_interleave(group, 1)
        for t in range(extend):
            scores = torch.einsum("hd,lhd->hl", q[tok + t].double(), keys[: prefix + t + 1]) / math.sqrt(DIM)
            out[tok + t] = torch.einsum("hl,lhd->hd", scores.softmax(-1), vals[: prefix + t + 1]).float()
        tok += extend
    return out


def run(case: Case, seed: int, kernels: bool = False) -> tuple[torch.Tensor, torch.Tensor, TorchAttention, list[int]]:
    attn, q, k, v, rows = setup(case, seed, kernels)
    attn.prepare(rows, [p for p, _ in case], [e for _, e in case])
    got = attn.forward(0, q, k, v)
    return got, reference(attn, case, rows, q), attn, rows


@pytest.mark.parametrize(
    "case",
    [
        MIXED,
        [(5, 1)],
        [(30, 1), (28, 1), (25, 1)],
        [(0, 7)],
        [(9, 3)],
        [(p, 1) for p in (1, 2, 3, 40, 41, 90, 7)],
    ],
    ids=["mixed", "one-decode", "one-group-in-order", "fresh-prefill", "extend", "decodes-only"],
)
@pytest.mark.parametrize("kernels", [False, KERNELS])
def test_matches_dense_reference(case: Case, kernels: bool) -> None:
    got, want, attn, _ = run(case, seed=3, kernels=kernels)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if kernels:
        chunks = any(e > 1 for _, e in case)
        assert (attn._chained is not None) == (chunks and paged_decode.chained_extends(attn.pool))
        return
    if sum(e == 1 for _, e in case) > 3:
        assert len(attn._decodes) > 1, "the case should cut decodes into several length groups"
    if len(case) <= 3 and all(e == 1 for _, e in case):  # the no-gather path of one in-order group
        assert len(attn._decodes) == 1 and attn._decodes[0].tok is None


def test_new_tokens_written_at_their_slots() -> None:
    attn, q, k, v, rows = setup(MIXED, seed=5)
    attn.prepare(rows, [p for p, _ in MIXED], [e for _, e in MIXED])
    attn.forward(0, q, k, v)
    expected = torch.cat([attn.req_to_token[r, p : p + e] for r, (p, e) in zip(rows, MIXED)])
    assert torch.equal(attn.out_cache_loc, expected)
    assert torch.equal(attn.pool.k[0][expected], k) and torch.equal(attn.pool.v[0][expected], v)


def test_reference_catches_a_shifted_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: every new token written one slot off. The reference comparison goes red."""
    original = TorchAttention._cache_locs

    def shifted(self: TorchAttention, *args: torch.Tensor | int) -> torch.Tensor:
        return original(self, *args) + 1  # type: ignore[arg-type]

    monkeypatch.setattr(TorchAttention, "_cache_locs", shifted)
    got, want, _, _ = run(MIXED, seed=3)
    assert not torch.allclose(got, want, atol=1e-3)


@pytest.mark.skipif(not cpu.load(paged_decode.KERNEL), reason="the C++ paged attention kernel does not build here")
def test_reference_catches_chunk_tokens_one_key_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug: the chained kernel's chunk tokens each miss their own key (key counts
    one short). The reference comparison goes red."""
    monkeypatch.setattr(paged_decode, "chained_extends", lambda pool: True)
    build = paged_decode.build_extends

    def short(*args: object, **kwargs: object) -> paged_decode.PagedDecode:
        step = build(*args, **kwargs)  # type: ignore[arg-type]
        return step._replace(seq_lens=step.seq_lens - 1)

    monkeypatch.setattr(paged_decode, "build_extends", short)
    got, want, attn, _ = run(MIXED, seed=3, kernels=True)
    assert attn._chained is not None
    assert not torch.allclose(got, want, atol=1e-3)


def test_gather_buffers_reused_across_steps() -> None:
    """A smaller step after a bigger one reads its own pages from the reused buffers."""
    attn, q, k, v, rows = setup(MIXED, seed=8)
    attn.prepare(rows, [p for p, _ in MIXED], [e for _, e in MIXED])
    attn.forward(0, q, k, v)
    grown = attn._gather_k.shape[0]
    picked = [i for i, (_, e) in enumerate(MIXED) if e == 1][1:3]  # two decodes, redone
    small = [MIXED[i] for i in picked]
    tokens = [sum(e for _, e in MIXED[:i]) for i in picked]
    sub_rows, qs = [rows[i] for i in picked], q[tokens] * 2
    attn.prepare(sub_rows, [p for p, _ in small], [1, 1])
    got = attn.forward(0, qs, k[tokens], v[tokens])
    torch.testing.assert_close(got, reference(attn, small, sub_rows, qs), atol=1e-5, rtol=1e-5)
    assert attn._gather_k.shape[0] == grown  # reused, not reallocated
