"""The `triton` attention backend in static shapes (captured graphs), in the Triton
interpreter on CPU.

A bucket's metadata buffers hold one decode and one extend entry per request slot; the
entries past the live ones keep the registry's sentinel (row 0, count 0), which no kernel
program reads or writes for. What that promises, checked here: a request's output in a
padded step is the eager step's, bit for bit, after a larger step left its rows in the
buffers; padding tokens' output rows are zero and their K/V land in the reserved page
only; and the decode kernel alone (the output as it leaves it, before the extend kernel)
writes the eager step's rows only. Planted: an unused entry that counts one key (sentinel
1) writes into a live token's row and the check goes red. End to end: a tiny Llama with
`model.attention: triton` under `graphs.mode: emulate` agrees with the eager engine
teacher-forced.

Why the check after the decode kernel: an unused entry writes token 0's row (its token
sentinel). Where token 0 is a live decode, its own program writes that row in the same
launch, and which write lands last is up to the scheduler: the interpreter runs programs
in order (the unused entry, later in the grid, wins), a GPU runs them at once (on an H200
the final output came out the eager one; likely the live program, first in the grid and
with more splits to merge, writes last).
Where token 0 belongs to an extend request, the extend kernel overwrites it afterwards.
Only the output between the two launches shows a stray decode write on every device,
and a step whose token 0 is an extend token leaves that row to unused entries alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from gpu.attention.triton_backend import TritonAttention, split_size
from gpu.graphs.runner import GraphRunner
from gpu.graphs.static_buffers import BufferSpec, StaticBufferError, StaticBuffers
from kernel import Engine
from kernel.components import build_components
from kernel.config import load_config
from tests.conftest import GRAPHS_EMULATE, TINY_OVERRIDES, graph_replays
from tests.numerics_compare import TOP, Bounds, Report, check_report, evaluate, reference
from tests.test_triton_attention import DEVICE, Req, build, step_qkv

BUCKET = {"tokens": 48, "requests": 6}
# (prefix, extend, padding): a large mixed step, then a small one staged after it.
LARGE: list[Req] = [(30, 1, False), (5, 9, False), (61, 1, False), (0, 17, False), (12, 1, False), (40, 6, False)]
SMALL: list[Req] = [(22, 1, False), (3, 5, False)]
# Token 0 an extend token: after the decode kernel its row is the unused decode entries' alone.
EXTEND_FIRST: list[Req] = [(3, 5, False), (22, 1, False)]


def registry(backend: TritonAttention) -> StaticBuffers:
    buffers = StaticBuffers(BUCKET, DEVICE)
    for name, spec in backend.static_specs().items():
        buffers.register(name, spec)
    return buffers


def padded(t: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    """t with random (finite) rows appended up to `rows`: padding tokens' q/k/v."""
    extra = torch.randn((rows - t.shape[0], *t.shape[1:]), generator=torch.Generator().manual_seed(seed))
    return torch.cat([t, extra.to(t.device, t.dtype)])


def after_decode(backend: TritonAttention) -> list[torch.Tensor]:
    """Record the output as the decode kernel leaves it (before the extend kernel), per
    forward of `backend`: its kernels module wrapped, here in the test."""
    real, seen = backend.kernels, []

    def decode_attention(out: torch.Tensor, *args: Any) -> None:
        real.decode_attention(out, *args)
        seen.append(out.clone())

    backend.kernels = SimpleNamespace(  # type: ignore[assignment]
        store_kv=real.store_kv, decode_attention=decode_attention, extend_attention=real.extend_attention
    )
    return seen


def eager_and_static(reqs: Sequence[Req], group: int = 2, head_dim: int = 16, split: int = 16) -> dict[str, Any]:
    """One layer of `reqs` eagerly and in the bucket (after LARGE was staged in the same
    buffers); the outputs (final, and after the decode kernel) and the pools after each."""
    reqs = list(reqs)
    pools, table, rows = build(4, head_dim, LARGE + reqs, list(range(len(LARGE + reqs))), 0, torch.float32)
    eager, static = TritonAttention(pools[0], table), TritonAttention(pools[1], table)
    for b in (eager, static):
        b.decode_split, b.decode_block_n = split, 16
    decoded = {"eager": after_decode(eager), "static": after_decode(static)}
    buffers = registry(static)
    big = len(LARGE)
    stale = static.static_metadata(rows[:big], [r[0] for r in LARGE], [r[1] for r in LARGE])
    buffers.stage(stale, BUCKET)  # rows a larger step leaves behind

    q, k, v = step_qkv(reqs, range(big, big + len(reqs)), group, head_dim, 0, 0, torch.float32)
    live_rows, prefix, extend = rows[big:], [r[0] for r in reqs], [r[1] for r in reqs]
    eager.prepare(live_rows, prefix, extend)
    out_eager = eager.forward(0, q, k, v)
    views = buffers.stage(static.static_metadata(live_rows, prefix, extend), BUCKET)
    static.bind_static(views)
    tokens = BUCKET["tokens"]
    out_static = static.forward(0, padded(q, tokens, 1), padded(k, tokens, 2), padded(v, tokens, 3))
    (eager_decoded,), (static_decoded,) = decoded["eager"], decoded["static"]
    return {
        "eager": out_eager, "static": out_static, "pools": pools, "live": q.shape[0], "backend": static,
        "eager_decoded": eager_decoded, "static_decoded": static_decoded,
    }


