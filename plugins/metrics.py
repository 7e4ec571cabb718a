"""Prometheus metrics at `GET /metrics`, from one `CollectorRegistry` per engine.

Token and cache counters, queue lengths, pool usage and engine health
(`tierserve_engine_healthy`) are read from `engine.stats()` at scrape time (a custom
collector), so they are exact and cost nothing between scrapes.
Latency histograms and the per-finish-reason request counter are fed by the engine's
lifecycle events. Prefix-cache counters are in tokens with a `tier` label (only
`device` so far): rates and hit ratios are the reader's to compute, per the
architecture page, instead of a gauge each batch overwrites.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from kernel.async_engine import AsyncEngine
from kernel.results.events import LifecycleEvent

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
# Listed up front so rate() over them works before the first such finish.
FINISH_REASONS = ("stop", "length", "abort", "error")


def add_metrics_route(app: web.Application, engine: AsyncEngine) -> None:
    """Mount `GET /metrics` for `engine`; the event subscription ends with the app."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    tracker = RequestTracker(registry)
    unsubscribe = engine.events.subscribe(tracker.observe)

    async def metrics(request: web.Request) -> web.Response:
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encode(registry), headers={"Content-Type": content_type})

    async def stop_tracking(app: web.Application) -> None:
        unsubscribe()

    app.router.add_get("/metrics", metrics)
    app.on_cleanup.append(stop_tracking)


