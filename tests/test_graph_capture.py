"""What a captured graph may contain: a forward that makes no tensor from host values and
reads nothing back (a CUDA graph replays kernels; whatever the forward decided on the host
at capture is frozen).

Checked on CPU by running a bucket's forward with those operations made to raise: dense
models in every bucket (deterministic and triton backends), hybrid models in decode
buckets — their state layers decide by the step's lengths, so only a decode bucket (every
request one token, nothing tracked) and a verify bucket (the lengths a buffer, the state
layers' static forms) are captured for them, and a live step whose control differs from
the capture's is an error. Planted: a decode path that builds its index
tensors from the lengths goes red, and so does each host-value construct of
tests/host_reads.py planted into the dense forward. On a GPU: captured hybrid decode graphs give the
emulated run's bits, every state strategy, both families.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # the fast (non-deterministic) runs use the triton backend
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gpu.attention.deterministic import DeterministicAttention
from gpu.forward_batch import ForwardBatch, PrefillChunk
from gpu.graphs.runner import GraphRunner
from gpu.graphs.static_buffers import StaticBufferError
from gpu.kernels import gated_delta, short_conv
from kernel.components import Components
from tests.conftest import GRAPHS_EMULATE, HYBRID_OVERRIDES, TINY_OVERRIDES, graph_replays
from tests.host_reads import HostRead, trap_host_tensors
from tests.test_graph_runner import GREEDY_ROW, batch, parts

FAMILIES = ["qwen3_5_text", "lfm2"]


def need_interpreted_triton() -> None:
    """These engines run on CPU: triton only in its interpreter (no GPU here)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("triton on a CPU engine needs the interpreter; on a GPU the CUDA tests cover it")


