"""GET /metrics: engine counters mirrored exactly, histograms fed by lifecycle events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kernel.async_engine import AsyncEngine
from plugins.metrics import add_metrics_route
from tests.inprocess import serve_engine

PROMPTS = [list(range(100, 130)), list(range(100, 121)), list(range(200, 213))]
NEW_TOKENS = 5
PARAMS = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
Client = TestClient[web.Request, web.Application]


@asynccontextmanager
async def serve(folder: str) -> AsyncIterator[tuple[AsyncEngine, Client]]:
    async with serve_engine(folder, add_metrics_route) as served:
        yield served


async def scrape(client: Client) -> Samples:
    """Every sample of one scrape, keyed by (sample name, sorted labels)."""
    response = await client.get("/metrics")
    assert response.status == 200 and response.content_type == "text/plain"
    samples: Samples = {}
    for family in text_string_to_metric_families(await response.text()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after[key] - before.get(key, 0.0)


async def test_counters_and_histograms_move_with_requests(tiny_chat_folder: str) -> None:
    async with serve(tiny_chat_folder) as (engine, client):
        before = await scrape(client)
        for prompt in PROMPTS:  # one after another: the second reuses the first's pages
            await engine.generate(prompt, PARAMS)
        after = await scrape(client)

        n = len(PROMPTS)
        assert delta(before, after, "tierserve_prompt_tokens_total") == sum(map(len, PROMPTS))
        assert delta(before, after, "tierserve_generation_tokens_total") == n * NEW_TOKENS
        assert delta(before, after, "tierserve_requests_total", finish_reason="length") == n
        assert delta(before, after, "tierserve_requests_total", finish_reason="stop") == 0
        for hist in ("time_to_first_token", "e2e_request_latency", "queue_time"):
            assert delta(before, after, f"tierserve_{hist}_seconds_count") == n
            assert delta(before, after, f"tierserve_{hist}_seconds_sum") > 0
        itl = delta(before, after, "tierserve_inter_token_latency_seconds_count")
        assert itl == n * (NEW_TOKENS - 1)  # one gap between each pair of tokens

        cache = engine.cache_stats()
        hits = after[("tierserve_prefix_cache_hits_tokens_total", (("tier", "device"),))]
        queries = after[("tierserve_prefix_cache_queries_tokens_total", (("tier", "device"),))]
        assert hits == cache["prefix_hit_tokens"] == 20  # five pages of the first prompt
        assert queries == cache["prefix_query_tokens"] > hits

        assert after[("tierserve_kv_pages_total", ())] == engine.stats()["pages"]["usable"]
        assert after[("tierserve_kv_pages_used", ())] == cache["cached_pages"] > 0
        assert after[("tierserve_running_requests", ())] == after[("tierserve_queued_requests", ())] == 0


async def test_gauges_are_read_at_scrape_time(tiny_chat_folder: str) -> None:
    async with serve(tiny_chat_folder) as (engine, client):
        rids = [engine.add_request(p, PARAMS) for p in PROMPTS]
        busy = await scrape(client)  # nothing has been stepped yet: all queued
        assert busy[("tierserve_queued_requests", ())] + busy[("tierserve_running_requests", ())] == len(rids)
        for rid in rids:
            await engine.collect(rid)
        idle = await scrape(client)
        assert idle[("tierserve_queued_requests", ())] == idle[("tierserve_running_requests", ())] == 0


async def test_two_apps_keep_separate_registries(tiny_chat_folder: str) -> None:
    # The global prometheus registry would refuse the second set of metric names.
    async with serve(tiny_chat_folder) as (engine, client):
        other = web.Application()
        add_metrics_route(other, engine)
        await engine.generate(PROMPTS[0], PARAMS)
        assert (await scrape(client))[("tierserve_requests_total", (("finish_reason", "length"),))] == 1
