"""graphs.mode cpu: the native decode step (gpu/kernels/cpu/decode_step.cpp) against the torch path.

The step claims bit-identity with the torch path over the C++ kernels for every decode
batch it takes (gpu/models/llama_cpu_step.py), so each guard compares tokens and logprobs
with `==`, on the same engine with its CPU step runner detached (the reference) and
attached (and checks that the native step ran). The planted bugs — a layer skipped, new
K/V written to a stale slot, a wrong page read — must turn that comparison red.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gpu.graphs import cpu_step
from gpu.graphs.cpu_step import CpuStepRunner
from gpu.kernels import cpu
from gpu.models import llama_cpu_step
from gpu.quant import gemv
from kernel import Engine
from kernel.components import build_graph_runner
from kernel.config import ConfigError
from tests.conftest import CONFIG, FLOAT32
from tests.tiny_models import VOCAB, build_tiny

if not all(cpu.load(name) for name in ("decode_step", "quant_gemv", "paged_attention", "llama_glue")):
    pytest.skip("the C++ CPU kernels are off or do not build here", allow_module_level=True)

GREEDY = {"temperature": 0, "ignore_eos": True, "return_logprob": True, "top_logprobs_num": 2}
# Several lengths, so rows leave the batch at different steps (batch sizes 5 down to 1),
# and one prompt past 128 keys, so its attention is split into chunks and merged.
LENGTHS = (3, 17, 40, 150, 9)
NEW_TOKENS = (12, 7, 10, 15, 4)


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randint(50, 40000) for _ in range(n)] for n in LENGTHS]


def _quantized(dtype: str, kv_dtype: str = "auto") -> dict[str, Any]:
    # One native step a call (decode runs: tests/test_decode_runs.py), so the torch path can stand in.
    return {"model.dtype": dtype, "model.quantization": "int4", "graphs.mode": "cpu", "cache.prefix": "none",
            "cache.num_pages": 256, "debug.check_invariants": True, "cache.kv_dtype": kv_dtype,
            "scheduler.decode_steps": 1}


# float32 with the default (auto) KV pool stores float16 K/V; with `model` float32 ones.
KV_POOLS = {"float32": torch.float16, "float32-kv-model": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(scope="module", params=list(KV_POOLS))
def native_engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    dtype, _, kv = request.param.partition("-kv-")
    engine = Engine(CONFIG, _quantized(dtype, kv or "auto"))
    assert _runner(engine).pool.k[0].dtype == KV_POOLS[request.param]
    yield engine
    engine.shutdown()


def _runner(engine: Engine) -> Any:
    return engine.engine.parts.runner  # type: ignore[attr-defined]


def _run(engine: Engine) -> list[Any]:
    params = [{**GREEDY, "max_new_tokens": n} for n in NEW_TOKENS]
    outs = engine.generate(_prompts(), params)
    assert isinstance(outs, list)
    return [(o["output_ids"], o["meta_info"]["output_token_logprobs"], o["meta_info"]["output_top_logprobs"])
            for o in outs]


def _native_steps(engine: Engine) -> int:
    return sum(_runner(engine).graphs.replays.values())


@pytest.fixture(scope="module")
def reference(native_engine: Engine) -> list[Any]:
    """The torch path's outputs: the same engine with its CPU step runner detached."""
    runner = _runner(native_engine)
    graphs, runner.graphs = runner.graphs, None
    try:
        return _run(native_engine)
    finally:
        runner.graphs = graphs


def test_native_step_is_bit_identical(native_engine: Engine, reference: list[Any]) -> None:
    assert isinstance(_runner(native_engine).graphs, CpuStepRunner)
    before = _native_steps(native_engine)
    assert _run(native_engine) == reference
    sizes = {b.requests for b in _runner(native_engine).graphs.replays}
    assert _native_steps(native_engine) - before >= max(NEW_TOKENS) - 1, "the native step did not run"
    assert {1, 5} <= sizes, f"batch sizes run natively: {sorted(sizes)}"


