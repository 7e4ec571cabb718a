"""The graph runner and its static-buffer registry (gpu/graphs/), emulated on CPU.

What the registry promises (invariant 5): a replay resets rows [live:bucket) of every
registered buffer, so a small replay after a large one sees no stale row anywhere; a
tensor the captured forward reads that is not a registered buffer fails the capture.
Invariant 6: capture batches are built like live ones, and a live batch that lacks
metadata is an error. The revert-then-red test disables the tail reset from here and
watches the hybrid bit-exact guard go red on the stale-track scenario.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gpu.graphs.runner as runner_mod
from gpu.attention.base import AttentionBackend
from gpu.forward_batch import ForwardBatch, PrefillChunk, SamplingRow
from gpu.graphs.runner import Bucket, GraphRunner, capture_batch, padding_lens
from gpu.graphs.static_buffers import BufferSpec, StaticBufferError, StaticBuffers
from kernel import Engine
from kernel.components import Components, build_components
from kernel.config import ConfigError, load_config
from tests import leaks
from tests.conftest import GRAPHS_EMULATE, HYBRID_OVERRIDES, TINY_OVERRIDES, graph_replays
from tests.test_bit_exact_hybrid import guard_branching
from tests.test_bit_exact_hybrid import make as make_hybrid

GREEDY_ROW = SamplingRow(0.0, 1.0, -1, 0.0, 0.0, 0.0, 1.0, 0, 0, 0)
CPU = torch.device("cpu")


def parts(folder: str, base: dict[str, Any], **extra: Any) -> Components:
    config = load_config(None, {**base, "model.path": folder, "deterministic": True, **extra})
    return build_components(config, CPU)


@pytest.fixture(scope="module")
def dense(tiny_chat_folder: str) -> Components:
    return parts(tiny_chat_folder, TINY_OVERRIDES, **GRAPHS_EMULATE)


@pytest.fixture(scope="module")
def hybrid(hybrid_folders: dict[str, str]) -> Components:
    return parts(hybrid_folders["qwen3_5_text"], HYBRID_OVERRIDES, **GRAPHS_EMULATE)


def batch(lens: list[int], first_slot: int = 10, track: dict[int, tuple[tuple[int, int], ...]] | None = None,
          prefix: int = 0) -> ForwardBatch:
    """Requests in rows 1.. with `lens` new tokens each (after `prefix`), states in slots
    first_slot.., every request sampling; `track`: request index -> its tracked points."""
    chunks = [
        PrefillChunk(tuple(range(3, 3 + n)), i + 1, prefix, first_slot + i, first_slot + i, (track or {}).get(i, ()))
        for i, n in enumerate(lens)
    ]
    return ForwardBatch.build(chunks, [(i, GREEDY_ROW) for i in range(len(chunks))])


def stale_rows(graphs: GraphRunner, last: ForwardBatch) -> dict[str, int]:
    """Per registered buffer, how many rows in [live:bucket) of the last batch's bucket
    do not hold the sentinel."""
    graph = graphs.bucket_for(last)
    assert graph is not None
    buffers = graphs.buffers[graph.bucket.kind]
    live = graphs._live(last)
    out = {}
    for name, spec in buffers.specs.items():
        tail = buffers.tensors[name][live[name].shape[0] : graph.rows[spec.unit]]
        bad = (tail != spec.sentinel).reshape(tail.shape[0], -1).any(dim=1)
        out[name] = int(bad.sum())
    return out


# ---- the registry: no stale row after a smaller replay ---------------------------
@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_small_replay_after_large_leaves_no_stale_row(hybrid: Components, kind: str) -> None:
    graphs = hybrid.runner.graphs
    assert graphs is not None
    if kind == "prefill":  # both in the 64-token bucket; the large one tracks states
        large = batch([20, 12, 9, 7], track={0: ((8, 40), (16, 41)), 1: ((8, 42),)})
        small = batch([33], first_slot=20)
    else:  # buckets 8 and 4
        large, small = batch([1] * 7, prefix=5), batch([1] * 3, first_slot=20, prefix=9)
    hybrid.runner.run(large)
    # The large replay left rows past the small one's live rows in most buffers ...
    touched = {k: v for k, v in stale_rows(graphs, small).items() if v}
    assert len(touched) >= (6 if kind == "prefill" else 4), touched
    hybrid.runner.run(small)
    # ... and the small replay reset every one of them.
    assert not any(stale_rows(graphs, small).values()), stale_rows(graphs, small)
    assert set(stale_rows(graphs, small)) >= {"track_slots", "track_mask", "state_dst", "attention.out_cache_loc"}


def test_without_the_tail_reset_stale_rows_stay(hybrid: Components, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: with the reset planted away, rows of the large replay stay."""
    graphs = hybrid.runner.graphs
    assert graphs is not None
    large, small = batch([20, 12, 9, 7], track={0: ((8, 40), (16, 41))}), batch([33], first_slot=20)
    hybrid.runner.run(large)
    monkeypatch.setattr(StaticBuffers, "reset_tail", lambda self, name, live, rows: None)
    hybrid.runner.run(small)
    stale = stale_rows(graphs, small)
    assert stale["track_slots"] == 2 and stale["state_dst"] == 3, stale


