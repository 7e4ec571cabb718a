"""Deterministic mode on the C++ CPU kernels (invariant 7): every kernel it picks gives a
row the same bits alone or among 1-64 others, chunked or whole, as a decode step or
inside a prefill; each guard is shown red on a planted batch-dependent computation.

Engine-level guards on the packaged model's default numerics (bf16 + int4, where every
linear, the glue, attention and the decode step run C++): tests/test_deterministic_engine.py.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from gpu.attention import deterministic_paged, paged_decode
from gpu.attention.deterministic_paged import PagedDeterministicAttention
from gpu.attention.paged_decode import PagedDecode
from gpu.kernels import cpu
from gpu.models import llama_glue as glue
from gpu.quant.dispatch import QuantizedWeight, make_linear
from gpu.quant.linears import Int4Linear, Int8Linear
from tests.paged_layout import Case, Shape, lay_out

if not all(cpu.load(name) for name in ("paged_attention", "quant_gemv", "llama_glue")):
    pytest.skip("the C++ CPU kernels are off or do not build here", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16]


def rows_invariant(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    """op's row i is the same bits alone, and inside batches of 2-65 rows that start at
    several places before it (so it sits at every place of a small batch)."""
    full = op(x)
    for i in range(0, x.shape[0], 7):
        if not torch.equal(op(x[i : i + 1])[0], full[i]):
            return False
        for start, size in ((max(0, i - 3), 5), (max(0, i - 30), 64), (i, 2)):
            part = op(x[start : start + size])
            if not torch.equal(part[i - start], full[i]):
                return False
    return True


def mixes_rows(op: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Planted: the same math with a batch-wide term (the batch's mean row taken out of x and
    its product added back), so a row's bits depend on the rows beside it."""
    def planted(x: torch.Tensor) -> torch.Tensor:
        mean = x.float().mean(0, keepdim=True).to(x.dtype)
        return op(x - mean) + op(mean)

    return planted


