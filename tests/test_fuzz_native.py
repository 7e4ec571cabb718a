"""hypothesis on what the OpenAPI document cannot describe: native `/generate` bodies
built from the real field names with values of every JSON type and size, and the admin
websocket's messages (objects, non-objects, non-JSON, binary, oversized frames, in
sequences over one connection).

Per example: no 5xx, every refusal an error object, the server keeps serving (a good
request still completes), and once idle nothing is leaked and the integrity check holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import aiohttp
import orjson
import requests
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kernel.sampling_params import SamplingParams
from plugins.admin.messages import COMMANDS
from tests.test_http_fixtures import ServerProcess

pytest_plugins = ["tests.fuzz_server"]

FUZZ = settings(max_examples=80, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
ERROR_FIELDS = {"message", "type", "param", "code"}
SAMPLING_NAMES = [f.name for f in dataclasses.fields(SamplingParams)] + ["max_tokens"]
SAMPLING_NAMES += ["bogus"]

# Every JSON type, with the edges: huge and negative numbers, long strings, deep nesting.
NUMBERS = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 2, 128, 2**31, 2**63]),
                    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.0, -0.0, 1e308, 1e-308]))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=20), st.just("x" * 5000))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=12)
TOKEN_IDS = st.lists(st.integers(-5, 60000), min_size=0, max_size=12)


# Values near the valid ones, so that many bodies are accepted and generate something.
PLAUSIBLE = st.one_of(st.integers(-2, 24), st.floats(0, 2), st.booleans(), st.none(),
                      st.lists(st.integers(0, 600), max_size=3), st.text(max_size=4),
                      st.dictionaries(st.sampled_from(["5", "17", "x"]), st.floats(-100, 100), max_size=2))


@st.composite
def plausible_bodies(draw: st.DrawFn) -> dict[str, Any]:
    prompt: Any = draw(st.one_of(st.text(min_size=1, max_size=20), st.lists(st.text(min_size=1, max_size=8),
                                                                            min_size=1, max_size=3)))
    key = "text"
    if draw(st.booleans()):
        key, prompt = "input_ids", draw(st.lists(st.integers(0, 49151), min_size=1, max_size=12))
    names = draw(st.lists(st.sampled_from(SAMPLING_NAMES), max_size=6, unique=True))
    params = {n: draw(PLAUSIBLE) for n in names}
    params.setdefault("max_new_tokens", draw(st.integers(1, 16)))
    return {key: prompt, "sampling_params": params, "stream": draw(st.booleans())}


@st.composite
def generate_bodies(draw: st.DrawFn) -> Any:
    """Half near-valid bodies, half the route's real fields with any values, or anything."""
    if draw(st.booleans()):
        return draw(plausible_bodies())
    if draw(st.integers(0, 4)) == 0:
        return draw(JSON)
    body: dict[str, Any] = {}
    prompt = draw(st.sampled_from(["text", "input_ids", "both", "none"]))
    if prompt in ("text", "both"):
        body["text"] = draw(st.one_of(st.text(max_size=30), st.lists(st.text(max_size=10), max_size=3), JSON))
    if prompt in ("input_ids", "both"):
        body["input_ids"] = draw(st.one_of(TOKEN_IDS, st.lists(TOKEN_IDS, max_size=3), JSON))
    names = draw(st.lists(st.sampled_from(SAMPLING_NAMES), max_size=5, unique=True))
    values = {n: draw(st.one_of(JSON, NUMBERS)) for n in names}
    body["sampling_params"] = draw(st.one_of(st.just(values), JSON))
    for name in ("stream", "return_logprob", "top_logprobs_num"):
        if draw(st.booleans()):
            body[name] = draw(st.one_of(st.booleans(), JSON))
    return body


def assert_refusal_or_success(resp: requests.Response) -> None:
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        body = resp.json()
        assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, body