@contextmanager
def no_host_traffic(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Inside: building a tensor from host values, or reading one back, raises."""
    with monkeypatch.context() as m:
        trap_host_tensors(m, "a captured forward")
        yield


@pytest.fixture(scope="module")
def dense_emulated(tiny_chat_folder: str) -> Components:
    return parts(tiny_chat_folder, TINY_OVERRIDES, **GRAPHS_EMULATE)


def forward_without_host_traffic(
    parts_: Components, monkeypatch: pytest.MonkeyPatch, live: ForwardBatch | None = None, kind: str = "decode"
) -> None:
    graphs = parts_.runner.graphs
    assert isinstance(graphs, GraphRunner)
    live = live or batch([1, 1, 1], prefix=5)
    graph = graphs.bucket_for(live)
    assert graph is not None and graph.bucket.kind == kind
    real = graphs._model_forward

    def guarded(graph: Any, step: Any) -> torch.Tensor:
        with no_host_traffic(monkeypatch):
            return real(graph, step)

    monkeypatch.setattr(graphs, "_model_forward", guarded)
    with torch.inference_mode():
        logits = graphs.replay(graph, live)
    assert logits.shape[0] == len(live.sample_rows) and bool(torch.isfinite(logits).all())


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fast"])
@pytest.mark.parametrize("family", FAMILIES)
def test_decode_forward_makes_no_host_tensors(
    hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch, family: str, deterministic: bool
) -> None:
    if not deterministic:
        need_interpreted_triton()
    extra = {} if deterministic else {"deterministic": False, "model.attention": "triton"}
    forward_without_host_traffic(parts(hybrid_folders[family], HYBRID_OVERRIDES, **GRAPHS_EMULATE, **extra),
                                        monkeypatch)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("attention", ["deterministic", "triton"])
def test_dense_forward_makes_no_host_tensors(
    tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch, attention: str, kind: str
) -> None:
    if attention == "triton":
        need_interpreted_triton()
    extra = {"deterministic": attention == "deterministic", "model.attention": attention}
    live = batch([1, 1, 1], prefix=5) if kind == "decode" else batch([9, 1, 5])
    forward_without_host_traffic(parts(tiny_chat_folder, TINY_OVERRIDES, **GRAPHS_EMULATE, **extra), monkeypatch,
                                 live, kind)


def verify_batch() -> ForwardBatch:
    """A hybrid verify step: two verify chunks (5 and 3 tokens, every position sampled) and
    a plain decode, states from slots 10.. to fresh slots, every position but the last of
    each chunk tracked."""
    chunks = [PrefillChunk(tuple(range(3, 8)), 1, 6, 10, 24, ((7, 20), (8, 21), (9, 22), (10, 23))),
              PrefillChunk((4, 5, 6), 2, 4, 11, 27, ((5, 25), (6, 26))), PrefillChunk((9,), 3, 7, 12, 12)]
    sampling = [(0, GREEDY_ROW)] * 5 + [(1, GREEDY_ROW)] * 3 + [(2, GREEDY_ROW)]
    return ForwardBatch.build(chunks, sampling, sample_back=(4, 3, 2, 1, 0, 2, 1, 0, 0))


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_forward_makes_no_host_tensors(hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch,
                                              family: str) -> None:
    """A hybrid verify bucket (its lengths a registered buffer, the state layers' static
    forms, the torch ones: what CUDA captures) builds nothing from host values either."""
    components = parts(hybrid_folders[family], HYBRID_OVERRIDES, **GRAPHS_EMULATE,
                       **{"model.cpu_kernels": "off", "speculative.method": "ngram"})
    forward_without_host_traffic(components, monkeypatch, verify_batch(), "verify")


@pytest.mark.parametrize("family,planted", [("qwen3_5_text", "delta"), ("qwen3_5_text", "native"), ("lfm2", "conv")])
def test_red_decode_path_indexing_by_lengths(
    hybrid_folders: dict[str, str], monkeypatch: pytest.MonkeyPatch, family: str, planted: str
) -> None:
    """Planted: the decode path gathers its rows through index tensors built from the
    lengths (what the general path does): the check above goes red. `delta`: torch's
    form (the C++ kernels off); `native`: the C++ form's request offsets made from the
    lengths in a decode step too (a bug this check caught)."""
    extra: dict[str, Any] = {}
    if planted == "delta":
        def by_lengths(x: gated_delta.DeltaInputs, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            rows = torch.tensor(list(range(states.shape[0])), device=states.device)
            return gated_delta.recurrent_step(x.rows(rows), states[rows])
        monkeypatch.setattr(gated_delta, "decode_step", by_lengths)
        extra["model.cpu_kernels"] = "off"
    elif planted == "native":
        if not gated_delta.native_available(torch.device("cpu")):
            pytest.skip("the C++ gated-delta kernel does not build here")
        real = gated_delta.native_varlen

        def offsets_from_lengths(x: Any, states: torch.Tensor, extend_lens: Any, track: Any = ()) -> Any:
            torch.tensor(list(extend_lens), dtype=torch.int64).cumsum(0)
            return real(x, states, extend_lens, track)
        monkeypatch.setattr(gated_delta, "native_varlen", offsets_from_lengths)
    else:
        monkeypatch.setattr(short_conv, "_one_token_each", lambda x, windows, weight, bias: short_conv._varlen(
            x, windows, torch.tensor([1] * x.shape[0]), weight, bias)[:2])
    components = parts(hybrid_folders[family], HYBRID_OVERRIDES, **GRAPHS_EMULATE, **extra)
    with pytest.raises(HostRead, match="torch.tensor during a captured forward"):
        forward_without_host_traffic(components, monkeypatch)


# Tensors made from host values, each planted into the dense forward: (construct, HostRead's message).
HOST_TENSORS: dict[str, tuple[Any, str]] = {
    "tensor": (lambda x: torch.tensor([1, 2], device=x.device), "torch.tensor"),
    "as_tensor": (lambda x: torch.as_tensor([1, 2], device=x.device), "torch.as_tensor"),
    "asarray": (lambda x: torch.asarray([1, 2]), "torch.asarray"),
    "from_numpy": (lambda x: torch.from_numpy(np.arange(3)), "torch.from_numpy"),
    "scalar_tensor": (lambda x: torch.scalar_tensor(3), "torch.scalar_tensor"),
    "full": (lambda x: torch.full((2,), 5, device=x.device), "torch.full with a host value"),
    "full_like": (lambda x: torch.full_like(x, 5), "torch.full_like with a host value"),
    "new_full": (lambda x: x.new_full((2,), 5), "Tensor.new_full with a host value"),
    "fill_": (lambda x: x.clone().fill_(5), "Tensor.fill_ with a host value"),
    "new_tensor": (lambda x: x.new_tensor([1, 2]), "Tensor.new_tensor"),
    "list-index": (lambda x: x[[0]], "indexing with a host list"),
    "mask-index": (lambda x: x[x > 0], "boolean-mask indexing"),
    "nonzero": (lambda x: x.nonzero(), "Tensor.nonzero"),
}


@pytest.mark.parametrize("construct", list(HOST_TENSORS))
def test_red_forward_making_a_tensor_from_host_values(
    dense_emulated: Components, monkeypatch: pytest.MonkeyPatch, construct: str
) -> None:
    """Each construct planted into the dense forward (after a layer's attention) trips the trap."""
    from gpu.models.llama import LlamaModel

    plant, message = HOST_TENSORS[construct]
    real = LlamaModel._attention

    def attention_then_plant(self: LlamaModel, *args: Any) -> torch.Tensor:
        out = real(self, *args)
        plant(out)
        return out

    monkeypatch.setattr(LlamaModel, "_attention", attention_then_plant)
    with pytest.raises(HostRead, match=f"^{message}.* during a captured forward$"):
        forward_without_host_traffic(dense_emulated, monkeypatch)


def test_the_capture_trap_lets_constant_fills_through() -> None:
    """A float constant (a running max's start), a tensor fill and as_tensor of a tensor pass."""
    x = torch.zeros(3)
    with pytest.MonkeyPatch.context() as mp:
        trap_host_tensors(mp, "a captured forward")
        assert torch.full((2,), -1.0e30).shape == (2,) and x.clone().fill_(x[0]).shape == (3,)
        assert torch.as_tensor(x) is x and torch.zeros_like(x).shape == (3,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_conv_is_the_varlen_conv(dtype: torch.dtype) -> None:
    """The decode path of the short conv gives the general path's bits."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn((5, 12), generator=gen).to(dtype)
    windows = torch.randn((5, 12, 3), generator=gen)
    weight, bias = torch.randn((12, 4), generator=gen).to(dtype), torch.randn(12, generator=gen).to(dtype)
    for b in (bias, None):
        fast = short_conv.short_conv_varlen(x, windows, [1] * 5, weight, b)
        general = short_conv.short_conv_static(x, windows, torch.ones(5, dtype=torch.int64), weight, b)
        assert all(torch.equal(f, g) for f, g in zip(fast, general[:2]))


def test_live_control_must_match_the_capture(hybrid_folders: dict[str, str]) -> None:
    components = parts(hybrid_folders["qwen3_5_text"], HYBRID_OVERRIDES, **GRAPHS_EMULATE)
    graphs = components.runner.graphs
    assert isinstance(graphs, GraphRunner)
    decode = graphs.bucket_for(batch([1] * 4, prefix=3))
    assert decode is not None and decode.bucket.kind == "decode"
    with torch.inference_mode(), pytest.raises(StaticBufferError, match="host-side control differs"):
        graphs.replay(decode, batch([2, 1], prefix=3))  # 3 tokens fit the bucket, its control does not


# ---- CUDA: captured hybrid decode graphs (skip without a GPU) --------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_cuda_hybrid_decode_graphs_equal_emulation(hybrid_folders: dict[str, str], family: str, strategy: str) -> None:
    from tests.test_bit_exact_hybrid import assert_bit_exact, make, tokens
    from tests.test_graph_runner import GREEDY

    prompts = [tokens(40 + i, 6 + 11 * i) for i in range(5)]
    results = {}
    for mode in ("emulate", "cuda"):
        engine = make(hybrid_folders[family], strategy, **{**GRAPHS_EMULATE, "model.device": "cuda", "graphs.mode": mode})
        try:
            first = engine.generate(prompts, [GREEDY] * 5)
            second = engine.generate([p + [7, 8, 9] for p in prompts], [GREEDY] * 5)
            results[mode] = list(first) + list(second)  # type: ignore[arg-type]
            assert graph_replays(engine)["decode"] > 0
        finally:
            engine.shutdown()
    for cuda, emulated in zip(results["cuda"], results["emulate"]):
        assert_bit_exact(cuda, emulated)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("topk", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_hybrid_verify_graphs_equal_emulation(hybrid_folders: dict[str, str], family: str, topk: int) -> None:
    """Speculating hybrid engines (chains and token trees): captured verify graphs give
    the emulated run's tokens and logprobs, and the plain engine's."""
    from tests.test_speculative import ORACLE, same
    from tests.test_speculative_hybrid import PARAMS, PROMPTS, make, reference
    from tests.test_speculative_tree import TREE

    folder = hybrid_folders[family]
    plain = make(folder, "extra_buffer", **{"cache.prefix": "none", "model.device": "cuda"})
    try:
        refs = [reference(plain, p, q) for p, q in zip(PROMPTS, PARAMS)]
    finally:
        plain.shutdown()
    for mode in ("emulate", "cuda"):
        engine = make(folder, "extra_buffer", **(ORACLE if topk == 1 else TREE),
                      **{**GRAPHS_EMULATE, "model.device": "cuda", "graphs.mode": mode})
        try:
            outs = engine.generate(PROMPTS, PARAMS)
            assert isinstance(outs, list) and graph_replays(engine)["verify"] > 0
            for out, ref in zip(outs, refs):
                same(out, ref)
        finally:
            engine.shutdown()


def test_red_backend_binding_a_per_step_value(tiny_chat_folder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the attention backend keeps a per-step host value from the staged views (a
    CUDA graph would freeze the capture's). The replay of another step is refused."""
    real = DeterministicAttention.bind_static

    def keeps_live_count(self: DeterministicAttention, views: Any) -> None:
        real(self, views)
        self.live_tiles = int((views["tile_tok"][:, 0] >= 0).sum())  # type: ignore[attr-defined]

    monkeypatch.setattr(DeterministicAttention, "bind_static", keeps_live_count)
    # The torch form of deterministic attention (the C++ kernels off): its tiles are the per-step value.
    components = parts(tiny_chat_folder, {**TINY_OVERRIDES, "model.cpu_kernels": "off"}, **GRAPHS_EMULATE)
    graphs = components.runner.graphs
    assert isinstance(graphs, GraphRunner)
    live = batch([1, 1, 1], prefix=5)
    graph = graphs.bucket_for(live)
    assert graph is not None and graph.control["attention.live_tiles"] == 4  # the capture batch's
    with torch.inference_mode(), pytest.raises(StaticBufferError, match="live_tiles"):
        graphs.replay(graph, live)