def _skip_layer(native_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _runner(native_engine)
    model, pool, skip = runner.model, runner.pool, 3
    keep = [i for i in range(model.arch.num_layers) if i != skip]
    arch = SimpleNamespace(**{**vars(model.arch), "num_layers": len(keep)})
    view = SimpleNamespace(**{k: getattr(model, k) for k in ("embed", "rope_table", "norm", "lm_head")},
                           arch=arch, layers=[model.layers[i] for i in keep])
    pool_view = SimpleNamespace(page_size=pool.page_size, k=[pool.k[i] for i in keep], v=[pool.v[i] for i in keep])
    monkeypatch.setattr(runner.graphs, "decoder", llama_cpu_step.build(view, pool_view))  # type: ignore[arg-type]


def _wrap_step(native_engine: Engine, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    decoder = _runner(native_engine).graphs.decoder
    step = decoder.step

    def planted(ids: torch.Tensor, pos: torch.Tensor, loc: torch.Tensor, pages: torch.Tensor, lens: torch.Tensor,
                rows: torch.Tensor) -> torch.Tensor:
        if change == "stale slot":  # the new K/V lands one slot off; the real one keeps old data
            loc = loc + 1
        else:  # the first page of every row read from the page after it
            pages = pages.clone()
            pages[:, 0] += 1
        return step(ids, pos, loc, pages, lens, rows)  # type: ignore[no-any-return]

    monkeypatch.setattr(decoder, "step", planted)


@pytest.mark.parametrize("bug", ["layer skipped", "stale slot", "wrong page"])
def test_planted_bugs_go_red(native_engine: Engine, reference: list[Any], monkeypatch: pytest.MonkeyPatch,
                             bug: str) -> None:
    if native_engine.config.model.dtype != "float32" or native_engine.config.cache.kv_dtype != "auto":
        pytest.skip("the guard is the same comparison in either dtype: shown red once, in float32")
    if bug == "layer skipped":
        _skip_layer(native_engine, monkeypatch)
    else:
        _wrap_step(native_engine, monkeypatch, bug)
    before = _native_steps(native_engine)
    planted = _run(native_engine)
    assert _native_steps(native_engine) > before
    assert planted != reference, f"{bug}: the comparison did not catch the planted bug"


def test_bad_step_input_changes_nothing(native_engine: Engine) -> None:
    runner = _runner(native_engine)
    decoder, pool = runner.graphs.decoder, runner.pool
    k_before = [k.clone() for k in pool.k]
    one = torch.tensor([1], dtype=torch.int64)
    pages = torch.tensor([[1]], dtype=torch.int64)
    good = {"ids": one, "pos": one, "loc": torch.tensor([16]), "pages": pages, "lens": torch.tensor([2]),
            "rows": torch.tensor([0])}
    bad = {
        "ids": torch.tensor([10**9]),
        "pos": torch.tensor([10**9]),
        "loc": torch.tensor([pool.k[0].shape[0]]),
        "pages": torch.tensor([[pool.k[0].shape[0] // pool.page_size]]),
        "lens": torch.tensor([pool.page_size + 1]),  # more keys than its one page holds
        "rows": torch.tensor([1]),
    }
    for key, value in bad.items():
        args = {**good, key: value}
        with pytest.raises(RuntimeError, match="LlamaDecoder.step|paged_attention_decode"):
            decoder.step(args["ids"], args["pos"], args["loc"], args["pages"], args["lens"], args["rows"])
    assert all(torch.equal(a, b) for a, b in zip(k_before, pool.k)), "a rejected step wrote the pool"


def test_auto_picks_the_native_step_where_it_runs(native_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = native_engine.engine.parts  # type: ignore[attr-defined]
    runner, config = parts.runner, native_engine.config
    auto = SimpleNamespace(**{**vars(config), "graphs": SimpleNamespace(**{**vars(config.graphs), "mode": "auto"})})
    picked = build_graph_runner(auto, runner.model, runner.attention, None, torch.device("cpu"))  # type: ignore[arg-type]
    # the int8 head's row limit bounds the step (the 4-bit kernel takes any, or 24 rows against
    # bf16 GEMMs on AMX): 16 rows in bfloat16 (any where the int8 kernel outruns bf16 GEMMs:
    # then max_running_requests), 64 in float32 (gpu/quant/linears.py), so buckets up to 16 / 64
    limit = min(runner.model.lm_head.quant.max_rows, config.scheduler.max_running_requests)
    assert isinstance(picked, CpuStepRunner)
    assert picked.max_rows == max(b for b in config.graphs.decode_buckets if b <= limit)
    wide = runner.model.dtype == torch.float32 or gemv.int8_outruns_bf16_gemms()
    assert picked.max_rows == (64 if wide else 16)
    monkeypatch.setattr(runner.model, "fused", False)  # as in deterministic mode or with the kernels off
    assert cpu_step.unsupported(runner.model, runner.attention) is not None
    assert build_graph_runner(auto, runner.model, runner.attention, None, torch.device("cpu")) is None  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="graphs.mode: cpu needs the C\\+\\+ CPU kernels"):
        build_graph_runner(config, runner.model, runner.attention, None, torch.device("cpu"))


def test_qkv_bias_model_is_bit_identical(tmp_path: Path) -> None:
    """Qwen2 (QKV bias): the bias is added in the qkv epilogue as the torch path adds it."""
    folder = build_tiny("qwen2", tmp_path / "qwen2")
    engine = Engine(None, {**FLOAT32, "model.path": str(folder), "model.quantization": "int8", "graphs.mode": "cpu",
                           "cache.prefix": "none", "cache.num_pages": 64, "cache.page_size": 4,
                           "debug.check_invariants": True})
    try:
        runner = _runner(engine)
        prompts = [[(i * 37 + j) % VOCAB for j in range(n)] for i, n in enumerate((3, 17, 40))]
        params = [{**GREEDY, "max_new_tokens": n} for n in (6, 9, 4)]
        def run() -> list[Any]:
            outs = engine.generate(prompts, params)
            assert isinstance(outs, list)
            return [(o["output_ids"], o["meta_info"]["output_token_logprobs"]) for o in outs]

        graphs, runner.graphs = runner.graphs, None
        reference = run()
        runner.graphs = graphs
        assert run() == reference
        assert sum(graphs.replays.values()) >= 8, "the native step did not run"
        # Planted: the decoder built without the bias goes red.
        model = runner.model
        view = SimpleNamespace(**{k: getattr(model, k) for k in ("arch", "embed", "rope_table", "norm", "lm_head")},
                               layers=[layer._replace(qkv_bias=None) for layer in model.layers])
        graphs.decoder = llama_cpu_step.build(view, runner.pool)  # type: ignore[arg-type]
        assert run() != reference, "dropping the QKV bias went unnoticed"
    finally:
        engine.shutdown()


PLAIN = {"temperature": 0, "ignore_eos": True}  # greedy, no logprobs: the step picks the tokens itself


def _run_plain(engine: Engine) -> list[list[int]]:
    outs = engine.generate(_prompts(), [{**PLAIN, "max_new_tokens": n} for n in NEW_TOKENS])
    assert isinstance(outs, list)
    return [o["output_ids"] for o in outs]


def test_picked_greedy_tokens_match_the_torch_path(native_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain-greedy batch's tokens come from the argmax the step takes inside its head phase."""
    runner = _runner(native_engine)
    graphs, runner.graphs = runner.graphs, None
    try:
        reference = _run_plain(native_engine)
    finally:
        runner.graphs = graphs
    decoder, picked = graphs.decoder, []
    step_argmax = decoder.step_argmax

    def counted(*args: torch.Tensor) -> torch.Tensor:
        picked.append(len(args[0]))
        return step_argmax(*args)  # type: ignore[no-any-return]

    monkeypatch.setattr(decoder, "step_argmax", counted)
    assert _run_plain(native_engine) == reference
    assert len(picked) >= max(NEW_TOKENS) - 1 and {1, 5} <= set(picked), f"picked steps by batch size: {picked}"

    def second_best(*args: torch.Tensor) -> torch.Tensor:  # planted: a wrong pick
        return decoder.step(*args).topk(2, dim=-1).indices[:, 1]  # type: ignore[no-any-return]

    monkeypatch.setattr(decoder, "step_argmax", second_best)
    assert _run_plain(native_engine) != reference, "a wrong in-step pick went unnoticed"


def _step_on_free_pages(native: Any, pool: Any, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of `rows` one-token rows, each on its own page at the pool's end (free: the
    engine is idle and keeps no prefix) -> (logits, picks)."""
    pages = pool.k[0].shape[0] // pool.page_size
    page_ids = torch.arange(pages - rows, pages, dtype=torch.int64)
    ids = torch.tensor([7, 1234, 40000][:rows], dtype=torch.int64)
    zero = torch.zeros(rows, dtype=torch.int64)
    return native.step_argmax(ids, zero, page_ids * pool.page_size, page_ids.unsqueeze(1), zero + 1,
                              torch.arange(rows, dtype=torch.int64))  # type: ignore[no-any-return]


def test_in_step_pick_is_argmax_on_ties_and_nan(native_engine: Engine) -> None:
    """The threads' per-tile picks merge to `argmax(dim=-1)`: the first of tied maxima (every
    tile of the head made the same, so each tile's maximum ties with the first's) and the
    first NaN (two tiles' scales NaN, far apart: in different threads' shares)."""
    runner = _runner(native_engine)
    head = llama_cpu_step._kernel_weight(runner.model.lm_head)
    assert head is not None and head.kind == llama_cpu_step.INT8, "the packaged model's head is int8 per channel"
    tiles, tile = head.weight.shape[0], gemv.TILE
    decoder = llama_cpu_step.build(runner.model, runner.pool).native
    decoder.set_head(head.kind, head.weight[:1].expand(tiles, -1).contiguous(), head.scales[:tile].repeat(tiles))
    logits, picks = _step_on_free_pages(decoder, runner.pool, 3)
    assert torch.equal(picks, logits.argmax(dim=-1)) and bool((picks < tile).all()), picks
    last_of_ties = logits.shape[1] - 1 - logits.flip(-1).argmax(dim=-1)  # planted: the last tied maximum
    assert not torch.equal(last_of_ties, picks), "the tie check cannot tell first from last"

    scales = head.scales.clone()
    early, late = tiles // 3, tiles - 2
    for t in (late, early):
        scales[t * tile : (t + 1) * tile] = float("nan")
    decoder.set_head(head.kind, head.weight, scales)
    logits, picks = _step_on_free_pages(decoder, runner.pool, 2)
    assert picks.tolist() == [early * tile] * 2 and torch.equal(picks, logits.argmax(dim=-1))
