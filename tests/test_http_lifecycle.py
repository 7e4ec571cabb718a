"""Queue limit (429), API keys (401) and the SIGTERM drain (503, in-flight work finishes, exit 0)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import orjson
import pytest
import requests
from openai import OpenAI

from tests.test_http_fixtures import MAX_QUEUED, ServerProcess, assert_error, post

pytest_plugins = ["tests.test_http_fixtures"]

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}


def data_lines(resp: requests.Response) -> Iterator[bytes]:
    return (ln for ln in resp.iter_lines() if ln.startswith(b"data: "))


def test_queue_full_is_429_with_retry_after(server: ServerProcess) -> None:
    hold = {"prompt": "Hold", "n": 16, "max_tokens": 900, "ignore_eos": True, "stream": True}
    resp = post(server, "/v1/completions", hold, stream=True)
    lines = data_lines(resp)
    next(lines)  # the 16 requests are queued or running now
    over = post(server, "/v1/completions", {"prompt": "x", "n": MAX_QUEUED - 16 + 1})
    err = assert_error(over, 429)
    assert over.headers["Retry-After"] == "1" and err["code"] == "queue_full"
    resp.close()  # aborts all 16
    server.wait_idle()
    assert post(server, "/v1/completions", {"prompt": "x", "n": 4, "max_tokens": 2}).status_code == 200


@pytest.fixture(scope="module")
def keyed_server(tiny_chat_folder: str) -> Iterator[ServerProcess]:
    # A bigger pool than the shared server: one request runs 400 tokens.
    srv = ServerProcess(tiny_chat_folder, f"server.api_key={KEY}", "cache.num_pages=600")
    yield srv
    srv.stop()


def test_api_key_guards_everything_but_health(keyed_server: ServerProcess) -> None:
    url = keyed_server.url
    assert requests.get(f"{url}/health", timeout=5).status_code == 200
    for path in ("/v1/models", "/server_info"):
        assert_error(requests.get(url + path, timeout=5), 401)
        assert_error(requests.get(url + path, headers={"Authorization": "Bearer nope"}, timeout=5), 401)
        assert requests.get(url + path, headers=AUTH, timeout=5).status_code == 200
    assert_error(post(keyed_server, "/generate", {"text": "x"}), 401)
    assert_error(post(keyed_server, "/v1/completions", {"prompt": "x"}), 401)
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    name = client.models.list().data[0].id
    assert client.completions.create(model=name, prompt="Hi", max_tokens=2).choices[0].text is not None


def test_sigterm_drains_in_flight_requests_then_exits_0(keyed_server: ServerProcess) -> None:
    # Long enough to outlast the probes below, short enough to finish well inside the 30 s grace.
    body = {"prompt": "Long", "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
    resp = post(keyed_server, "/v1/completions", body, stream=True, headers=AUTH)
    lines = data_lines(resp)
    first = next(lines)
    keyed_server.terminate()
    time.sleep(0.05)
    health = requests.get(f"{keyed_server.url}/health", timeout=5)
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    refused = post(keyed_server, "/v1/completions", {"prompt": "x"}, headers=AUTH)
    assert assert_error(refused, 503)["code"] == "draining"
    chunks = [orjson.loads(ln[6:]) for ln in [first, *lines] if ln != b"data: [DONE]"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # finished, not aborted
    assert keyed_server.proc.wait(timeout=30) == 0