def eager_bits_broken(got: dict[str, Any]) -> list[str]:
    """What of the static step's promise `got` breaks (empty: none)."""
    n, broken = got["live"], []
    for what in ("", "_decoded"):  # the final output, and the output after the decode kernel
        static, eager = got["static" + what], got["eager" + what]
        if not torch.equal(static[:n], eager):
            broken.append(f"live rows{what} differ from the eager step's")
        if not torch.equal(static[n:], torch.zeros_like(static[n:])):
            broken.append(f"padding rows{what} are not zero")
    eager_pool, static_pool = got["pools"]
    # The same K/V everywhere but the reserved page 0 (slots 0-3), where padding tokens write.
    for name in ("k", "v"):
        if not torch.equal(getattr(static_pool, name)[0][4:], getattr(eager_pool, name)[0][4:]):
            broken.append(f"{name.upper()} outside the reserved page differs")
    return broken


STEPS = {"small": SMALL, "extend_first": EXTEND_FIRST, "five": LARGE[:5], "one": [(0, 1, False)],
         "long": [(7, 40, False)]}


@pytest.mark.parametrize("reqs", list(STEPS.values()), ids=list(STEPS))
def test_static_step_gives_the_eager_bits(reqs: list[Req]) -> None:
    assert eager_bits_broken(eager_and_static(reqs)) == []


def test_static_grids_cover_the_table_and_the_bucket() -> None:
    got = eager_and_static(SMALL)
    backend = got["backend"]
    assert backend._dec_max == backend.req_to_token.shape[1] and backend._ext_max == BUCKET["tokens"]
    assert all(backend.meta[name].shape[0] == BUCKET["requests"] for name in ("dec_lens", "ext_lens"))