def assert_still_serving(server: ServerProcess) -> None:
    """A good request completes; then, idle, nothing is leaked and the check holds."""
    good = {"input_ids": [100, 101, 102], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    resp = requests.post(f"{server.url}/generate", json=good, timeout=60)
    assert resp.status_code == 200, resp.text
    server.wait_idle(timeout_s=60)
    stats = requests.get(f"{server.url}/admin/stats", timeout=10).json()
    assert stats["pages"]["held"] == 0 and stats["rows"]["free"] == stats["rows"]["usable"], stats
    assert requests.get(f"{server.url}/admin/check", timeout=30).json() == {"type": "check", "ok": True}


@FUZZ
@given(body=generate_bodies())
def test_native_generate_bodies(body: Any, fuzzed_server: ServerProcess) -> None:
    resp = requests.post(f"{fuzzed_server.url}/generate", data=json.dumps(body),  # big ints too
                         headers={"Content-Type": "application/json"}, timeout=60)
    event(f"status {resp.status_code}")
    assert_refusal_or_success(resp)
    if resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/event-stream"):
        assert resp.text.rstrip().endswith("data: [DONE]"), resp.text[-200:]
    fuzzed_server.wait_idle(timeout_s=60)


# ---- the admin websocket ---------------------------------------------------------------

KNOWN_TYPES = [*COMMANDS, "subscribe", "unsubscribe", "auth", "no-such-type"]
ARG_NAMES = ["limit", "by", "kind", "name", "enable", "id", "key"]


@st.composite
def admin_frames(draw: st.DrawFn) -> tuple[str, Any]:
    """(frame kind, payload): a command object with fuzzed arguments, any JSON value, text
    that is not JSON, binary, or a frame over the socket's 64 KiB limit."""
    kind = draw(st.sampled_from(["command"] * 6 + ["json", "text", "binary", "huge"]))
    if kind == "command":
        msg: dict[str, Any] = {"type": draw(st.one_of(st.sampled_from(KNOWN_TYPES), JSON))}
        for name in draw(st.lists(st.sampled_from(ARG_NAMES), max_size=3, unique=True)):
            msg[name] = draw(st.one_of(JSON, st.sampled_from(["hits", "tokens", "lru", "evict", "schedule"])))
        if msg["type"] == "set_policy":  # keep the server's policies valid for later tests
            msg["name"] = "no-such-policy"
        if msg["type"] == "storage":
            msg.pop("enable", None)
        return "json", msg
    if kind == "json":
        return "json", draw(JSON)
    if kind == "text":
        return "text", draw(st.text(max_size=40))
    if kind == "binary":
        return "binary", draw(st.binary(max_size=40))
    return "text", orjson.dumps({"type": "stats", "pad": "x" * (70 << 10)}).decode()


async def exchange(url: str, frames: list[tuple[str, Any]]) -> list[Any]:
    """Send the frames one by one on one connection; the replies (or the close) seen."""
    seen: list[Any] = []
    async with aiohttp.ClientSession() as session, session.ws_connect(url + "/admin/ws") as ws:
        for kind, payload in frames:
            if kind == "binary":
                await ws.send_bytes(payload)
            else:
                await ws.send_str(payload if kind == "text" else json.dumps(payload))
            msg = await ws.receive(timeout=30)
            while msg.type is aiohttp.WSMsgType.TEXT and orjson.loads(msg.data).get("type") in ("kv_event",
                                                                                            "request_event"):
                msg = await ws.receive(timeout=30)  # pushed events after a subscribe
            if msg.type is not aiohttp.WSMsgType.TEXT:
                seen.append(("closed", ws.close_code))
                return seen
            seen.append(orjson.loads(msg.data))
    return seen


@FUZZ
@given(frames=st.lists(admin_frames(), min_size=1, max_size=5))
def test_admin_socket_messages(frames: list[tuple[str, Any]], fuzzed_server: ServerProcess) -> None:
    replies = asyncio.run(asyncio.wait_for(exchange(fuzzed_server.url, frames), 60))
    for reply in replies:
        event(f"reply {reply[0] if isinstance(reply, tuple) else reply.get('type')}")
        if isinstance(reply, tuple):  # only an oversized frame closes the socket (1009)
            assert reply == ("closed", aiohttp.WSCloseCode.MESSAGE_TOO_BIG), (reply, frames)
            continue
        assert isinstance(reply, dict) and isinstance(reply.get("type"), str), reply
        if reply["type"] == "error":
            assert isinstance(reply["message"], str) and reply["message"], reply
    assert_still_serving(fuzzed_server)


def test_generate_fuzz_leaves_the_server_serving(fuzzed_server: ServerProcess) -> None:
    """Runs after the fuzzers in this module (file order): the engine serves and holds nothing."""
    assert_still_serving(fuzzed_server)
