"""The graph runner: static-shape forwards per bucket, replayed as CUDA graphs or emulated.

Decode graphs are captured per batch-size bucket (one token per request), prefill graphs
per token-count bucket with a fixed number of request slots (`prefill_max_requests`
live ones plus one padding request that takes the padding tokens). Verify graphs (a
hybrid model's speculative verify steps: chunks whose every position is sampled,
`sample_back`) per token-count bucket with a request slot and a logits row per token. A
batch runs in the smallest bucket that holds it; one that fits none runs eagerly
(`bucket_for` -> None).

Mode `cuda` captures every bucket once, largest first, into one shared memory pool and
replays it (for hybrid models the decode and verify buckets: their prefill buckets branch
on each request's length, gpu/graphs/control.py; a verify bucket's lengths are a
registered buffer, read by the state layers' static forms); mode `emulate` runs the model on
the very same static buffers instead of replaying, so CPU CI exercises the buckets, the
padding and the registry. Either way a replay is: stage the batch (the registry copies
the live rows of every buffer and resets rows [live:bucket) of every buffer), check that
its host-side control is the capture's (gpu/graphs/control.py), then run.

NOTE: invariants 5 and 6. What the model reads comes only from views of registered
buffers: the capture checks (1) that every ForwardBatch field is either mapped to
registered buffers or named as host-side (used before or after the graph), and (2) that
every tensor handed to the model path - its inputs, the attention backend's metadata
attributes, the hybrid step's slot tensors - is a view of a registered buffer. Capture
batches are `ForwardBatch.build` of padding requests, staged by the same code as live
batches.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Any, NamedTuple

import structlog
import torch

from cache.state_pool import StatePool
from gpu.attention.base import AttentionBackend
from gpu.forward_batch import ForwardBatch, PrefillChunk, SamplingRow
from gpu.graphs.control import check_control, control_of
from gpu.graphs.static_buffers import BufferSpec, StaticBufferError, StaticBuffers
from gpu.models.hybrid_step import HybridStep
from gpu.step_inputs import StepInputs, flat_inputs
from gpu.upload import to_device

log = structlog.get_logger("tierserve")

ATTN = "attention."  # prefix of the attention backend's buffers in the registry

# Which registered buffers each ForwardBatch field lands in ("attention.*": the
# backend's metadata); hybrid-only buffers are checked only for hybrid models.
BATCH_FIELDS: dict[str, tuple[str, ...]] = {
    "input_ids": ("input_ids",),
    "placeholders": ("input_ids",),  # resolved into input_ids before the copy (gpu/step_inputs.py)
    "rows": (ATTN + "*",),
    "prefix_lens": ("positions", ATTN + "*"),
    "extend_lens": ("positions", ATTN + "*"),
    "sample_rows": ("sample_index",),
    "state_src": ("state_src", "fresh"),
    "state_dst": ("state_dst",),
    "state_track": ("track_slots", "track_mask"),
    "sample_back": ("sample_index",),  # verify buckets (bucket_for)
}
HYBRID_ONLY = frozenset({"state_src", "state_dst", "state_track"})
# Fields used outside the graph: sampling reads the graph's logits, copies run before it.
# Batches with prompt logprobs run eagerly (ModelRunner.run), never in a graph; decode runs
# (steps > 1) only on the native CPU step (ModelRunner.run_sampling refuses them elsewhere).
HOST_SIDE = frozenset({"sampling", "state_copies", "prompt_logprobs", "steps", "run_stops"})

_MODEL_INPUTS = {
    "input_ids": BufferSpec("tokens", (), torch.int64, 0),  # token 0
    "positions": BufferSpec("tokens", (), torch.int64, 0),
    "sample_index": BufferSpec("samples", (), torch.int64, 0),  # logits of token 0, dropped
}
_STATE_INPUTS = {
    "state_src": BufferSpec("requests", (), torch.int64, 0),  # the reserved state slot
    "state_dst": BufferSpec("requests", (), torch.int64, 0),
    "fresh": BufferSpec("requests", (), torch.bool, True),  # padding starts from the zero state
    "track_slots": BufferSpec("tracks", (), torch.int64, 0),
    "track_mask": BufferSpec("tracks", (), torch.bool, False),
}


class GraphBuckets(NamedTuple):
    """A runner's bucket sizes, already capped by the scheduler's limits."""

    decode: list[int]
    prefill_tokens: list[int]
    prefill_max_requests: int


class Bucket(NamedTuple):
    kind: str  # "decode" | "prefill" | "verify"
    tokens: int
    requests: int


@dataclasses.dataclass
class Graph:
    """One bucket: its row counts per unit, and on CUDA the captured graph and its output."""

    bucket: Bucket
    rows: dict[str, int]
    cuda_graph: Any = None
    logits: torch.Tensor | None = None
    control: dict[str, Any] = dataclasses.field(default_factory=dict)  # host values of the capture
    # A MoE model's chosen experts per sparse layer, as its last forward left them (on CUDA the
    # captured outputs): replays count their live rows only.
    routes: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)


class GraphRunner:
    """Owned by the device thread, beside the ModelRunner (which asks `bucket_for`)."""

    def __init__(
        self, model: Any, attention: AttentionBackend, states: StatePool | None, mode: str,
        decode_buckets: Sequence[int], prefill_tokens: Sequence[int], prefill_max_requests: int,
        verify_tokens: Sequence[int] = (), verify_span: int = 0,
    ) -> None:
        if mode not in ("cuda", "emulate"):
            raise ValueError(f"graph runner mode must be cuda or emulate, got {mode!r}")
        if not attention.supports_static:
            raise ValueError(f"attention backend {type(attention).__name__} has no static-shape metadata")
        self.model, self.attention, self.states, self.mode = model, attention, states, mode
        self.device: torch.device = model.device
        slots = prefill_max_requests + 1  # + the padding request
        if mode == "cuda" and states is not None and prefill_tokens:
            # A hybrid prefill's state layers branch on each request's length (chunked
            # form, tracked points); its decode and verify steps are a function of the bucket.
            log.info("graphs_hybrid_no_prefill", skipped_prefill_buckets=list(prefill_tokens))
            prefill_tokens = ()
        self.graphs: dict[str, list[Graph]] = {
            "decode": [self._graph(Bucket("decode", b, b)) for b in sorted(set(decode_buckets))],
            "prefill": [self._graph(Bucket("prefill", t, slots)) for t in sorted(set(prefill_tokens))],
            "verify": [self._graph(Bucket("verify", t, t)) for t in sorted(set(verify_tokens))],
        }
        self.prefill_max_requests = prefill_max_requests
        # Verify buckets: the most tokens one request brings (its slot's static steps).
        self.verify_span = verify_span
        if self.graphs["verify"] and (states is None or verify_span < 1):
            raise ValueError("verify buckets are for a hybrid model's verify steps, with a span of >= 1 token")
        self.buffers = {kind: self._registry(graphs) for kind, graphs in self.graphs.items() if graphs}
        self._pool: Any = None
        self._stream: Any = None
        self._views: dict[str, torch.Tensor] = {}  # what the last staged batch left
        self.replays: Counter[Bucket] = Counter()  # per bucket: how many steps ran in it
        self.inputs: StepInputs | None = None  # the model runner's (shared by the builder)

    def _graph(self, bucket: Bucket) -> Graph:
        rows = {"tokens": bucket.tokens, "requests": bucket.requests}
        rows["tracks"] = 1 if bucket.kind == "decode" else bucket.tokens  # decode never tracks
        rows["samples"] = bucket.tokens if bucket.kind == "verify" else bucket.requests  # logits rows
        rows.update(self.attention.static_rows(bucket.tokens, bucket.requests))
        return Graph(bucket, rows)

    def _registry(self, graphs: list[Graph]) -> StaticBuffers:
        """One set of buffers per kind, sized for its largest bucket (smaller ones read views)."""
        largest = graphs[-1].rows
        buffers = StaticBuffers(largest, self.device)
        specs = dict(_MODEL_INPUTS)
        specs.update({ATTN + k: v for k, v in self.attention.static_specs().items()})
        if self.states is not None:
            specs.update(_STATE_INPUTS)
        if graphs[0].bucket.kind == "verify":
            specs["extend_lens"] = BufferSpec("requests", (), torch.int64, 0)  # padding requests: none
        for name, spec in specs.items():
            buffers.register(name, spec)
        return buffers

    # ---- capture -------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Check the batch -> buffer mapping, then warm up (and on CUDA capture) every
        bucket, largest first, from a capture batch of padding requests."""
        if self.mode == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        for kind, graphs in self.graphs.items():
            if graphs:
                self.check_mapping(self.buffers[kind])
            for graph in reversed(graphs):
                self._capture_one(graph)
        log.info("graphs_captured", mode=self.mode, **{k: [g.bucket.tokens for g in v] for k, v in self.graphs.items()})

    def check_mapping(self, buffers: StaticBuffers) -> None:
        """Every ForwardBatch field lands in registered buffers or is host-side."""
        for f in dataclasses.fields(ForwardBatch):
            if f.name in HOST_SIDE:
                continue
            if f.name not in BATCH_FIELDS:
                raise StaticBufferError(f"ForwardBatch.{f.name} is read by no registered static buffer")
            if f.name in HYBRID_ONLY and self.states is None:
                continue
            for name in BATCH_FIELDS[f.name]:
                found = any(n.startswith(ATTN) for n in buffers.specs) if name.endswith("*") else name in buffers.specs
                if not found:
                    raise StaticBufferError(f"ForwardBatch.{f.name} lands in unregistered static buffer {name!r}")

    def _capture_one(self, graph: Graph) -> None:
        batch = capture_batch(graph.bucket, self.verify_span)
        step = self._stage(graph, batch)
        self.check_reads(self.buffers[graph.bucket.kind], step)
        graph.control = control_of(self.attention, step, graph.bucket.kind)
        if self.mode == "emulate":
            self._model_forward(graph, step)  # the warm-up: the capture path runs at start-up
            return
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for _ in range(2):  # warm-up outside the graph (lazy inits, allocator)
                self._model_forward(graph, step)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        cuda_graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA call during capture (the readback or copy
        # worker threads) is not an error of this capture; this thread's syncs still are.
        with torch.cuda.graph(cuda_graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
            graph.logits = self._model_forward(graph, step)
        graph.cuda_graph = cuda_graph

    def check_reads(self, buffers: StaticBuffers, step: HybridStep | None) -> None:
        """Every tensor the model path reads per step is a view of a registered buffer."""
        reads = {ATTN + k: v for k, v in self.attention.metadata_tensors().items()}
        if step is not None:
            reads.update({
                "step.src_slots": step.src_slots, "step.dst_slots": step.dst_slots, "step.fresh": step.fresh,
                "step.track_slots": step.track_slots,
            })
            if step.static_lens is not None:
                reads["step.static_lens"] = step.static_lens
        for name, tensor in reads.items():
            if not buffers.owns(tensor):
                raise StaticBufferError(f"the captured forward reads {name}, which is not a registered static buffer")

    # ---- replay --------------------------------------------------------------------
    @property
    def decode_rows(self) -> int:
        """The most decode rows a step may have and still replay a bucket."""
        decode = self.graphs["decode"]
        return decode[-1].bucket.requests if decode else 0

    def bucket_for(self, batch: ForwardBatch) -> Graph | None:
        """The smallest bucket that holds the batch, or None (run it eagerly)."""
        num_reqs, num_tokens = len(batch.rows), len(batch.input_ids)
        if batch.sample_back:  # more logits rows than request slots: a verify bucket's
            if max(batch.extend_lens) > self.verify_span:
                return None
            return next((g for g in self.graphs["verify"] if g.bucket.tokens >= num_tokens), None)
        if all(n == 1 for n in batch.extend_lens):
            for graph in self.graphs["decode"]:
                if graph.bucket.requests >= num_reqs:
                    return graph
        if num_reqs <= self.prefill_max_requests:
            for graph in self.graphs["prefill"]:
                if graph.bucket.tokens >= num_tokens:
                    return graph
        return None

    def replay(self, graph: Graph, batch: ForwardBatch) -> torch.Tensor:
        """Logits of the batch's sampling rows, from the bucket's static-shape forward."""
        step = self._stage(graph, batch)
        check_control(control_of(self.attention, step, graph.bucket.kind), graph.control, graph.bucket)
        self.replays[graph.bucket] += 1
        if self.mode == "emulate":
            logits = self._model_forward(graph, step)
        else:
            graph.cuda_graph.replay()
            assert graph.logits is not None
            logits = graph.logits
        if graph.routes:
            self.model.moe.count(graph.routes, len(batch.input_ids))
        return logits[: len(batch.sample_rows)]

    def _stage(self, graph: Graph, batch: ForwardBatch) -> HybridStep | None:
        """Copy the batch into the bucket's buffers (tails reset by the registry), point
        the attention backend at the views, build the hybrid step over them."""
        verify = graph.bucket.kind == "verify"
        views = self.buffers[graph.bucket.kind].stage(self._live(batch, graph.bucket if verify else None), graph.rows)
        self._views = views
        self.attention.bind_static({k[len(ATTN):]: v for k, v in views.items() if k.startswith(ATTN)})
        if self.states is None:
            return None
        extend = list(batch.extend_lens) + padding_lens(len(batch.rows), len(batch.input_ids), graph.bucket)
        prefix = list(batch.prefix_lens) + [0] * (len(extend) - len(batch.rows))
        track = list(batch.state_track) + [()] * (len(extend) - len(batch.rows)) if batch.state_track else ()
        return HybridStep(
            extend_lens=tuple(extend), prefix_lens=tuple(prefix), src_slots=views["state_src"],
            dst_slots=views["state_dst"], fresh=views["fresh"], track=() if verify else tuple(track),
            static_track=(views["track_slots"], views["track_mask"]),
            static_lens=views["extend_lens"] if verify else None, static_steps=self.verify_span if verify else 0,
        )

    def _live(self, batch: ForwardBatch, verify: Bucket | None = None) -> dict[str, torch.Tensor]:
        """The live rows of every registered buffer for this batch (`verify`: the verify
        bucket it runs in, whose track rows are one per token and whose lengths, padding
        requests' too, are a buffer: HybridStep.static_lens)."""
        dev = self.device
        input_ids, positions, last = self.inputs.build(batch) if self.inputs is not None else flat_inputs(batch, dev)
        live = {"input_ids": input_ids, "positions": positions, "sample_index": last}
        meta = self.attention.static_metadata(batch.rows, batch.prefix_lens, batch.extend_lens)
        live.update({ATTN + k: v for k, v in meta.items()})
        if self.states is not None:
            track = HybridStep.check(
                batch.extend_lens, batch.prefix_lens, batch.state_src, batch.state_dst, batch.state_track
            )
            slots = per_token_slots(batch, track) if verify is not None else [s for pairs in track for _, s in pairs]
            live.update({
                "state_src": to_device(batch.state_src, torch.int64, dev),
                "state_dst": to_device(batch.state_dst, torch.int64, dev),
                "fresh": to_device([p == 0 for p in batch.prefix_lens], torch.bool, dev),
                "track_slots": to_device(slots, torch.int64, dev),
                "track_mask": to_device([s != 0 for s in slots], torch.bool, dev),
            })
            if verify is not None:
                padding = padding_lens(len(batch.rows), len(batch.input_ids), verify)
                live["extend_lens"] = to_device(list(batch.extend_lens) + padding, torch.int64, dev)
        return live

    def _model_forward(self, graph: Graph, step: HybridStep | None) -> torch.Tensor:
        moe = getattr(self.model, "moe", None)
        if moe is None:
            return self._forward(step)
        with moe.deferred() as routes:  # the bucket's padding rows are routed too: counted by `replay`
            logits = self._forward(step)
        graph.routes = routes
        return logits

    def _forward(self, step: HybridStep | None) -> torch.Tensor:
        v = self._views
        if self.states is None:
            return self.model.forward(v["input_ids"], v["positions"], self.attention, v["sample_index"])  # type: ignore[no-any-return]
        return self.model.forward(  # type: ignore[no-any-return]
            v["input_ids"], v["positions"], self.attention, v["sample_index"], step, self.states
        )


def padding_lens(live_reqs: int, live_tokens: int, bucket: Bucket) -> list[int]:
    """Tokens of each padding request: one each while there are enough, the rest in the
    last (prefill's padding request); decode buckets get exactly one per padding row."""
    k, p = bucket.requests - live_reqs, bucket.tokens - live_tokens
    if p < 0 or k < 0 or (k == 0 and p > 0):
        raise StaticBufferError(f"{live_reqs} requests / {live_tokens} tokens do not fit bucket {bucket}")
    ones = min(p, k)
    lens = [1] * ones + [0] * (k - ones)
    if k:
        lens[-1] += p - ones
    return lens


def per_token_slots(batch: ForwardBatch, track: Sequence[Sequence[tuple[int, int]]]) -> list[int]:
    """A verify bucket's track rows: per token of the batch, the slot the state after it
    goes to (0: none; a request's last token's goes to its dst slot instead)."""
    slots = [0] * len(batch.input_ids)
    start = 0
    for prefix, extend, pairs in zip(batch.prefix_lens, batch.extend_lens, track or [()] * len(batch.rows)):
        for end, slot in pairs:
            slots[start + end - prefix - 1] = slot
        start += extend
    return slots


def capture_batch(bucket: Bucket, span: int = 0) -> ForwardBatch:
    """The capture / warm-up batch of a bucket: padding requests built like live batches,
    every one sampling (as many as the bucket's live requests can be); a verify bucket's,
    padding requests of `span` tokens (the last one the rest) sampling at every position,
    as verify chunks do."""
    greedy = SamplingRow(0.0, 1.0, -1, 0.0, 0.0, 0.0, 1.0, 0, 0, 0)
    if bucket.kind == "verify":
        lens = [span] * (bucket.tokens // span) + ([bucket.tokens % span] if bucket.tokens % span else [])
        chunks = [PrefillChunk.padding(n) for n in lens]
        sampling = [(i, greedy) for i, n in enumerate(lens) for _ in range(n)]
        back = tuple(n - 1 - j for n in lens for j in range(n))
        return ForwardBatch.build(chunks, sampling, (), (), back)
    live = bucket.requests if bucket.kind == "decode" else bucket.requests - 1
    live = min(live, bucket.tokens)
    lens = [1] * (live - 1) + [bucket.tokens - (live - 1)]
    chunks = [PrefillChunk.padding(n) for n in lens]
    return ForwardBatch.build(chunks, [(i, greedy) for i in range(len(chunks))], ())