def test_split_size_is_fixed_by_the_table() -> None:
    assert split_size(512) == split_size(16384) == 256  # the usual contexts: 256-key splits
    assert split_size(128 * 1024) == 2048 and split_size(100_000) % 32 == 0
    assert -(-100_000 // split_size(100_000)) <= 64


# Each planted field with a step where its stray writes land in a row no live program of
# the same launch writes (module docstring): unused decode entries write token 0's row in
# the decode launch, so token 0 is an extend token; unused extend entries (2 tokens) write
# rows 0 and 1 in the extend launch, so token 0 is a decode token (written the launch before).
@pytest.mark.parametrize(
    ("field", "reqs"), [("dec_lens", EXTEND_FIRST), ("ext_lens", SMALL)], ids=["dec_lens", "ext_lens"]
)
def test_red_unused_entries_that_count_keys(
    monkeypatch: pytest.MonkeyPatch, field: str, reqs: list[Req]
) -> None:
    """Planted: the unused entries' count sentinel is 1 (decode) / 2 (extend), not 0. They
    attend and write their output into token 0's row (their token sentinel), and the eager
    bits are gone, on every device."""
    real = TritonAttention.static_specs

    def counting(self: TritonAttention) -> dict[str, BufferSpec]:
        specs = real(self)
        specs[field] = specs[field]._replace(sentinel=1 if field == "dec_lens" else 2)
        return specs

    monkeypatch.setattr(TritonAttention, "static_specs", counting)
    broken = eager_bits_broken(eager_and_static(reqs))
    assert any(b.startswith("live rows") for b in broken), broken


def components(folder: str, **extra: Any) -> Any:
    config = load_config(None, {**TINY_OVERRIDES, "model.path": folder, "model.attention": "triton", **extra})
    return build_components(config, DEVICE)


def test_capture_checks_triton_metadata(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Capture passes with the backend's buffers all registered, and fails loudly when the
    backend reads a metadata tensor that is not a registered view (planted)."""
    parts = components(tiny_chat_folder, **GRAPHS_EMULATE)
    assert isinstance(parts.runner.graphs, GraphRunner)
    real = TritonAttention.bind_static

    def private_copy(self: TritonAttention, views: Any) -> None:
        real(self, views)
        self.meta["dec_lens"] = self.meta["dec_lens"].clone()

    monkeypatch.setattr(TritonAttention, "bind_static", private_copy)
    with pytest.raises(StaticBufferError, match="meta.dec_lens"):
        components(tiny_chat_folder, **GRAPHS_EMULATE)


def test_small_replay_after_large_leaves_no_stale_triton_row(tiny_chat_folder: str) -> None:
    """The triton backend's buffers through the graph runner: after a large mixed step and
    a small one in the same bucket, rows [live:bucket) of every buffer hold the sentinel."""
    from tests.test_graph_runner import batch, stale_rows

    parts = components(tiny_chat_folder, **GRAPHS_EMULATE)
    graphs = parts.runner.graphs
    assert isinstance(graphs, GraphRunner)
    table = parts.runner.attention.req_to_token
    for row in range(1, 6):  # distinct KV slots per request
        table[row, :64] = torch.arange(row * 128, row * 128 + 64)
    try:
        large, small = batch([20, 1, 9, 1], prefix=3), batch([1, 17])
        assert graphs.bucket_for(large) is graphs.bucket_for(small)
        with torch.inference_mode():
            parts.runner.run(large).finish()
            touched = {k: v for k, v in stale_rows(graphs, small).items() if v and k.startswith("attention.")}
            assert len(touched) >= 5, touched
            parts.runner.run(small).finish()
        assert not any(stale_rows(graphs, small).values()), stale_rows(graphs, small)
    finally:
        table[1:6] = 0


GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "return_logprob": True,
          "top_logprobs_num": TOP}
# fp32 on both sides, only padded row counts around attention differ: measured max |Δ logprob|
# 9.5e-7 (forward and reverse, means <= 1.2e-7) on an AMD EPYC AVX2 (interpreter), the same on
# an Intel Xeon AVX-512/BF16/AMX.
TIGHT = Bounds(mean=1e-5, p99=1e-4, agreement=1.0, gap=1e-3)


def teacher_forced(engine: Engine, reference_engine: Engine, batches: Sequence[list[list[int]]]) -> list[Report]:
    """Each batch of prompts, in turn, generated by `engine` and compared teacher-forced
    with `reference_engine` (tests/numerics_compare.py); the later batches may hit the
    prefix cache of the earlier ones."""
    reports = []
    for prompts in batches:
        report = evaluate(engine, reference(reference_engine, prompts, GREEDY), TIGHT.gap)
        check_report(report, TIGHT)
        reports.append(report)
    return reports


@pytest.mark.skipif(
    os.environ.get("TIERSERVE_SKIP_TRITON_E2E") == "1",
    reason="TIERSERVE_SKIP_TRITON_E2E=1: the engine run in the Triton interpreter is skipped",
)
def test_engine_emulated_matches_eager(tiny_chat_folder: str) -> None:
    """Concurrent prompts (chunked prefill mixed with decodes), then prefix hits, with the
    triton backend: graphs emulated against the eager engine, teacher-forced (the emulated
    run's own decode tokens scored eagerly, and the eager run's sequences scored under
    emulation), within TIGHT; and both kinds of bucket ran."""
    from tests.test_bit_exact import tokens

    prompts = [tokens(70 + i, 5 + 13 * i) for i in range(3)]
    engines = [Engine(None, {**TINY_OVERRIDES, "model.path": tiny_chat_folder, "model.attention": "triton",
                             "cache.prefix": "radix", **extra}) for extra in ({}, GRAPHS_EMULATE)]
    eager, emulated = engines
    try:
        _, second = teacher_forced(emulated, eager, [prompts, [p + [5, 6, 7] for p in prompts]])
        assert any(o["meta_info"]["cached_tokens"] for o in second.outputs)
        assert all(graph_replays(emulated).values()), graph_replays(emulated)
    finally:
        for engine in engines:
            engine.shutdown()


@pytest.mark.skipif(not CUDA, reason="needs CUDA: captured graphs")
def test_cuda_graphs_match_emulation(tiny_chat_folder: str) -> None:
    """On a GPU: the triton backend captured and replayed against the emulated run, teacher-forced.

    At most `prefill_max_requests` prompts per batch: the scoring pass caches every prompt,
    so each batch's plain greedy run prefills all its prompts (their uncached tails) in one
    step, and a step with more requests than a prefill bucket's slots runs eagerly (five
    prompts gave no prefill replay at all, emulated or captured)."""
    from tests.test_bit_exact import tokens

    prompts = [tokens(80 + i, 4 + 15 * i) for i in range(GRAPHS_EMULATE["graphs.prefill_max_requests"])]
    engines = [Engine(None, {**TINY_OVERRIDES, "model.path": tiny_chat_folder, "model.attention": "triton",
                             "model.device": "cuda", "cache.prefix": "radix", **GRAPHS_EMULATE, "graphs.mode": mode})
               for mode in ("emulate", "cuda")]
    emulated, cuda = engines
    try:
        teacher_forced(cuda, emulated, [prompts, [p + [5, 6, 7] for p in prompts]])
        assert all(graph_replays(cuda).values()), graph_replays(cuda)
    finally:
        for engine in engines:
            engine.shutdown()
