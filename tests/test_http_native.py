"""Native routes (/generate, /health, /server_info) and client disconnects."""

from __future__ import annotations

import aiohttp
import orjson
import requests

from tests.test_http_fixtures import ServerProcess, post

pytest_plugins = ["tests.test_http_fixtures"]

GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def sse_events(resp: requests.Response) -> list[object]:
    """The JSON payloads of an SSE response; asserts it ends with [DONE]."""
    lines = [ln for ln in resp.iter_lines() if ln]
    assert lines[-1] == b"data: [DONE]"
    return [orjson.loads(ln[6:]) for ln in lines[:-1]]


def test_health_and_server_info(server: ServerProcess) -> None:
    assert requests.get(f"{server.url}/health", timeout=5).json() == {"status": "ok"}
    info = server.info()
    assert info["version"] == "0.1.0" and info["context_length"] == 2048
    assert info["num_pages"] == 256 and info["page_size"] == 4
    assert set(info["pool"]) >= {"free_pages", "cached_pages", "running", "waiting"}
    assert "api_key" not in info["config"]["server"] and "admin_api_key" not in info["config"]["server"]
    assert info["config"]["debug"]["check_invariants"] is True


def test_generate_matches_openai_completion(server: ServerProcess) -> None:
    body = {"text": "Hello", "sampling_params": GREEDY, "return_logprob": True}
    out = post(server, "/generate", body).json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["completion_tokens"] == len(out["output_ids"]) == 10 and meta["finish_reason"] == "length"
    assert [t for _, t in meta["output_token_logprobs"]] == out["output_ids"]
    openai_body = {"prompt": "Hello", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    assert post(server, "/v1/completions", openai_body).json()["choices"][0]["text"] == out["text"]
    ids = post(server, "/v1/tokenize", {"prompt": "Hello"}).json()["tokens"]
    by_ids = post(server, "/generate", {"input_ids": ids, "sampling_params": GREEDY}).json()
    assert by_ids["output_ids"] == out["output_ids"]


def test_generate_stream_is_cumulative(server: ServerProcess) -> None:
    whole = post(server, "/generate", {"text": "Hello", "sampling_params": GREEDY}).json()
    body = {"text": "Hello", "sampling_params": GREEDY, "stream": True}
    resp = post(server, "/generate", body, stream=True)
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(resp)
    lengths = [len(e["output_ids"]) for e in events]  # type: ignore[index]
    assert lengths == sorted(lengths) and lengths[-1] == 10
    last = events[-1]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]  # type: ignore[index]
    assert last["meta_info"]["finish_reason"] == "length"  # type: ignore[index]


def test_generate_batch(server: ServerProcess) -> None:
    single = post(server, "/generate", {"text": "Hello", "sampling_params": GREEDY}).json()
    outs = post(server, "/generate", {"text": ["Hello", "Hello"], "sampling_params": GREEDY}).json()
    assert [o["text"] for o in outs] == [single["text"]] * 2


async def test_disconnect_mid_stream_aborts_and_frees_pages(server: ServerProcess) -> None:
    before = server.wait_idle()["counters"]["generation_tokens"]
    body = {"prompt": "Go on", "max_tokens": 900, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        resp = await session.post(f"{server.url}/v1/completions", json=body)
        seen = 0
        async for line in resp.content:
            seen += line.startswith(b"data: {")
            if seen == 3:
                break
        resp.close()  # drops the connection mid-stream
    info = server.wait_idle(timeout_s=5)
    generated = info["counters"]["generation_tokens"] - before
    assert 3 <= generated < 900, generated  # aborted, not run to the end


async def test_client_timeout_on_non_streaming_request_aborts(server: ServerProcess) -> None:
    """No stream to write to: only handler cancellation notices this client is gone."""
    before = server.wait_idle()["counters"]["generation_tokens"]
    body = {"prompt": "Go on", "max_tokens": 900, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as session:
        try:
            await session.post(f"{server.url}/v1/completions", json=body)
        except TimeoutError:
            pass
    info = server.wait_idle(timeout_s=5)
    assert info["counters"]["generation_tokens"] - before < 900
