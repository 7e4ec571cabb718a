"""Build the engine's parts from a Config: checkpoint, model, pools, scheduler."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import structlog
import torch

from cache.allocator import PageAllocator, pages_for
from cache.copy_worker import CopyWorker
from cache.host_pool import HostPool
from cache.kv_pool import KVPool
from cache.prefix_cache import NoPrefixCache, PrefixCache
from cache.radix_tree import RadixTree
from cache.req_table import ReqToTokenTable
from cache.state_pool import StatePool
from cache.storage import PageFormat, StorageBackend
from gpu.attention import paged_decode
from gpu.attention.base import AttentionBackend
from gpu.cpu_threads import share_cpus
from gpu.graphs import cpu_step
from gpu.graphs.cpu_step import CpuStepRunner
from gpu.graphs.runner import GraphBuckets, GraphRunner
from gpu.model_runner import ModelRunner
from gpu.models.llama import LlamaModel
from gpu.step_inputs import NextTokens, StepInputs
from gpu.tokenizer import Tokenizer
from kernel import registry
from kernel.config import Config, ConfigError
from kernel.model_build import build_model
from kernel.numerics_choice import resolve_kv_dtype
from kernel.parallel.host_shards import RankCopies, RankStateBytes, SharedHost, share_host_pool
from kernel.parallel.workers import Setup, TensorParallelRunner, Workers
from kernel.scheduling import decode_runs
from kernel.scheduling.overlap import resolve_overlap
from kernel.scheduling.prefix_reuse import PrefixReuse
from kernel.scheduling.scheduler import Scheduler
from kernel.speculative.draft_build import build_draft
from kernel.speculative.draft_model import ModelDrafter
from kernel.speculative.speculator import Speculator
from kernel.states.hybrid_state import HybridState
from kernel.tiers.host_tier import HostTier
from kernel.tiers.storage_io import StateBytes
from kernel.tiers.storage_tier import StorageTier
from kernel.tiers.tier_policy import PrefetchPolicy

log = structlog.get_logger("tierserve")


class Components(NamedTuple):
    runner: ModelRunner
    scheduler: Scheduler
    tokenizer: Tokenizer | None
    num_pages: int
    context_length: int
    model_name: str
    overlap: bool = False  # scheduler.overlap resolved (kernel/scheduling/overlap.py)


def pick_device(config: Config) -> torch.device:
    if config.model.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.model.device)


def build_components(
    config: Config, device: torch.device, rank_cpus: list[tuple[int, ...]] | None = None,
    post_on_device: Callable[[Callable[[], None]], None] | None = None,
) -> Components:
    """rank_cpus: with parallel.tp_size > 1, each rank's cores (gpu/cpu_threads.py `share_cpus`);
    post_on_device: queue a call on the device thread (tensor parallelism's host copies)."""
    # The storage backend first: a missing extra (`hicache.storage: redis` without
    # tierserve[redis]) or an unusable storage_dir fails the start before the weights load.
    backend = _storage_backend(config)
    workers = None
    try:
        if config.parallel.tp_size > 1:
            workers = Workers.start(config, rank_cpus or share_cpus(config.parallel.tp_size,
                                                                     config.parallel.cpus_per_rank))
        return _build_components(config, device, backend, workers, post_on_device or _no_device_thread)
    except BaseException:
        if backend is not None:
            backend.close()
        if workers is not None:
            workers.kill()
        raise


def _no_device_thread(fn: Callable[[], None]) -> None:
    raise RuntimeError("tensor-parallel host copies need build_components(post_on_device=...)")


def _build_components(
    config: Config, device: torch.device, backend: StorageBackend | None, workers: Workers | None,
    post_on_device: Callable[[Callable[[], None]], None],
) -> Components:
    if config.graphs.mode == "cuda" and (device.type != "cuda" or not torch.cuda.is_available()):
        raise ConfigError(
            f"graphs.mode: cuda needs a CUDA device, and the model runs on {device.type} "
            "(no CUDA here); use graphs.mode: emulate (static shapes on CPU) or off"
        )
    built = build_model(config, device, fingerprint=config.hicache.storage != "none")
    model, arch, tokenizer, dtype, cpu_kernels = built.model, built.arch, built.tokenizer, built.dtype, built.cpu_kernels
    context = min(config.model.context_length or arch.max_position_embeddings, arch.max_position_embeddings)
    page_size = config.cache.page_size
    kv_layers = getattr(model, "num_kv_layers", arch.num_layers)  # hybrids: attention layers only
    # Deterministic mode needs batch-invariant attention too, whatever backend is named.
    attention_name = "deterministic" if config.deterministic else attention_backend(config.model.attention, device)
    dense_llama = isinstance(model, LlamaModel) and not arch.sparse_layers and kv_layers == arch.num_layers
    kv_dtype = resolve_kv_dtype(config, dtype, device, cpu_kernels, attention_name, dense_llama)
    log.info("kv_dtype", dtype=str(kv_dtype).removeprefix("torch."), setting=config.cache.kv_dtype)
    num_pages = _size_pool(config, kv_layers, arch.num_kv_heads, arch.head_dim, kv_dtype, device)
    pool = KVPool(kv_layers, num_pages, page_size, arch.num_kv_heads, arch.head_dim, kv_dtype, device, dtype)
    max_ctx_padded = pages_for(context, page_size) * page_size
    table = ReqToTokenTable(config.scheduler.max_running_requests + 1, max_ctx_padded, device,
                            scratch_rows=_tree_rows(config))
    if config.deterministic and paged_decode.kernel_ready(cpu_kernels, pool):
        # NOTE: invariant 7 on CPU: every token through the C++ paged kernel, batch-invariant
        # and the same arithmetic for prefill and decode (gpu/attention/deterministic_paged.py).
        attention_name = "deterministic_paged"
    attention = registry.lookup("attention", attention_name)(pool, table.table, cpu_kernels=cpu_kernels)
    policy = registry.lookup("schedule", config.scheduler.policy)(
        lpm_fallback_queue=config.scheduler.lpm_fallback_queue
    )
    allocator = PageAllocator(num_pages)
    states = _state_pool(config, model, dtype, device)
    host_pool, shared_host = _host_pool(config, pool, num_pages, states if backend is not None else None)
    cache: PrefixCache
    if config.cache.prefix == "radix":
        evict = registry.lookup("evict", config.cache.evict_policy)()
        free_states = _free_slots(states) if states is not None else None
        cache = RadixTree(
            page_size, allocator.free, evict, strict_events=config.debug.check_invariants, free_states=free_states,
            free_host_pages=host_pool.free if host_pool is not None else None,
        )
    else:
        cache = NoPrefixCache(page_size)
    hybrid = None
    if states is not None:
        strategy = registry.lookup("state_strategy", config.cache.state_strategy)()
        hybrid = HybridState(
            states, strategy, config.cache.state_track_interval, checkpoints=cache.reuses,
            evict_states=cache.evict_states,
        )
    prefix = PrefixReuse(cache, allocator, table, hybrid=states is not None)
    if host_pool is not None:
        prefix.host = _host_tier(config, cache, pool, host_pool, allocator, table, device)
        state_bytes = None
        if shared_host is not None:
            assert workers is not None
            prefix.host.ranks = ranks = RankCopies(shared_host.done, workers.check, lambda: workers.stopped,
                                                   workers.send, post_on_device, config.parallel.timeout_s)
            if states is not None and shared_host.state_mirrors:
                state_bytes = RankStateBytes(states, shared_host.state_mirrors, ranks)
        if backend is not None:
            prefix.host.storage = _storage_tier(
                config, backend, cache, pool, host_pool, prefix.host.prefetch, built.model_id, states, state_bytes
            )
            if hybrid is not None:
                prefix.host.state_pending = lambda slot: any(dst == slot for _, dst in hybrid.copies)
    overlap = resolve_overlap(config.scheduler.overlap, device, hybrid=states is not None,
                              speculative=config.speculative.enabled)
    if workers is not None:
        # Tensor parallelism: `auto` leaves overlap off (on: rank 0 broadcasts each step's
        # tokens, kernel/parallel/workers.py); not yet measured on a multi-GPU machine.
        overlap = overlap and config.scheduler.overlap == "on"
        # NOTE: every rank's pools get rank 0's page count and table shape: one allocator,
        # one tree, the same page and slot ids everywhere.
        workers.set_up(Setup(num_pages, table.num_rows, table.max_context, table.num_scratch,
                             str(kv_dtype).removeprefix("torch."), attention_name,
                             states.num_slots if states is not None else 0,
                             shared_host.share if shared_host is not None else None, overlap))
        if shared_host is not None:
            shared_host.close()  # every worker mapped its host pages
        tp_runner = TensorParallelRunner(model, pool, attention, states, cpu_kernels=cpu_kernels)
        tp_runner.attach(workers, table)
        runner: ModelRunner = tp_runner
    else:
        runner = ModelRunner(model, pool, attention, states, cpu_kernels=cpu_kernels)
    log.info("overlap_scheduling", on=overlap, setting=config.scheduler.overlap, hybrid=states is not None)
    runner.inputs = step_inputs(device, table.table.shape[0], overlap)
    runner.graphs = build_graph_runner(config, model, attention, states, device)
    speculator = _speculator(config, states is not None, runner.graphs.decode_rows if runner.graphs else None, cache)
    if speculator is not None and isinstance(speculator.drafter, ModelDrafter):
        graph_mode = runner.graphs.mode if isinstance(runner.graphs, GraphRunner) else None
        speculator.drafter.attach(build_draft(config, device, built, context, num_pages, table, attention_name,
                                              graph_buckets(config), graph_mode), page_size, table.num_rows)
    if runner.graphs is not None:
        runner.graphs.inputs = runner.inputs
    return Components(
        runner=runner,
        scheduler=Scheduler(
            config.scheduler,
            page_size,
            allocator,
            table,
            policy,
            eos_ids=tokenizer.eos_token_ids if tokenizer is not None else frozenset(),
            max_context=context,
            prefix=prefix,
            hybrid=hybrid,
            speculator=speculator,
            runs=decode_runs.resolve(config.scheduler.decode_steps, runner.graphs, overlap),
        ),
        tokenizer=tokenizer,
        num_pages=num_pages,
        context_length=context,
        model_name=config.model.served_name or os.path.basename(config.model.path.rstrip("/")),
        overlap=overlap,
    )


def _speculator(config: Config, hybrid: bool, graph_rows: int | None, cache: PrefixCache) -> Speculator | None:
    """speculative.method resolved: its drafter. With a graph runner (or native CPU steps)
    a dense model's drafts stop at its largest decode bucket: a verify step then replays
    (or runs natively) as plain decode steps do. A hybrid model's verify step is a chunk
    (eager either way: its positions are all sampled), so nothing caps it there."""
    spec = config.speculative
    if not spec.enabled:
        return None
    log.info("speculative_on", method=spec.method, num_draft_tokens=spec.num_draft_tokens,
             max_batch=spec.max_batch)
    return Speculator(spec, row_limit=None if hybrid else graph_rows, cache=cache)


def _tree_rows(config: Config) -> int:
    """Scratch table rows for token trees' side nodes (kernel/speculative/tree.py): at most
    (topk - 1) per drafted position of each request drafting in a step."""
    spec = config.speculative
    if not spec.enabled or spec.topk == 1:
        return 0
    return (spec.topk - 1) * spec.num_draft_tokens * min(spec.max_batch, config.scheduler.max_running_requests)


def step_inputs(device: torch.device, num_rows: int, overlap: bool) -> StepInputs:
    """Index tensors of each step, with the per-row next-token tensor when overlap
    scheduling is on (copies to a CUDA device never block: gpu/upload.py)."""
    return StepInputs(device, NextTokens(num_rows, device) if overlap else None)


def attention_backend(name: str, device: torch.device) -> str:
    """model.attention resolved: `auto` is triton on CUDA (where triton imports), else torch."""
    if name != "auto":
        return name
    return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") is not None else "torch"


def build_graph_runner(
    config: Config, model: Any, attention: AttentionBackend, states: StatePool | None, device: torch.device
) -> GraphRunner | CpuStepRunner | None:
    """graphs.mode resolved (auto: cuda where it can run, cpu where the model has a native
    decode step, else off), buckets capped by the scheduler's limits, every bucket captured
    (or, emulated, warmed up) now."""
    mode, name = config.graphs.mode, type(attention).__name__
    if mode in ("cuda", "emulate") and not attention.supports_static:
        raise ConfigError(f"graphs.mode: {mode} needs an attention backend with static-shape metadata "
                          f"(deterministic, triton); {name} has none")
    if mode in ("cuda", "emulate") and not getattr(model, "static_shapes", True):
        raise ConfigError(f"graphs.mode: {mode} needs static shapes, and this model's MoE implementation reads "
                          "routing results on the host; use model.moe: dense (static shapes) or graphs.mode: off")
    buckets = graph_buckets(config)
    if config.parallel.tp_size > 1 and mode == "auto":
        # NOTE: every rank runs this with the same config (kernel/parallel/worker.py), so
        # all ranks hold the same buckets. The native CPU step has no collectives, and
        # CUDA capture of the all-reduce is opted into (`cuda`), not picked by `auto`.
        log.info("graphs_off", reason="tensor parallelism: graphs.mode emulate or cuda turn them on")
        return None
    if mode in ("auto", "cpu") and device.type == "cpu":
        why = cpu_step.unsupported(model, attention)
        if why is None:
            return CpuStepRunner(model, attention, buckets.decode)
        if mode == "cpu":
            raise ConfigError(f"graphs.mode: cpu {why}")
        log.info("cpu_step_off", reason=why)
    if mode == "cpu":
        raise ConfigError(f"graphs.mode: cpu runs on a CPU device, and the model runs on {device.type}")
    if mode == "auto":  # hybrid models too: they capture their decode and verify buckets
        static = attention.supports_static and getattr(model, "static_shapes", True)
        mode = "cuda" if device.type == "cuda" and static else "off"
    if mode == "off":
        return None
    runner = GraphRunner(
        model, attention, states, mode,
        decode_buckets=buckets.decode,
        prefill_tokens=buckets.prefill_tokens,
        prefill_max_requests=buckets.prefill_max_requests,
        verify_tokens=_verify_tokens(config, buckets.decode) if states is not None else (),
        verify_span=_verify_span(config),
    )
    runner.capture()
    return runner


def graph_buckets(config: Config) -> GraphBuckets:
    """graphs.* bucket sizes capped by the scheduler's limits (the target's runner and the draft's)."""
    graphs, sched = config.graphs, config.scheduler
    return GraphBuckets(
        decode=[b for b in graphs.decode_buckets if b <= sched.max_running_requests],
        prefill_tokens=[t for t in graphs.prefill_tokens if t <= sched.max_num_batched_tokens],
        prefill_max_requests=min(graphs.prefill_max_requests, sched.max_running_requests),
    )


def _verify_tokens(config: Config, decode_buckets: list[int]) -> list[int]:
    """A hybrid model's verify buckets (speculative decoding): per decode bucket of at most
    speculative.max_batch requests, room for each to verify its deepest draft, and a
    token tree's side nodes and their branches' rerun tokens (kernel/speculative/tree.py)
    — capped by the step's token budget."""
    spec = config.speculative
    if not spec.enabled:
        return []
    budget = config.scheduler.max_num_batched_tokens
    per_request = 1 + spec.num_draft_tokens * (2 * spec.topk - 1)
    return sorted({min(b * per_request, budget) for b in decode_buckets if b <= spec.max_batch})


def _verify_span(config: Config) -> int:
    """The most tokens one chunk of a verify step brings: the input token and the deepest
    draft (a side branch's chunk reruns the main-chain tokens before its fork: no longer)."""
    return 1 + config.speculative.num_draft_tokens


def _state_pool(config: Config, model: Any, dtype: torch.dtype, device: torch.device) -> StatePool | None:
    """Hybrid models (those with recurrent state layers) get a state pool; dense ones None.
    Without cache.state_slots: three slots per running request (the live one, a second
    for the two-slot strategies, room for cached states), plus the reserved slot 0."""
    if not hasattr(model, "state_shapes"):
        return None
    config.cache.check_state_grid(config.scheduler.chunked_prefill_size)
    num = config.cache.state_slots or 3 * config.scheduler.max_running_requests + 1
    pool = StatePool(model.state_shapes(), num, dtype, device)
    log.info("state_pool_sized", slots=num, bytes_per_slot=pool.bytes_per_slot)
    return pool


def _host_pool(
    config: Config, pool: KVPool, num_pages: int, states: StatePool | None
) -> tuple[HostPool | None, SharedHost | None]:
    """The host tier's pages (hicache.host_pages, or host_ratio x the device pool); with
    tensor parallelism every rank's, the workers' in shared memory. Hybrid models need
    nothing more: their state slots stay in the state pool, also for prefixes whose pages
    went to host (cache/radix_host.py)."""
    hc = config.hicache
    if not hc.enabled:
        return None, None
    if config.cache.prefix != "radix":
        raise ConfigError("hicache needs cache.prefix: radix (the tiers hold the radix tree's pages)")
    pages = hc.host_pages or max(2, int(hc.host_ratio * num_pages))
    shared = None
    if config.parallel.tp_size > 1:
        # `states`: a hybrid model with storage, which reads every rank's part of a state slot.
        shared = share_host_pool(pool, pages, hc.host_layout, config.parallel.tp_size, states)  # type: ignore[arg-type]
        host: HostPool = shared.pool
    else:
        host = HostPool.like(pool, pages, layout=hc.host_layout)  # type: ignore[arg-type]
    log.info("host_pool_sized", pages=pages, bytes_per_page=host.bytes_per_page, pinned=host.pinned)
    return host, shared


def _host_tier(
    config: Config, cache: PrefixCache, pool: KVPool, host_pool: HostPool, allocator: PageAllocator,
    table: ReqToTokenTable, device: torch.device,
) -> HostTier:
    hc = config.hicache
    policy_args = dataclasses.asdict(hc)
    write = registry.lookup("tier_write", hc.write_policy)(**policy_args)
    prefetch = registry.lookup("tier_prefetch", hc.prefetch_policy)(**policy_args)
    # On CUDA the copy worker owns a copy stream: copies never queue behind forwards.
    streams = (lambda: torch.cuda.Stream(device)) if device.type == "cuda" else None
    worker = CopyWorker(stream_factory=streams)
    return HostTier(cache, pool, host_pool, worker, write, prefetch, allocator, table, hc.write_back_headroom)


def _storage_backend(config: Config) -> StorageBackend | None:
    """The backend named by hicache.storage (None for `none`; validation has made sure a
    host tier is there for it)."""
    hc = config.hicache
    if hc.storage == "none":
        return None
    backend: StorageBackend = registry.lookup("storage", hc.storage).from_options(dataclasses.asdict(hc))
    return backend


def _storage_tier(
    config: Config, backend: StorageBackend, cache: PrefixCache, pool: KVPool, host_pool: HostPool,
    prefetch: PrefetchPolicy, model_id: str, states: StatePool | None, state_bytes: StateBytes | None,
) -> StorageTier:
    """The storage tier over `backend`, below the host tier, and the page format its keys name."""
    hc = config.hicache
    options = dataclasses.asdict(hc)
    tp = config.parallel.tp_size
    fmt = PageFormat(
        # `page_bytes` order, whatever the host layout (cache/host_pool.py). NOTE: with tensor
        # parallelism a page is every rank's shard, rank order (kernel/parallel/host_shards.py):
        # the layout names tp_size, so a server with another tp_size never reads it (a miss).
        model_id=model_id, layout="kv_page_c_order" + (f".tp{tp}" if tp > 1 else ""), dtype=str(pool.k[0].dtype).removeprefix("torch."),
        page_size=pool.page_size, num_kv_layers=len(pool.k), kv_heads=pool.k[0].shape[1], head_dim=pool.k[0].shape[2],
    )
    log.info("storage_tier", backend=hc.storage, model_id=model_id, stats=backend.stats())
    grid = config.cache.state_track_interval // config.cache.page_size if states is not None else 1
    return StorageTier(backend, fmt, cache, host_pool, prefetch, options, states, grid, state_bytes)


def _free_slots(states: StatePool) -> Callable[[list[int]], None]:
    def free(slots: list[int]) -> None:
        for slot in slots:
            states.free(slot)

    return free


def _size_pool(
    config: Config, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> int:
    """cache.num_pages if set, else memory_fraction of free memory, capped at max_pages."""
    if config.cache.num_pages is not None:
        return config.cache.num_pages
    per_page = KVPool.bytes_per_page(layers, config.cache.page_size, kv_heads, head_dim, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    pages = int(free * config.cache.memory_fraction) // per_page
    num = max(2, min(pages, config.cache.max_pages))
    log.info("kv_pool_sized", pages=num, bytes_per_page=per_page, free_bytes=free)
    return num
