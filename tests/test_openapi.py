"""`GET /openapi.json`: a valid OpenAPI 3.1 document of every route, whose body schemas
are the parsers' own dataclasses and agree with what the server accepts and refuses."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
from aiohttp import web
from openapi_spec_validator import validate

from kernel.config import load_config
from kernel.sampling_params import SamplingParams
from plugins.admin import messages
from plugins.http import openapi
from plugins.http.chat import ChatBody, parse_chat
from plugins.http.completions import CompletionBody, parse_completion
from plugins.http.engine_routes import ENGINE_ROUTES
from plugins.http.native_api import GenerateBody, parse_inputs, parse_params
from plugins.http.protocol import get_bool
from plugins.http.server import build_app
from plugins.http.state import ServerState
from tests.inprocess import serve_http

API_KEY, ADMIN_KEY = "sk-openapi-test", "adm-openapi-test"
KEYS = {"server.api_key": API_KEY, "server.admin_api_key": ADMIN_KEY, "cache.prefix": "radix"}
API = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PUBLIC = {"/health", "/openapi.json", "/admin", "/admin/", "/admin/static/{name}"}  # tests/test_route_security.py


def router_routes(app: web.Application) -> set[tuple[str, str]]:
    """(method, path) of every route of the app's router and the engine routes' inner one,
    read here without the generator: mount points (method *) and aiohttp's HEAD twins aside."""
    inner = app[ENGINE_ROUTES].inner
    assert inner is not None
    out = set()
    for route in [*app.router.routes(), *inner.router.routes()]:
        assert route.resource is not None
        if route.method not in ("*", "HEAD"):
            out.add((route.method, route.resource.canonical))
    return out


def validator(doc: dict[str, Any], name: str) -> jsonschema.Draft202012Validator:
    """A validator for components/schemas/`name`, its $refs resolved within `doc`."""
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": doc["components"]})


# (method, path, schema, body the server accepts, body it refuses with 400 for a type error)
BODIES: list[tuple[str, str, str, dict[str, Any], dict[str, Any]]] = [
    ("POST", "/v1/completions", "CompletionBody",
     {"prompt": "hello", "max_tokens": 2, "temperature": 0, "stop": ["x"], "stream": False, "user": "u"},
     {"prompt": "hello", "max_tokens": "2"}),
    ("POST", "/v1/chat/completions", "ChatBody",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_completion_tokens": 2,
      "logprobs": True, "top_logprobs": 1, "seed": 3, "tool_choice": "none",
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
     {"messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"}),
    ("POST", "/generate", "GenerateBody",
     {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 2, "top_k": 1, "stop": "x"},
      "return_logprob": True},
     {"text": "hello", "sampling_params": {"max_new_tokens": 2, "top_k": "1"}}),
    ("POST", "/v1/tokenize", "TokenizeBody", {"prompt": "hello"}, {"prompt": ["hello"]}),
    ("POST", "/v1/detokenize", "DetokenizeBody", {"tokens": [1, 2]}, {"tokens": "12"}),
    ("POST", "/admin/set_policy", "SetPolicyArgs", {"kind": "evict", "name": "lru"}, {"kind": "evict", "name": 3}),
]


async def test_document_is_valid_complete_and_matches_the_server(tiny_chat_folder: str) -> None:
    async with serve_http(tiny_chat_folder, KEYS) as (_, client):
        resp = await client.get("/openapi.json")  # no key: open, like /health
        assert resp.status == 200
        doc = await resp.json()
        validate(doc)  # OpenAPI 3.1, by openapi-spec-validator
        assert doc["openapi"].startswith("3.1")
        served = router_routes(client.app)
        documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
        assert documented == served, "the document lists exactly the router's routes"
        assert served == set(openapi.ROUTE_DOCS), "each route has its summary, and none is stale"
        for path, ops in doc["paths"].items():
            for op in ops.values():
                want = "none" if path in PUBLIC else "admin_key" if path.startswith("/admin") else "api_key"
                assert op["x-tierserve-auth"] == want, path
                assert op["security"] == {"none": [], "api_key": [{"apiKey": []}],
                                          "admin_key": [{"adminKey": []}]}[want], path
                assert ("401" in op["responses"]) == (want != "none"), path
        for method, path, name, good, bad in BODIES:
            op = doc["paths"][path][method.lower()]
            assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + name)
            assert "400" in op["responses"] and "413" in op["responses"] or path.startswith("/admin"), path
            check = validator(doc, name)
            headers = ADMIN if path.startswith("/admin") else API
            ok = await client.request(method, path, json=good, headers=headers)
            assert ok.status == 200, (path, await ok.text())
            check.validate(good)  # accepted by the server, valid by the schema
            refused = await client.request(method, path, json=bad, headers=headers)
            assert refused.status == 400, (path, await refused.text())
            assert not check.is_valid(bad), f"{path}: the server refuses {bad}, the schema lets it through"
        err = await (await client.post("/v1/completions", json={"prompt": 5}, headers=API)).json()
        validator(doc, "ErrorBody").validate(err)
        admin_err = await (await client.get("/admin/stats")).json()
        validator(doc, "AdminError").validate(admin_err)


