"""schemathesis against the server's own `GET /openapi.json`: every operation, bounded
examples each (derandomized), valid and invalid bodies alike, on a real `serve` process.

Per response: no 5xx (`not_a_server_error`), the status is one the document lists,
the body conforms to the document, no hang (a 30 s limit per call), and every error is
the object the document names for it: OpenAI's `{"error": {message, type, param, code}}`,
or from the admin handlers the admin API's `{"type": "error", "message"}`. After each example the
server is idle again with every page free or cached (nothing leaked).

Stateful testing: the document has no OpenAPI links (no operation's output is another's
input: prompts go in, text comes out), so there is no state machine to walk; the
admin socket's command sequences are fuzzed in test_fuzz_native.py instead.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.test_http_fixtures import ServerProcess

EXAMPLES = 12  # per operation and phase: the suite's time budget, not the fuzzer's appetite
CALL_TIMEOUT_S = 30
ERROR_FIELDS = {"message", "type", "param", "code"}


pytest_plugins = ["tests.fuzz_server"]


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# NOTE: schemathesis' own pytest loader (`from_fixture`) does not run under pytest 9, so
# the operations are walked here: one hypothesis run per operation and generation mode.


def error_object_check(response: Any) -> None:
    """A 4xx is an error object (which one per route and status the document says, and
    `response_schema_conformance` holds it to that)."""
    if response.status_code < 400:
        return
    body = response.json()
    if body.get("type") == "error":  # the admin API's own
        assert set(body) == {"type", "message"} and isinstance(body["message"], str), body
        return
    assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body


def fuzz_operation(operation: Any, mode: GenerationMode, server: ServerProcess) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def one(case: Any) -> None:
        response = case.call(base_url=server.url, timeout=CALL_TIMEOUT_S)
        case.validate_response(response, checks=CHECKS)
        error_object_check(response)
        server.wait_idle(timeout_s=60)

    one()


def has_inputs(operation: Any) -> bool:
    return bool(list(operation.body)) or bool(list(operation.path_parameters)) or bool(list(operation.query))


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation_survives_fuzzing(mode: GenerationMode, fuzzed_server: ServerProcess) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")
    fuzzed = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path == "/admin/ws":
            continue  # a websocket upgrade: fuzzed through its messages in test_fuzz_native.py
        if mode is GenerationMode.NEGATIVE and not has_inputs(operation):
            continue  # nothing to send wrong (no body, no parameter)
        try:
            fuzz_operation(operation, mode, fuzzed_server)
        except Unsatisfiable:
            # Only a free-form string path parameter (any string is a valid model or
            # file name) has no wrong value; a body always has one.
            assert mode is GenerationMode.NEGATIVE and not list(operation.body), operation.label
            continue
        fuzzed.append(operation.label)
    # Every route in the document (the positive pass), or every one that takes input.
    assert len(fuzzed) >= (18 if mode is GenerationMode.POSITIVE else 7), fuzzed