# ---- quantized linears --------------------------------------------------------------
def quant_weights(dtype: torch.dtype) -> dict[str, QuantizedWeight]:
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    layers = {"int4": Int4Linear.quantize(w, dtype, kernels=True), "int8": Int8Linear.quantize(w, dtype, kernels=True)}
    for layer in layers.values():
        assert layer.row_invariant, "the C++ kernel should run this layer"
    return {name: QuantizedWeight(layer, None) for name, layer in layers.items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quantized_linears_rows_are_their_own(dtype: torch.dtype, kind: str) -> None:
    """Deterministic mode's linear on a C++ layer runs it as it is (no tiles) and each row is
    its own; the planted row-mixing kernel is red."""
    weight = quant_weights(dtype)[kind]
    linear = make_linear(F.linear, deterministic=True)
    x = torch.randn(70, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert rows_invariant(lambda rows: linear(rows, weight), x)
    assert not rows_invariant(mixes_rows(lambda rows: linear(rows, weight)), x)


# ---- the Llama glue --------------------------------------------------------------------
GLUE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "rms_norm": lambda x: glue.rms_norm(x[:, :64], torch.linspace(0.5, 1.5, 64).to(x.dtype), 1e-5),
    "add_rms_norm": lambda x: torch.cat(glue.add_rms_norm(
        x[:, :64].contiguous(), x[:, 64:].contiguous(), torch.linspace(0.5, 1.5, 64).to(x.dtype), 1e-5), dim=1),
    "rope": lambda x: torch.cat([t.flatten(1) for t in glue.rope(
        x[:, :96].contiguous(), *_cos_sin(x.shape[0], x.dtype), 4, 1)], dim=1),
    "silu_mul": lambda x: glue.silu_mul(x),
}


def _cos_sin(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(rows)[:, None].float() * torch.linspace(0.01, 1.0, 8)[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", list(GLUE))
def test_glue_rows_are_their_own(dtype: torch.dtype, op: str) -> None:
    x = (torch.randn(70, 128, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    if op == "rope":  # each row rotates by its own position: one cos/sin table for all slices
        cos, sin = _cos_sin(70, dtype)
        for i in range(0, 70, 9):
            alone = glue.rope(x[i : i + 1, :96].contiguous(), cos[i : i + 1], sin[i : i + 1], 4, 1)
            whole = glue.rope(x[:, :96].contiguous(), cos, sin, 4, 1)
            assert all(torch.equal(a[0], w[i]) for a, w in zip(alone, whole))
        return
    assert rows_invariant(GLUE[op], x)
    assert not rows_invariant(mixes_rows(GLUE[op]), x)


# ---- attention: every token through the paged kernel -------------------------------------
SHAPE = Shape(page_size=4, heads=6, kv_heads=2, dim=32)


def attend(case: Case, shape: Shape, seed: int, requests: Sequence[int] | None = None) -> list[torch.Tensor]:
    """One step of `case` (or of its `requests` only) on a fresh layout -> each request's
    token outputs."""
    lay = lay_out(case, shape, seed)
    starts = [sum(e for _, e in case[:i]) for i in range(len(case))]
    picked = list(range(len(case))) if requests is None else list(requests)
    tok = torch.cat([torch.arange(starts[i], starts[i] + case[i][1]) for i in picked])
    attn = PagedDeterministicAttention(lay.pool, lay.table, cpu_kernels=True)
    attn.prepare([lay.rows[i] for i in picked], [case[i][0] for i in picked], [case[i][1] for i in picked])
    out = attn.forward(0, lay.q[tok], lay.k[tok], lay.v[tok])
    return list(out.split([case[i][1] for i in picked]))


def attend_in_chunks(case: Case, shape: Shape, seed: int, request: int, cuts: Sequence[int]) -> torch.Tensor:
    """Request `request`'s new tokens as successive steps of the given sizes (size 1: a decode step)."""
    lay = lay_out(case, shape, seed)
    prefix, extend = case[request]
    start = sum(e for _, e in case[:request])
    attn = PagedDeterministicAttention(lay.pool, lay.table, cpu_kernels=True)
    outs, done = [], 0
    for size in cuts:
        tok = torch.arange(start + done, start + done + size)
        attn.prepare([lay.rows[request]], [prefix + done], [size])
        outs.append(attn.forward(0, lay.q[tok], lay.k[tok], lay.v[tok]))
        done += size
    assert done == extend
    return torch.cat(outs)


def mixed_case(rng: random.Random, requests: int) -> list[tuple[int, int]]:
    """Prefill chunks, decodes and long rows (past the kernel's 128-key chunks) together."""
    case = [(rng.choice([0, 3, 8, 130]), rng.choice([1, 1, 5, 20, 37])) for _ in range(requests)]
    case[0] = (61, 140)  # the request every guard follows: a prefix hit mid-page, 201 keys
    return case


def cuts_of(rng: random.Random, n: int) -> list[int]:
    cuts: list[int] = []
    while sum(cuts) < n:
        cuts.append(min(rng.choice([1, 1, 4, 9, 32]), n - sum(cuts)))
    return cuts


# Head dims on each of the chained form's paths (whole vectors, a tail, under one vector),
# GQA groups 1-4, and a float16 pool under float32.
SHAPES = [SHAPE._replace(dtype=dtype) for dtype in DTYPES] + [
    Shape(page_size=16, heads=4, kv_heads=2, dim=16),
    Shape(page_size=4, heads=4, kv_heads=4, dim=24, dtype=torch.bfloat16),
    Shape(page_size=8, heads=8, kv_heads=2, dim=80, kv_dtype=torch.float16),
    Shape(page_size=4, heads=3, kv_heads=1, dim=8),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s.heads}-kv{s.kv_heads}-d{s.dim}-{s.dtype}-{s.kv_dtype}")
def test_a_tokens_attention_is_the_same_in_every_step(shape: Shape) -> None:
    """Request 0's tokens: among 1-64 other requests, alone, in chunks, one decode step at a
    time: the same bits; and close to SDPA's values."""
    rng, dtype, group = random.Random(4), shape.dtype, shape.heads // shape.kv_heads
    case = mixed_case(rng, 65)
    whole = attend(case, shape, seed=9)[0]
    assert torch.equal(attend(case, shape, 9, requests=[0])[0], whole)
    for others in (1, 7, 64):  # request 0 at another place of the step each time
        picked = rng.sample(range(1, 65), others)
        picked.insert(rng.randrange(others + 1), 0)
        assert torch.equal(attend(case, shape, 9, requests=picked)[picked.index(0)], whole)
    assert torch.equal(attend_in_chunks(case, shape, 9, 0, cuts_of(rng, 140)), whole)
    assert torch.equal(attend_in_chunks(case, shape, 9, 0, [1] * 140), whole)
    lay = lay_out(case, shape, 9)  # the reference: SDPA over the request's keys, the new ones written
    row, (prefix, extend) = lay.rows[0], case[0]
    lay.pool.write(0, lay.table[row, prefix : prefix + extend], lay.k[:extend], lay.v[:extend])
    slots = lay.table[row, : prefix + extend]
    keys, values = lay.pool.k[0][slots].float(), lay.pool.v[0][slots].float()
    mask = torch.arange(prefix + extend)[None, :] <= torch.arange(prefix, prefix + extend)[:, None]
    ref = F.scaled_dot_product_attention(
        lay.q[:extend].float().transpose(0, 1), keys.transpose(0, 1).repeat_interleave(group, 0),
        values.transpose(0, 1).repeat_interleave(group, 0), attn_mask=mask).transpose(0, 1)
    torch.testing.assert_close(whole.float(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


def test_red_prefill_through_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: a step's prefill chunks attend through SDPA (default mode's arithmetic), its
    decodes through the kernel. The chunked-vs-whole guard goes red."""
    real = deterministic_paged.PagedDeterministicAttention.forward

    def sdpa_for_chunks(self: PagedDeterministicAttention, layer: int, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor) -> torch.Tensor:
        out = real(self, layer, q, k, v)  # writes the step's K/V
        if q.shape[0] == 1 or int(self._seq_lens[0]) != 1:
            return out  # decode steps (and chunks after a prefix) keep the kernel
        keys, values = self.pool.k[layer][self.out_cache_loc], self.pool.v[layer][self.out_cache_loc]
        group = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1).repeat_interleave(group, 0),
            values.transpose(0, 1).repeat_interleave(group, 0), is_causal=True).transpose(0, 1)

    monkeypatch.setattr(deterministic_paged.PagedDeterministicAttention, "forward", sdpa_for_chunks)
    case = [(0, 40)]
    whole = attend(case, SHAPE, 5)[0]
    assert not torch.equal(attend_in_chunks(case, SHAPE, 5, 0, [1] * 40), whole)


def test_red_decodes_in_the_decode_kernels_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: one-row steps (decodes) attend in the paged decode kernel's arithmetic, tiles
    in the chained form. The decode-steps-vs-whole guard goes red."""
    real = paged_decode.attend

    def split_forms(step: PagedDecode, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_size: int, chained: bool = False) -> torch.Tensor:
        return real(step, q, k_cache, v_cache, page_size, chained=chained and q.shape[0] > 1)

    case = [(0, 40)]
    whole = attend(case, SHAPE, 5)[0]
    assert torch.equal(attend_in_chunks(case, SHAPE, 5, 0, [1] * 40), whole)
    monkeypatch.setattr(paged_decode, "attend", split_forms)
    assert not torch.equal(attend_in_chunks(case, SHAPE, 5, 0, [1] * 40), whole)


def test_static_metadata_pads_to_the_reserved_page() -> None:
    """graphs emulation: the bucket's padding tokens write slot 0 and read one key of page 0;
    the live rows equal the eager metadata."""
    case = [(5, 3), (0, 1)]
    lay = lay_out(case, SHAPE, 2)
    attn = PagedDeterministicAttention(lay.pool, lay.table, cpu_kernels=True)
    specs = attn.static_specs()
    assert {name: spec.sentinel for name, spec in specs.items()} == {
        "out_cache_loc": 0, "page_table": 0, "seq_lens": 1}
    meta = attn.static_metadata(lay.rows, [5, 0], [3, 1])
    attn.prepare(lay.rows, [5, 0], [3, 1])
    assert torch.equal(meta["out_cache_loc"], attn.out_cache_loc)
    assert torch.equal(meta["seq_lens"], torch.tensor([6, 7, 8, 1]))
    assert meta["page_table"].shape == (4, attn.max_pages)
    eager: Any = attn._page_table
    assert torch.equal(meta["page_table"][:, : eager.shape[1]], eager)
