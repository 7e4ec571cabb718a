"""The C++ paged decode attention kernel (gpu/kernels/cpu/paged_attention.cpp), through
TorchAttention with cpu_kernels, against the torch path it replaces (TorchAttention with
cpu_kernels=False): random decode steps over shuffled pages (page sizes 1/4/16, GQA
ratios 1/3/4, head_dim 64/128, 1 to ~700 keys, batch 1..40), mixed steps of decodes and
extend chunks, and greedy generation of the tiny model with model.cpu_kernels auto vs off.

Measured max differences over this file's random decode steps (outputs up to ~4 in size):
float32 kernel vs torch path 6e-7; bfloat16 kernel vs torch path 1.6e-2 (one bf16 step of
an output in [2, 4)), bf16 kernel vs a float64 reference 7.8e-3 (half a step: the output
rounded once), bf16 torch path vs float64 8.2e-3.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu.attention import paged_decode
from gpu.attention.torch_backend import TorchAttention
from gpu.kernels import cpu
from tests import kernel_variants
from tests.paged_layout import Case, Layout, Shape, lay_out

if not cpu.load(paged_decode.KERNEL):
    pytest.skip("the C++ paged attention kernel cannot be built here", allow_module_level=True)

# (atol, rtol): float32 tight; bf16 one rounding step of the output (2^-7 relative at most).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (4e-3, 8e-3)}


def decode_case(rng: random.Random, batch: int, max_keys: int = 700) -> Case:
    """Decodes of very different lengths: short ones, page-boundary ones, long ones."""
    keys = [max(1, int(math.exp(rng.uniform(0, math.log(max_keys))))) for _ in range(batch)]
    return [(n - 1, 1) for n in keys]


def run_step(lay: Layout, case: Case, kernel: bool) -> tuple[torch.Tensor, TorchAttention]:
    attn = TorchAttention(lay.pool, lay.table, cpu_kernels=kernel)
    attn.prepare(lay.rows, [p for p, _ in case], [e for _, e in case])
    return attn.forward(0, lay.q, lay.k, lay.v), attn


def compare(case: Case, shape: Shape, seed: int) -> float:
    """Kernel vs the torch path on one step (the same pool: both write the same new K/V);
    asserts they agree and returns the max difference."""
    lay = lay_out(case, shape, seed)
    got, attn = run_step(lay, case, kernel=True)
    assert attn._paged is not None, "the step's decodes should have gone through the kernel"
    want, ref = run_step(lay, case, kernel=False)
    assert ref._paged is None
    atol, rtol = TOLERANCE[shape.dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    return (got.float() - want.float()).abs().max().item()


@pytest.fixture
def threads() -> Iterator[None]:
    """Four threads: few rows are then cut into key chunks merged by log-sum-exp."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


SHAPES = [
    Shape(ps, kv * ratio, kv, dim, dtype, kv_dtype)
    for dtype, kv_dtype in ((torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.float16))
    for ps, ratio, kv, dim in [
        (1, 1, 2, 64), (4, 3, 3, 64), (16, 4, 2, 64), (16, 3, 3, 128), (4, 4, 1, 128), (1, 3, 2, 128),
    ]
]
F16_POOL = (torch.float32, torch.float16)  # float32 compute over a float16 pool (cache.kv_dtype)


@pytest.mark.parametrize(
    "shape", SHAPES, ids=lambda s: f"ps{s.page_size}-h{s.heads}-kv{s.kv_heads}-d{s.dim}-{s.dtype}-{s.kv_dtype}"
)
@pytest.mark.parametrize("seed", [0, 1])
def test_decodes_match_torch_path(shape: Shape, seed: int, threads: None) -> None:
    rng = random.Random(seed * 100 + shape.page_size)
    compare(decode_case(rng, rng.randint(1, 40)), shape, seed)


