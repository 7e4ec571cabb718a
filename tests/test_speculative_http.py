"""Speculative decoding through the real server and the official `openai` client: in
deterministic mode a request that speculates (the default once `speculative.method` is
set) reads exactly what the same request opted out (`speculative: false`) reads —
completions, streamed chat, n > 1 with a seed, logprobs and top logprobs, a stop string —
and the counters move in /metrics, /server_info and each request's meta_info."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests
from openai import OpenAI

from tests.test_http_fixtures import ServerProcess, post

PROMPT = "one two three four five six seven one two three four five six seven one two three"


@pytest.fixture(scope="module")
def server(tiny_chat_folder: str) -> Iterator[ServerProcess]:
    srv = ServerProcess(tiny_chat_folder, "deterministic=true", "speculative.method=ngram",
                        "speculative.ngram_min=1", "cache.prefix=radix")
    yield srv
    assert srv.stop() == 0


def client(server: ServerProcess) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def both(server: ServerProcess, create: Any, **kw: Any) -> tuple[Any, Any]:
    return create(**kw), create(**kw, extra_body={"speculative": False})


def test_completions_and_chat_equal_opted_out(server: ServerProcess) -> None:
    c = client(server)
    name = c.models.list().data[0].id
    spec, plain = both(server, c.completions.create, model=name, prompt=PROMPT, max_tokens=24, temperature=0,
                       logprobs=3, extra_headers={})
    assert spec.choices[0].text == plain.choices[0].text
    assert spec.choices[0].logprobs == plain.choices[0].logprobs
    spec, plain = both(server, c.completions.create, model=name, prompt=PROMPT, max_tokens=20, temperature=1.3,
                       seed=5, n=2, stop=[" five"])
    assert [ch.text for ch in spec.choices] == [ch.text for ch in plain.choices]
    assert [ch.finish_reason for ch in spec.choices] == [ch.finish_reason for ch in plain.choices]
    messages = [{"role": "user", "content": PROMPT}]
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=name, messages=messages, max_tokens=24, temperature=0, stream=True) if ch.choices)
    opted = c.chat.completions.create(model=name, messages=messages, max_tokens=24, temperature=0,
                                      extra_body={"speculative": False})
    assert streamed == opted.choices[0].message.content


def test_counters(server: ServerProcess) -> None:
    out = post(server, "/generate", {"text": PROMPT, "sampling_params": {"max_new_tokens": 24, "temperature": 0}})
    meta = out.json()["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["spec_accepted_tokens"] > 0
    info = server.info()["speculative"]
    assert info["method"] == "ngram" and info["accepted_tokens"] > 0
    metrics = requests.get(f"{server.url}/metrics", timeout=5).text
    line = next(x for x in metrics.splitlines() if x.startswith('tierserve_spec_accepted_tokens_total{method="ngram"}'))
    assert float(line.split()[-1]) > 0
    bad = post(server, "/generate", {"text": PROMPT, "sampling_params": {"speculative": "yes"}})
    assert bad.status_code == 400 and "speculative" in bad.text


def test_rejection_acceptance_through_the_server(tiny_chat_folder: str) -> None:
    """`speculative.acceptance=rejection` with a draft model (the target's own weights),
    through the official client: a seeded, sampled, streamed chat reads the same twice and
    keeps nearly every draft; greedy reads what the opted-out request reads."""
    srv = ServerProcess(tiny_chat_folder, "deterministic=true", "speculative.method=draft",
                        f"speculative.draft_model={tiny_chat_folder}", "speculative.acceptance=rejection",
                        "cache.prefix=radix")
    try:
        c = client(srv)
        name = c.models.list().data[0].id
        messages = [{"role": "user", "content": PROMPT}]

        def streamed() -> str:
            return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                model=name, messages=messages, max_tokens=32, temperature=1.0, seed=3, stream=True) if ch.choices)

        first = streamed()
        assert first and streamed() == first
        info = srv.info()
        assert info["config"]["speculative"]["acceptance"] == "rejection"
        spec = info["speculative"]
        assert spec["drafted_tokens"] > 0 and spec["accepted_tokens"] >= 0.8 * spec["drafted_tokens"], spec
        greedy, opted = both(srv, c.completions.create, model=name, prompt=PROMPT, max_tokens=20, temperature=0)
        assert greedy.choices[0].text == opted.choices[0].text
    finally:
        assert srv.stop() == 0