class EngineCollector(Collector):
    """Reads `engine.stats()` once per scrape: the engine does the accounting."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterable[Metric]:
        stats = self.engine.stats()
        yield from counters(stats)
        yield from gauges(stats)


def counters(stats: dict[str, Any]) -> Iterable[Metric]:
    tokens, cache = stats["counters"], stats["cache"]
    yield CounterMetricFamily(
        "tierserve_prompt_tokens", "Prompt tokens of accepted requests.", tokens["prompt_tokens"]
    )
    yield CounterMetricFamily("tierserve_generation_tokens", "Generated tokens.", tokens["generation_tokens"])
    yield tier_counter(
        "tierserve_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache.",
        cache["prefix_query_tokens"],
    )
    host, storage = stats["host"], stats["storage"]
    yield tier_counter(
        "tierserve_prefix_cache_hits_tokens", "Prompt tokens served from the prefix cache.",
        cache["prefix_hit_tokens"], host["host_hit_tokens"] if host is not None else None,
        storage["hit_tokens"] if storage is not None else None,
    )
    if host is not None:
        yield from host_tier_metrics(host)
    if storage is not None:
        yield from storage_tier_metrics(storage)
    yield CounterMetricFamily(
        "tierserve_prefix_cache_truncated_tokens",
        "Cached prompt tokens a hit could not use: no recurrent state at their end (hybrid models).",
        cache["prefix_truncated_tokens"],
    )
    spec = stats["speculative"]
    if spec is not None:
        yield from speculative_metrics(spec)
    if stats["audit"] is not None:
        yield from audit_metrics(stats["audit"])
    if stats.get("moe"):
        yield from moe_metrics(stats["moe"])
    yield CounterMetricFamily(
        "tierserve_retractions", "Running requests sent back to the queue for lack of pages.",
        stats["num_retractions"],
    )
    runs = stats.get("decode_runs")
    if runs is not None:  # scheduler.decode_steps: several greedy decode steps in one device call
        yield CounterMetricFamily("tierserve_decode_runs", "Decode runs: steps run back to back in one call.",
                                  runs["runs"])
        yield CounterMetricFamily("tierserve_decode_run_tokens", "Tokens that decode runs produced.",
                                  runs["tokens"])
    if stats.get("parallel"):
        yield from parallel_metrics(stats["parallel"])


# An expert's load: its share of the layer's routed tokens over the even share (1 = even).
EXPERT_LOAD_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.9, 1.1, 1.5, 2.0, 4.0, 8.0)


def moe_metrics(moe: dict[str, list[int]]) -> Iterable[Metric]:
    """Per sparse layer: tokens routed to each expert (a counter), and the experts' loads as
    a histogram (one observation per expert, relative to an even split), so routing skew
    reads as one heatmap row per layer: all experts near 1 is even; mass at 0 and far
    above 1 is a few experts taking most tokens."""
    routed = CounterMetricFamily("tierserve_moe_expert_tokens", "Tokens routed to each expert of each "
                                 "mixture-of-experts layer (routing skew).", labels=["layer", "expert"])
    load = HistogramMetricFamily("tierserve_moe_expert_load", "Each expert's share of its layer's routed tokens "
                                 "over an even share (1 = even), one observation per expert.", labels=["layer"])
    for layer, counts in moe.items():
        for expert, n in enumerate(counts):
            routed.add_metric([str(layer), str(expert)], n)
        loads = expert_loads(counts)
        buckets = [(str(le), sum(1 for x in loads if x <= le)) for le in EXPERT_LOAD_BUCKETS]
        load.add_metric([str(layer)], [*buckets, ("+Inf", len(loads))], sum(loads))
    yield routed
    yield load


def expert_loads(counts: list[int]) -> list[float]:
    """Each expert's tokens over the layer's mean per expert (all 0 before any token)."""
    total = sum(counts)
    return [n * len(counts) / total if total else 0.0 for n in counts]


def parallel_metrics(par: dict[str, Any]) -> Iterable[Metric]:
    """Tensor parallelism: each rank up or down and its pools' bytes; rank 0's collectives."""
    up = GaugeMetricFamily("tierserve_tp_rank_up", "1 while a tensor-parallel rank's process runs.", labels=["rank"])
    pools = GaugeMetricFamily("tierserve_tp_rank_pool_bytes", "A rank's pool bytes (its shard of every page "
                              "or state slot), in use or in all.", labels=["rank", "pool", "state"])
    for r in par["ranks"]:
        rank = str(r["rank"])
        up.add_metric([rank], 1 if r["alive"] else 0)
        for pool in ("kv", "host", "state"):
            for state in ("used", "total"):
                pools.add_metric([rank, pool, state], r[f"{pool}_bytes"][state])
    yield up
    yield pools
    c = par["collectives"]
    yield CounterMetricFamily("tierserve_tp_reduced_bytes", "Bytes rank 0 all-reduced.", c["reduced_bytes"])
    yield CounterMetricFamily("tierserve_tp_gathered_bytes", "Bytes of logits rank 0 contributed to gathers.",
                              c["gathered_bytes"])
    yield CounterMetricFamily("tierserve_tp_collective_seconds", "Seconds rank 0 spent in collectives.",
                              c["seconds"])


def speculative_metrics(spec: dict[str, Any]) -> Iterable[Metric]:
    """Drafted and accepted tokens and verify steps, per drafting method (accepted /
    verify steps + 1 is the mean accepted length per verify step), and the adaptive rule."""
    method = [spec["method"]]
    for name, key, doc in (
        ("tierserve_spec_drafted_tokens", "drafted_tokens", "Tokens proposed by the drafter and verified."),
        ("tierserve_spec_accepted_tokens", "accepted_tokens", "Drafted tokens the target accepted."),
        ("tierserve_spec_verify_steps", "verify_steps", "Request verify steps (a decode with drafts)."),
        ("tierserve_spec_paused_requests", "paused_requests",
         "Times the adaptive rule paused a request's drafting for low acceptance."),
        ("tierserve_spec_skipped_batches", "skipped_batches", "Steps with too many decodes to draft (max_batch)."),
        ("tierserve_spec_side_drafted_tokens", "side_drafted_tokens",
         "Token trees (speculative.topk > 1): drafted tokens off the main chain."),
        ("tierserve_spec_side_accepted_tokens", "side_accepted_tokens",
         "Token trees: accepted tokens off the main chain."),
    ):
        family = CounterMetricFamily(name, doc, labels=["method"])
        family.add_metric(method, spec[key])
        yield family
    resting = GaugeMetricFamily("tierserve_spec_resting_requests", "Requests whose drafting is paused now.",
                                labels=["method"])
    resting.add_metric(method, spec["resting_requests"])
    yield resting


def audit_metrics(audit: dict[str, Any]) -> Iterable[Metric]:
    """The online audit (kernel/audit.py): replays of served cache hits, per tier of the hit."""
    for name, key, doc in (
        ("tierserve_audit_checked", "checked", "Served cache hits replayed cold and compared."),
        ("tierserve_audit_mismatched", "mismatched", "Replays that did not match what was served."),
    ):
        family = CounterMetricFamily(name, doc, labels=["tier"])
        for tier, n in audit[key].items():
            family.add_metric([tier], n)
        yield family
    yield CounterMetricFamily("tierserve_audit_dropped", "Sampled hits not replayed: the audit queue was full.",
                              audit["dropped"])
    yield CounterMetricFamily("tierserve_audit_errors", "Replays that failed to run.", audit["errors"])


def gauges(stats: dict[str, Any]) -> Iterable[Metric]:
    pages, requests = stats["pages"], stats["requests"]
    yield GaugeMetricFamily(
        "tierserve_engine_healthy", "1 while the step loop runs, 0 once it has halted (see /health).",
        0 if stats["halt_reason"] is not None else 1,
    )
    yield GaugeMetricFamily("tierserve_running_requests", "Admitted requests.", requests["running"])
    states = stats["states"]
    if states is not None:
        yield GaugeMetricFamily("tierserve_state_slots_total", "Usable recurrent-state slots.", states["usable"])
        yield GaugeMetricFamily("tierserve_state_slots_cached", "State slots owned by the prefix cache.",
                                states["cached"])
    yield GaugeMetricFamily("tierserve_queued_requests", "Requests waiting for admission.", requests["waiting"])
    yield GaugeMetricFamily(
        "tierserve_kv_pages_used", "KV pages in use (by requests or the prefix cache).",
        pages["usable"] - pages["free"],
    )
    yield GaugeMetricFamily("tierserve_kv_pages_total", "Usable KV pages.", pages["usable"])
    yield GaugeMetricFamily("tierserve_kv_pages_cached", "KV pages owned by the prefix cache.", pages["cached"])


def tier_counter(
    name: str, doc: str, value: float, host: float | None = None, storage: float | None = None
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["tier"])
    family.add_metric(["device"], value)
    if host is not None:
        family.add_metric(["host"], host)
    if storage is not None:
        family.add_metric(["storage"], storage)
    return family


def labelled(name: str, doc: str, label: str, counts: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for value, count in counts.items():
        family.add_metric([value], count)
    return family


def host_tier_metrics(host: dict[str, Any]) -> Iterable[Metric]:
    """Pages moved between tiers, prefetch outcomes and failures by reason, host capacity."""
    yield CounterMetricFamily("tierserve_tier_offloaded_pages", "Pages copied from device to host.",
                              host["offloaded_pages"])
    yield CounterMetricFamily("tierserve_tier_loaded_pages", "Pages loaded back from host to device.",
                              host["loaded_pages"])
    yield CounterMetricFamily("tierserve_tier_offloaded_bytes", "Bytes copied from device to host.",
                              host["offloaded_bytes"])
    yield CounterMetricFamily("tierserve_tier_loaded_bytes", "Bytes loaded back from host to device.",
                              host["loaded_bytes"])
    yield labelled("tierserve_tier_prefetch", "Load-backs by outcome.", "outcome", host["prefetch"])
    yield labelled("tierserve_tier_failures", "Tier copies that failed, by reason.", "reason", host["failures"])
    pages = host["host_pages"]
    yield GaugeMetricFamily("tierserve_host_pages_total", "Usable host-tier pages.", pages["usable"])
    yield GaugeMetricFamily("tierserve_host_pages_cached", "Host pages holding cached KV.", pages["cached"])


def storage_tier_metrics(storage: dict[str, Any]) -> Iterable[Metric]:
    """Pages and bytes written to and read from storage, fetch outcomes, failures by
    reason (the tier's and the backend's), what the backend holds, whether it is on."""
    yield CounterMetricFamily("tierserve_storage_written_pages", "Pages written to storage.", storage["written_pages"])
    yield CounterMetricFamily("tierserve_storage_written_bytes", "Page bytes written to storage.",
                              storage["written_bytes"])
    yield CounterMetricFamily("tierserve_storage_read_pages", "Pages read from storage into host pages.",
                              storage["read_pages"])
    yield CounterMetricFamily("tierserve_storage_read_bytes", "Page bytes read from storage.", storage["read_bytes"])
    yield labelled("tierserve_storage_prefetch", "Storage fetches by outcome.", "outcome", storage["prefetch"])
    backend = storage["backend_stats"]
    yield labelled("tierserve_storage_failures", "Storage tier failures, by reason.", "reason",
                   {**backend["failures"], **storage["failures"]})
    yield CounterMetricFamily("tierserve_storage_switched_off", "Times a failing backend was switched off.",
                              storage["switched_off"])
    yield GaugeMetricFamily("tierserve_storage_enabled", "1 while the storage backend is in use.",
                            1 if storage["enabled"] else 0)
    yield GaugeMetricFamily("tierserve_storage_pages", "Pages the storage backend holds.", backend["pages"])
    yield GaugeMetricFamily("tierserve_storage_bytes", "Bytes the storage backend holds.", backend["bytes"])


class RequestTracker:
    """Turns lifecycle events into latency observations.

    Keeps two timestamps per live request (queued, last token) and forgets them when
    it finishes. Runs inside the step loop: constant work per event.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "tierserve_requests", "Finished requests.", ["finish_reason"], registry=registry
        )
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        self.ttft = histogram("tierserve_time_to_first_token_seconds", "Queued to first token.", TTFT_BUCKETS, registry)
        self.itl = histogram("tierserve_inter_token_latency_seconds", "Between output tokens.", ITL_BUCKETS, registry)
        self.e2e = histogram("tierserve_e2e_request_latency_seconds", "Queued to finished.", E2E_BUCKETS, registry)
        self.queue = histogram("tierserve_queue_time_seconds", "Queued to first admitted.", QUEUE_BUCKETS, registry)
        self._queued: dict[str, float] = {}
        self._last_token: dict[str, float] = {}

    def observe(self, event: LifecycleEvent) -> None:
        if event.kind == "queued":
            self._queued[event.rid] = event.time
        elif event.kind == "admitted":
            self.observe_since_queued(self.queue, event)
        elif event.kind == "tokens":
            self.observe_tokens(event)
        elif event.kind == "finished":
            self.observe_finished(event)

    def observe_since_queued(self, hist: Histogram, event: LifecycleEvent) -> None:
        queued = self._queued.get(event.rid)
        if queued is not None:
            hist.observe(event.time - queued)

    def observe_tokens(self, event: LifecycleEvent) -> None:
        count = int(event.data.get("count", 0))
        if count == 0:  # a finish without new tokens (e.g. aborted mid-prefill)
            return
        last = self._last_token.get(event.rid)
        if event.data.get("first") or last is None:
            self.observe_since_queued(self.ttft, event)
        else:
            # Several tokens in one chunk: spread the gap so each token counts once.
            gap = (event.time - last) / count
            for _ in range(count):
                self.itl.observe(gap)
        self._last_token[event.rid] = event.time

    def observe_finished(self, event: LifecycleEvent) -> None:
        self.requests.labels(event.data.get("reason") or "unknown").inc()
        self.observe_since_queued(self.e2e, event)
        self._queued.pop(event.rid, None)
        self._last_token.pop(event.rid, None)


def histogram(name: str, doc: str, buckets: tuple[float, ...], registry: CollectorRegistry) -> Histogram:
    return Histogram(name, doc, buckets=buckets, registry=registry)