@pytest.mark.parametrize("batch", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_long_rows_split_into_chunks(batch: int, dtype: torch.dtype, threads: None) -> None:
    """Rows of hundreds of keys at batch 1..5: cut into chunks, merged by log-sum-exp."""
    rng = random.Random(batch)
    case = [(rng.randint(300, 700), 1) for _ in range(batch)]
    compare(case, Shape(16, 9, 3, 64, dtype), seed=batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_thread(dtype: torch.dtype) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        compare([(699, 1), (0, 1), (15, 1), (16, 1)], Shape(16, 9, 3, 64, dtype), seed=4)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dim", [8, 40, 96])
def test_other_head_dims(dim: int) -> None:
    """head_dim not 64/128: the vector loop of any length (96), the scalar path (8, 40 are
    not multiples of AVX-512's 16 floats)."""
    compare(decode_case(random.Random(dim), 7, 200), Shape(4, 6, 2, dim), seed=dim)


MIXED: Case = [(37, 1), (3, 1), (0, 9), (120, 5), (64, 1), (200, 1), (0, 1), (5, 1), (8, 4), (333, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "case",
    [MIXED, [(0, 12), (40, 1)], [(17, 1), (9, 30)], [(5, 1), (6, 1), (0, 1)]],
    ids=["mixed", "prefill-then-decode", "decode-then-extend", "decodes-only"],
)
def test_mixed_steps_through_forward(case: Case, dtype: torch.dtype, threads: None) -> None:
    """Decodes and extend chunks in one step: the decodes' outputs land at their tokens."""
    compare(case, Shape(4, 6, 2, 64, dtype), seed=7)


def shift_pages(step: paged_decode.PagedDecode) -> paged_decode.PagedDecode:
    return step._replace(page_table=step.page_table.roll(1, dims=1))


def drop_last_key(step: paged_decode.PagedDecode) -> paged_decode.PagedDecode:
    return step._replace(seq_lens=step.seq_lens - 1)


@pytest.mark.parametrize("plant", [shift_pages, drop_last_key], ids=["page-table-shifted", "seq-lens-off-by-one"])
def test_comparison_catches_planted_metadata_bugs(plant: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted bug in the kernel's metadata builder: the comparison goes red."""
    build = paged_decode.build
    monkeypatch.setattr(paged_decode, "build", lambda *a: plant(build(*a)))
    with pytest.raises(AssertionError, match="not close"):
        compare(MIXED, Shape(4, 6, 2, 64), seed=7)


def test_kernel_refuses_pages_outside_the_pool() -> None:
    """A page id past the pool (or a row longer than its page table) is an error, not a
    read outside the pool."""
    lay = lay_out([(9, 1)], Shape(4, 2, 1, 64), seed=0)
    q, k, v = lay.q, lay.pool.k[0], lay.pool.v[0]
    op = torch.ops.tierserve_cpu.paged_attention_decode
    pages = torch.tensor([[1, 2, lay.pool.num_pages]])
    with pytest.raises(RuntimeError, match="outside the pool"):
        op(q, k, v, pages, torch.tensor([10]), 4, 0.125)
    with pytest.raises(RuntimeError, match="page table holds"):
        op(q, k, v, pages[:, :2], torch.tensor([10]), 4, 0.125)
    assert op(q, k, v, pages[:, :2], torch.tensor([8]), 4, 0.125).isfinite().all()  # pages 1, 2 only


def test_other_dtypes_take_the_torch_path() -> None:
    lay = lay_out([(9, 1), (0, 3)], Shape(4, 2, 1, 64, torch.float16), seed=0)
    assert not paged_decode.kernel_ready(True, lay.pool)
    assert not paged_decode.kernel_ready(False, lay_out([(9, 1)], Shape(4, 2, 1, 64), seed=0).pool)
    got, attn = run_step(lay, [(9, 1), (0, 3)], kernel=True)
    assert attn._paged is None and attn._decodes and got.isfinite().all()


def test_engine_greedy_outputs_equal_with_kernels_off(tiny_chat_folder: str, tiny_engine: Any) -> None:
    """The tiny model in float32: greedy tokens with model.cpu_kernels auto (the kernel in
    use) equal those with it off, over prompts whose decodes cross pages."""
    from kernel import Engine
    from tests.conftest import TINY_OVERRIDES

    assert tiny_engine.engine.parts.runner.attention._use_kernel
    prompts = ["Hello there", "x" * 40, "The weather today is", "a b c d e f g h i j k l m n o p"]
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "return_logprob": True}
    auto: list[Any] = tiny_engine.generate(prompts, params)
    off_engine = Engine(None, {"model.path": tiny_chat_folder, **TINY_OVERRIDES, "model.cpu_kernels": "off"})
    try:
        off_attention = off_engine.engine.parts.runner.attention
        assert isinstance(off_attention, TorchAttention) and not off_attention._use_kernel
        off: list[Any] = off_engine.generate(prompts, params)  # type: ignore[assignment]
    finally:
        off_engine.shutdown()
    assert [o["output_ids"] for o in auto] == [o["output_ids"] for o in off]
    for a, b in zip(auto, off):
        lp_a = [lp for lp, _ in a["meta_info"]["output_token_logprobs"]]
        lp_b = [lp for lp, _ in b["meta_info"]["output_token_logprobs"]]
        assert lp_a == pytest.approx(lp_b, abs=1e-4)


def test_build_key_covers_the_kernels_headers(tmp_path: Path) -> None:
    """The kernel's vector layer lives in paged_attention_vec.h: editing it must rebuild."""
    source, header = tmp_path / "kern.cpp", tmp_path / "kern_vec.h"
    source.write_text('#include "kern_vec.h"\n')
    header.write_text("// one\n")
    before = cpu._digest(source)
    header.write_text("// two\n")
    assert cpu._digest(source) != before


@kernel_variants.opt_in
@pytest.mark.parametrize("target", list(kernel_variants.TARGETS))
def test_vector_paths_of_other_cpus(target: str, tmp_path: Path) -> None:
    """This file's kernel tests again with the kernel built for other CPUs (an AVX2-only
    one, plain x86-64: the scalar path, an AVX-512 one without AMX): opt-in, tests/kernel_variants.py."""
    kernel_variants.run_for(target, __file__, tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_output_does_not_depend_on_its_batch_or_threads(dtype: torch.dtype) -> None:
    """Rows are cut into key chunks by their own length only: a row alone, in a batch of
    40, on 1 or 4 threads gives the same bits (the cut once depended on the batch, and the
    same request then streamed other logprobs than with n=2)."""
    gen = torch.Generator().manual_seed(7)
    page_size, pages, kv, heads, dim = 16, 400, 3, 9, 64
    k_cache = torch.randn(pages * page_size, kv, dim, generator=gen).to(dtype)
    v_cache = torch.randn(pages * page_size, kv, dim, generator=gen).to(dtype)
    lens = torch.tensor([700, 1, 129, 128, 300, *range(5, 400, 11)], dtype=torch.int64)
    table = torch.stack([torch.randperm(pages, generator=gen)[:44] for _ in lens])
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    op = torch.ops.tierserve_cpu.paged_attention_decode

    def run(rows: slice, num_threads: int) -> torch.Tensor:
        before = torch.get_num_threads()
        torch.set_num_threads(num_threads)
        try:
            return op(q[rows], k_cache, v_cache, table[rows], lens[rows], page_size, dim**-0.5)
        finally:
            torch.set_num_threads(before)

    batch = run(slice(None), 4)
    assert torch.equal(batch, run(slice(None), 1))
    for i in range(len(lens)):
        assert torch.equal(run(slice(i, i + 1), 4)[0], batch[i]), f"row {i} ({int(lens[i])} keys)"


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode_slots_match_the_torch_metadata(page_size: int) -> None:
    """`paged_decode_slots` (one native call) gives a decode-only step's KV slots, page table
    and key counts exactly as the torch ops of `paged_decode.build` and `_cache_locs` do,
    including torch's floor division of the table's negative entries."""
    if not cpu.load(paged_decode.KERNEL):
        pytest.skip("the C++ kernels are off or do not build here")
    rng = random.Random(page_size)
    table = torch.tensor([[rng.randint(-300, 3000) for _ in range(96)] for _ in range(9)], dtype=torch.int64)
    for batch in (1, 3, 8):
        rows = [rng.randrange(1, 9) for _ in range(batch)]
        prefix = [rng.randrange(0, 96) for _ in range(batch)]
        rows_t, prefix_t = torch.tensor(rows), torch.tensor(prefix)
        out_loc, got = paged_decode.decode_slots(table, rows_t, prefix_t, page_size)
        want = paged_decode.build(table, page_size, list(range(batch)), list(range(batch)), rows_t, prefix_t, prefix)
        assert got.tok is None and want.tok is None
        assert torch.equal(out_loc, table[rows_t, prefix_t])
        assert torch.equal(got.page_table, want.page_table) and torch.equal(got.seq_lens, want.seq_lens)
    # the table's negatives reach the page tables above (C's truncating division would differ)
    firsts = table[:, ::page_size]
    assert page_size == 1 or not torch.equal(firsts // page_size, torch.div(firsts, page_size, rounding_mode="trunc"))


def test_decode_slots_reject_rows_and_positions_outside_the_table() -> None:
    if not cpu.load(paged_decode.KERNEL):
        pytest.skip("the C++ kernels are off or do not build here")
    table = torch.arange(4 * 32, dtype=torch.int64).view(4, 32)
    before = table.clone()
    for rows, pos in (([4], [0]), ([-1], [0]), ([1], [32]), ([1], [-1])):
        with pytest.raises(RuntimeError, match="paged_decode_slots"):
            paged_decode.decode_slots(table, torch.tensor(rows), torch.tensor(pos), 4)
    assert torch.equal(table, before)
