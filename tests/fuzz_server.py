"""One `serve` process shared by the fuzz tests (loaded with `pytest_plugins`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.test_http_fixtures import ServerProcess


@pytest.fixture(scope="session")
def fuzzed_server(tiny_chat_folder: str) -> Iterator[ServerProcess]:
    # A short context bounds what a fuzzed max_tokens x n can ask for (seconds, not minutes).
    server = ServerProcess(tiny_chat_folder, "model.context_length=192", "server.max_queued_requests=64",
                           "cache.prefix=radix")
    yield server
    assert server.stop() == 0