def test_registry_refuses_unregistered_and_missing_values() -> None:
    buffers = StaticBuffers({"tokens": 4, "requests": 2}, CPU)
    buffers.register("seq_lens", BufferSpec("requests", (), torch.int64, 1))
    with pytest.raises(StaticBufferError, match="registered twice"):
        buffers.register("seq_lens", BufferSpec("requests", (), torch.int64, 1))
    with pytest.raises(StaticBufferError, match="unregistered static buffers: \\['extra'\\]"):
        buffers.stage({"seq_lens": torch.tensor([3]), "extra": torch.tensor([1])}, {"requests": 2})
    with pytest.raises(StaticBufferError, match="lacks metadata for static buffers \\['seq_lens'\\]"):
        buffers.stage({}, {"requests": 2})
    views = buffers.stage({"seq_lens": torch.tensor([7])}, {"requests": 2})
    assert views["seq_lens"].tolist() == [7, 1]  # the padding row holds the sentinel
    assert buffers.owns(views["seq_lens"]) and not buffers.owns(torch.tensor([7, 1]))


# ---- unregistered reads fail the capture ----------------------------------------
def test_unregistered_attention_metadata_fails_capture(dense: Components, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = type(dense.runner.attention)  # deterministic mode's (on CPU: deterministic_paged)
    real = backend.bind_static

    def with_extra(self: AttentionBackend, views: Any) -> None:
        real(self, views)
        self._kv_lens = torch.zeros(4, dtype=torch.int64)  # type: ignore[attr-defined]  # planted: outside the registry

    monkeypatch.setattr(backend, "bind_static", with_extra)
    runner = GraphRunner(dense.runner.model, dense.runner.attention, None, "emulate", [1, 2], [16], 2)
    with pytest.raises(StaticBufferError, match="reads attention._kv_lens, which is not a registered"):
        runner.capture()


@pytest.mark.parametrize("field", ["state_track", "sample_rows"])
def test_batch_field_without_a_buffer_fails_capture(
    hybrid: Components, monkeypatch: pytest.MonkeyPatch, field: str
) -> None:
    """A ForwardBatch field that no registered buffer takes (as a newly added field would be)."""
    monkeypatch.setattr(runner_mod, "BATCH_FIELDS", {k: v for k, v in runner_mod.BATCH_FIELDS.items() if k != field})
    r = hybrid.runner
    runner = GraphRunner(r.model, r.attention, r.states, "emulate", [1], [16], 2)
    with pytest.raises(StaticBufferError, match=f"ForwardBatch.{field} is read by no registered static buffer"):
        runner.capture()


def test_unregistered_hybrid_buffer_fails_capture(hybrid: Components, monkeypatch: pytest.MonkeyPatch) -> None:
    """The track buffers left out of the registry: the capture-time mapping says which."""
    specs = {k: v for k, v in runner_mod._STATE_INPUTS.items() if not k.startswith("track")}
    monkeypatch.setattr(runner_mod, "_STATE_INPUTS", specs)
    r = hybrid.runner
    with pytest.raises(StaticBufferError, match="state_track lands in unregistered static buffer 'track_slots'"):
        GraphRunner(r.model, r.attention, r.states, "emulate", [1], [16], 2).capture()


# ---- capture batches and live batches: one constructor, no zero-filling -----------
def test_capture_batches_are_built_like_live_batches() -> None:
    for bucket in (Bucket("decode", 4, 4), Bucket("prefill", 16, 5), Bucket("prefill", 3, 5)):
        cap = capture_batch(bucket)
        assert set(cap.rows) == {0} and len(cap.input_ids) == bucket.tokens
        assert len(cap.rows) <= bucket.requests - (bucket.kind == "prefill")
    for tokens in (15, 13):  # a verify bucket's: chunks of at most the span, every position sampled
        cap = capture_batch(Bucket("verify", tokens, tokens), span=5)
        assert set(cap.rows) == {0} and len(cap.input_ids) == tokens and max(cap.extend_lens) == 5
        assert len(cap.sample_rows) == tokens and sorted(cap.sample_back) != list(cap.sample_back)
    with pytest.raises(ValueError, match="malformed chunk"):  # row 0 only for padding requests
        ForwardBatch.build([PrefillChunk((5,), 0, 3)], [])


def test_live_batch_missing_metadata_is_an_error(hybrid: Components) -> None:
    full = batch([4, 1])
    lacking = ForwardBatch(full.input_ids, full.rows, full.prefix_lens, full.extend_lens, full.sample_rows,
                           full.sampling, state_src=(10,), state_dst=(10, 11))
    assert hybrid.runner.graphs is not None and hybrid.runner.graphs.bucket_for(lacking) is not None
    with pytest.raises(ValueError, match="lacks state slots"):
        hybrid.runner.run(lacking)


def test_buckets_and_padding() -> None:
    assert padding_lens(3, 3, Bucket("decode", 8, 8)) == [1] * 5
    assert padding_lens(2, 10, Bucket("prefill", 16, 5)) == [1, 1, 4]
    assert padding_lens(4, 16, Bucket("prefill", 16, 5)) == [0]
    with pytest.raises(StaticBufferError):
        padding_lens(2, 17, Bucket("prefill", 16, 5))


def test_bucket_choice(dense: Components) -> None:
    graphs = dense.runner.graphs
    assert graphs is not None
    pick = graphs.bucket_for
    assert pick(batch([1] * 3)).bucket == Bucket("decode", 4, 4)  # type: ignore[union-attr]
    assert pick(batch([1] * 16)).bucket == Bucket("decode", 16, 16)  # type: ignore[union-attr]
    assert pick(batch([1] * 17)) is None  # above the largest decode bucket, too many requests for prefill
    assert pick(batch([9, 1, 1])).bucket == Bucket("prefill", 16, 5)  # type: ignore[union-attr]
    assert pick(batch([40, 24])).bucket == Bucket("prefill", 64, 5)  # type: ignore[union-attr]
    assert pick(batch([40, 25])) is None  # 65 tokens: eager
    assert pick(batch([2] * 5)) is None  # more requests than prefill slots: eager


def test_padded_forward_gives_live_rows_the_eager_bits(dense: Components) -> None:
    runner, graphs = dense.runner, dense.runner.graphs
    assert graphs is not None
    table = runner.attention.req_to_token
    for row in range(1, 6):  # distinct KV slots per request (rows 1..5, pages 32.. of each)
        table[row, :64] = torch.arange(row * 128, row * 128 + 64)
    try:
        for b in (batch([9, 1, 5]), batch([1] * 5, prefix=7), batch([30, 17])):
            with torch.inference_mode():
                eager = runner.forward(b)
                graph = graphs.bucket_for(b)
                assert graph is not None
                static = graphs.replay(graph, b)
            assert torch.equal(eager, static)
    finally:
        table[1:6] = 0


# ---- configuration ------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_mode_without_cuda_is_a_config_error(tiny_chat_folder: str) -> None:
    with pytest.raises(ConfigError, match="graphs.mode: cuda needs a CUDA device"):
        Engine(None, {"model.path": tiny_chat_folder, **TINY_OVERRIDES, "deterministic": True, "graphs.mode": "cuda"})


def test_emulate_needs_static_attention_metadata(tiny_chat_folder: str) -> None:
    with pytest.raises(ConfigError, match="graphs.mode: emulate needs an attention backend"):
        Engine(None, {"model.path": tiny_chat_folder, **TINY_OVERRIDES, "model.attention": "torch",
                      "graphs.mode": "emulate"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default")
def test_auto_is_off_on_cpu(tiny_engine: Engine) -> None:
    assert tiny_engine.config.graphs.mode == "auto"
    assert tiny_engine.engine.parts.runner.graphs is None


@pytest.mark.parametrize("key,value", [("graphs.mode", "on"), ("graphs.decode_buckets", [4, 2]),
                                       ("graphs.prefill_tokens", [0, 16]), ("graphs.prefill_max_requests", 0)])
def test_bad_graphs_config(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", "\\.")):
        load_config(None, {key: value})


# ---- emulate == graphs off, every strategy, both families -----------------------
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "return_logprob": True}


@pytest.mark.parametrize("family", ["qwen3_5_text", "lfm2"])
@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_hybrid_emulated_equals_graphs_off(hybrid_folders: dict[str, str], family: str, strategy: str) -> None:
    """Concurrent prompts, then a second round that hits their prefixes: `==` across modes."""
    from tests.test_bit_exact_hybrid import assert_bit_exact, tokens

    prompts = [tokens(50 + i, 6 + 11 * i) for i in range(5)]
    results = {}
    for mode, extra in (("off", {}), ("emulate", GRAPHS_EMULATE)):
        engine = make_hybrid(hybrid_folders[family], strategy, **extra)
        try:
            first = engine.generate(prompts, [GREEDY] * 5)
            second = engine.generate([p + [7, 8, 9] for p in prompts], [GREEDY] * 5)
            assert any(o["meta_info"]["cached_tokens"] for o in second)  # type: ignore[index]
            results[mode] = list(first) + list(second)  # type: ignore[arg-type]
            if extra:
                assert all(graph_replays(engine).values())
        finally:
            engine.shutdown()
    for off, emulated in zip(results["off"], results["emulate"]):
        assert_bit_exact(emulated, off)


# ---- revert-then-red: no tail reset, the hybrid bit-exact guard goes red ---------
# One bucket per kind: every stale row then comes from a replay of the same bucket, so
# it indexes inside the buffers (a larger bucket's stale token index would raise).
RED = {**GRAPHS_EMULATE, "graphs.decode_buckets": [16], "graphs.prefill_tokens": [64],
       "debug.check_invariants": False}


def plant_no_reset(monkeypatch: pytest.MonkeyPatch, only: str = "") -> None:
    real = StaticBuffers.reset_tail

    def no_reset(self: StaticBuffers, name: str, live: int, rows: int) -> None:
        if only and not name.startswith(only):
            real(self, name, live, rows)

    monkeypatch.setattr(StaticBuffers, "reset_tail", no_reset)


@pytest.mark.parametrize("planted", [False, True], ids=["reset", "no-reset"])
@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_red_stale_rows_without_tail_reset(
    hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch, strategy: str, planted: bool
) -> None:
    """Prefill graph + chunked prefill (32-token chunks, checkpoints every 8 inside them)
    + 15 concurrent requests + prefix hits: green with the reset, red without it."""
    if planted:
        plant_no_reset(monkeypatch)
    engine = make_hybrid(hybrid_folders["qwen3_5_text"], strategy, **RED)
    try:
        if not planted:
            guard_branching(engine, noise=15)
            assert all(graph_replays(engine).values())
            return
        with pytest.raises(AssertionError, match="bit-exact guard"):
            guard_branching(engine, noise=15)
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()


@pytest.mark.parametrize("strategy", ["extra_buffer", "extra_buffer_lazy"])
def test_red_stale_track_rows_only(
    hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """The field report itself: only the track buffers keep the previous replay's rows, so
    a checkpoint write lands in a slot the cache already owns."""
    plant_no_reset(monkeypatch, only="track")
    engine = make_hybrid(hybrid_folders["qwen3_5_text"], strategy, **RED)
    try:
        with pytest.raises(AssertionError, match="bit-exact guard"):
            guard_branching(engine, noise=15)
    finally:
        leaks.excuse(engine.engine)
        engine.shutdown()


# ---- CUDA: capture + replay (skips without a GPU) --------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_equal_emulation(tiny_chat_folder: str) -> None:
    from tests.test_bit_exact import GREEDY as DENSE_GREEDY
    from tests.test_bit_exact import assert_bit_exact, tokens

    prompts = [tokens(60 + i, 5 + 9 * i) for i in range(6)]
    results = {}
    for mode in ("emulate", "cuda"):
        engine = Engine(None, {"model.path": tiny_chat_folder, **TINY_OVERRIDES, "deterministic": True,
                               "cache.prefix": "radix", "model.device": "cuda", **GRAPHS_EMULATE, "graphs.mode": mode})
        try:
            results[mode] = engine.generate(prompts, [DENSE_GREEDY] * 6)
            assert all(graph_replays(engine).values())
        finally:
            engine.shutdown()
    for cuda, emulated in zip(results["cuda"], results["emulate"]):  # type: ignore[arg-type]
        assert_bit_exact(cuda, emulated)