def bare_app(overrides: dict[str, Any] | None = None) -> web.Application:
    """The server's app without an engine; its engine routes bound to an empty app."""
    app = build_app(ServerState(load_config(None, overrides or {})))
    app[ENGINE_ROUTES].inner = web.Application()
    return app


def test_document_is_503_until_the_engine_routes_are_bound() -> None:
    app = build_app(ServerState(load_config(None, {})))
    with pytest.raises(openapi.APIError) as info:
        openapi.build_document(app)
    assert info.value.status == 503


def test_body_schemas_list_exactly_the_dataclass_fields() -> None:
    components: openapi.Components = {}
    sampling = {f.name for f in dataclasses.fields(SamplingParams)}
    for doc in openapi.ROUTE_DOCS.values():
        if doc.body is None:
            continue
        openapi.schema_of(doc.body, components)
        schema = components[doc.body.__name__]
        fields = dataclasses.fields(doc.body)
        extra = getattr(doc.body, "SAMPLING_FIELDS", ())
        assert set(extra) <= sampling
        assert list(schema["properties"]) == [f.name for f in fields] + list(extra)
        no_default = [f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is
                      dataclasses.MISSING]
        assert schema.get("required", []) == no_default
    params = components["SamplingParams"]
    assert set(params["properties"]) == sampling | {"max_tokens"} and params["additionalProperties"] is False


def test_the_document_follows_a_field_planted_in_the_dataclass(monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclasses.dataclass(frozen=True)
    class CompletionBody(openapi.CompletionBody):  # same name: it replaces the component
        planted: int | None = 7

    route = ("POST", "/v1/completions")
    monkeypatch.setitem(openapi.ROUTE_DOCS, route, dataclasses.replace(openapi.ROUTE_DOCS[route], body=CompletionBody))
    doc = openapi.build_document(bare_app())
    props = doc["components"]["schemas"]["CompletionBody"]["properties"]
    assert props["planted"] == {"type": ["integer", "null"], "default": 7}
    assert list(props)[: len(dataclasses.fields(CompletionBody))] == [f.name for f in dataclasses.fields(CompletionBody)]
    validate(doc)


def test_security_follows_the_keys_set() -> None:
    doc = openapi.build_document(bare_app())  # no keys: API open, admin loopback-only
    models = doc["paths"]["/v1/models"]["get"]
    assert models["security"] == [] and "401" not in models["responses"]
    keyed = openapi.build_document(bare_app({"server.api_key": API_KEY, "server.admin_api_key": ADMIN_KEY}))
    assert keyed["paths"]["/v1/models"]["get"]["security"] == [{"apiKey": []}]
    assert API_KEY not in str(keyed) and ADMIN_KEY not in str(keyed)  # which key, never the key


class Recorder(dict[str, Any]):
    """A body that records every field name a parser reads from it."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


def stub_engine() -> Any:
    tokenizer = SimpleNamespace(apply_chat_template=lambda messages, add_generation_prompt: "text",
                                encode=lambda text: [1, 2], chat_template=None)
    return SimpleNamespace(info=SimpleNamespace(model_name="m", context_length=64, pool_tokens=64, page_size=4),
                           tokenizer=tokenizer, snapshot=list, set_policy=lambda kind, name: None)


def documented(model: type) -> set[str]:
    components: openapi.Components = {}
    openapi.schema_of(model, components)
    return set(components[model.__name__]["properties"])


def generate_reads(body: dict[str, Any]) -> None:
    parse_inputs(body)
    parse_params(body)
    get_bool(body, "stream")  # as native_api.generate reads it


@pytest.mark.parametrize(("model", "parse", "body"), [
    (CompletionBody, lambda b: parse_completion(b, stub_engine()), {"prompt": "x"}),
    (ChatBody, lambda b: parse_chat(b, stub_engine()), {"messages": [{"role": "user", "content": "hi"}]}),
    (GenerateBody, generate_reads, {"text": "x"}),
    (messages.SetPolicyArgs, lambda b: messages.set_policy(stub_engine(), b), {"kind": "evict", "name": "lru"}),
    (messages.SnapshotArgs, lambda b: messages.snapshot(stub_engine(), b), {"limit": 3}),
], ids=["completions", "chat", "generate", "set_policy", "snapshot"])
def test_parsers_read_exactly_the_documented_fields(model: type, parse: Any, body: dict[str, Any]) -> None:
    """The other direction of 'not written twice': a field the parser reads but the
    dataclass lacks (or one the dataclass has that nothing reads) fails here."""
    recorder = Recorder(body)
    parse(recorder)
    assert recorder.read == documented(model)
