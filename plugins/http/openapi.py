"""`GET /openapi.json`: an OpenAPI 3.1 document of every route, generated, never hand-kept.

The operations come from walking the app's router (and the engine routes' inner router,
which the `/metrics` and `/admin/*` mount points stand for), so a new route appears by
being registered. The key each needs is `auth.guard_of`'s, the same the middleware
applies. Request bodies are the frozen dataclasses beside their parsers (`CompletionBody`,
`ChatBody`, `GenerateBody`, ...) turned into JSON Schema from their annotations:
required = no default, `X | None` = nullable, `Literal` = enum, `field(metadata={"schema":
{...}})` adds bounds; a body's `SAMPLING_FIELDS` pull in `SamplingParams` fields as they
are. Errors are OpenAI's error object (`errors.ErrorBody`), or on the admin routes the
admin API's `{"type": "error", "message"}`.

The document describes the running server (whether a key is set decides `security`), so
it is answered once the engine routes are bound (503 before, as they do). It is open,
like /health: it holds no key and no config, only what the README says.
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from aiohttp import web

from kernel.config import ServerConfig
from kernel.sampling_params import _ALIASES, LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS, SamplingParams
from plugins.admin.messages import SetPolicyArgs, SnapshotArgs
from plugins.http.auth import Guard, guard_of
from plugins.http.chat import ChatBody
from plugins.http.completions import CompletionBody
from plugins.http.engine_routes import ENGINE_ROUTES
from plugins.http.errors import APIError, ErrorBody
from plugins.http.native_api import GenerateBody, version
from plugins.http.openai_api import DetokenizeBody, TokenizeBody
from plugins.http.state import STATE
from plugins.jsonio import json_response

OPENAPI_VERSION = "3.1.0"
Schema = dict[str, Any]
Components = dict[str, Schema]
# JSON shapes SamplingParams.from_dict turns into its field types (see `_coerce`).
WIRE_TYPES: dict[tuple[type, str], Any] = {
    (SamplingParams, "stop"): str | list[str], (SamplingParams, "logit_bias"): dict[str, float],
    (SamplingParams, "json_schema"): str | dict[str, Any],
}
# Schema words a field's type cannot say (a dataclass field's own metadata does this for
# the HTTP bodies; SamplingParams lives in the kernel, which knows nothing of schemas).
WIRE_SCHEMA: dict[tuple[type, str], Any] = {(SamplingParams, "logit_bias"): {
    "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^[0-9]+$"},
    "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_LIMIT, "maximum": LOGIT_BIAS_LIMIT},
}}
# SamplingParams.from_dict: unknown names are refused, null means "the default".
CLOSED_MODELS = frozenset({SamplingParams})
_PRIMITIVES: dict[Any, str] = {bool: "boolean", int: "integer", float: "number", str: "string"}


@dataclass(frozen=True)
class RouteDoc:
    summary: str
    body: type | None = None  # the dataclass its JSON body is read as
    errors: tuple[int, ...] = ()  # beyond the auth ones, which guard_of decides
    media: str = "application/json"  # of a success
    streams: bool = False  # `stream: true` answers server-sent events


ADMIN_ERRORS = (503,)  # the engine routes' mount points answer 503 until the engine is bound
ROUTE_DOCS: dict[tuple[str, str], RouteDoc] = {
    ("POST", "/v1/completions"): RouteDoc("Text completions (OpenAI)", CompletionBody, (400, 413, 429, 503),
                                          streams=True),
    ("POST", "/v1/chat/completions"): RouteDoc("Chat completions (OpenAI)", ChatBody, (400, 413, 429, 503),
                                               streams=True),
    ("GET", "/v1/models"): RouteDoc("The served model, as a list", errors=(503,)),
    ("GET", "/v1/models/{model}"): RouteDoc("The served model's card", errors=(404, 503)),
    ("POST", "/v1/tokenize"): RouteDoc("Token ids of a prompt or of chat messages", TokenizeBody, (400, 413, 503)),
    ("POST", "/v1/detokenize"): RouteDoc("Text of token ids", DetokenizeBody, (400, 413, 503)),
    ("POST", "/generate"): RouteDoc("Generate with the engine's sampling parameters", GenerateBody,
                                    (400, 413, 429, 503), streams=True),
    # 503 {"status": "starting" | "draining"}, or an error object once halted: not one schema.
    ("GET", "/health"): RouteDoc("Liveness: 200 ok; 503 starting, draining or halted"),
    ("GET", "/server_info"): RouteDoc("Config (without keys), pool usage, counters", errors=(503,)),
    # The routes routers call on a worker (plugins/http/worker_api.py).
    ("GET", "/get_server_info"): RouteDoc("/server_info, under SGLang's name", errors=(503,)),
    ("GET", "/model_info"): RouteDoc("The served model: path, tokenizer, type (SGLang's router reads it)",
                                     errors=(503,)),
    ("GET", "/get_model_info"): RouteDoc("/model_info, under SGLang's older name", errors=(503,)),
    ("GET", "/get_load"): RouteDoc("Load per data-parallel rank: requests and KV tokens held", errors=(503,)),
    ("POST", "/flush_cache"): RouteDoc("Empty the prefix cache (400 while requests run)", errors=(400, 503)),
    ("GET", "/openapi.json"): RouteDoc("This document", errors=(503,)),
    ("GET", "/metrics"): RouteDoc("Prometheus metrics", errors=(503,), media="text/plain"),
    ("GET", "/admin"): RouteDoc("Redirects to /admin/", errors=ADMIN_ERRORS, media="text/html"),
    ("GET", "/admin/"): RouteDoc("The cache inspector page", errors=ADMIN_ERRORS, media="text/html"),
    ("GET", "/admin/static/{name}"): RouteDoc("The inspector page's files", errors=(404, 503), media="text/plain"),
    ("GET", "/admin/ws"): RouteDoc("The admin websocket (upgrade; see plugins/admin/ws.py)", errors=(429, 503)),
    ("GET", "/admin/snapshot"): RouteDoc("Radix-tree nodes (a JSON body with limit: summarized)", SnapshotArgs,
                                         (400, 503)),
    ("GET", "/admin/stats"): RouteDoc("engine.stats()", errors=ADMIN_ERRORS),
    ("GET", "/admin/check"): RouteDoc("Run the integrity check now", errors=ADMIN_ERRORS),
    ("POST", "/admin/flush"): RouteDoc("Empty the prefix cache (refused while requests run)", errors=ADMIN_ERRORS),
    ("POST", "/admin/set_policy"): RouteDoc("Switch the eviction or scheduling policy", SetPolicyArgs, (400, 503)),
}
_STATUS_TEXT = {400: "Bad request", 401: "Missing or wrong key", 403: "Not a loopback client (no admin key set)",
                404: "Not found", 413: "Body too large", 429: "Queue full (or, /admin/ws, too many clients); retry later",
                503: "Starting, draining or halted"}
ADMIN_ERROR: Schema = {  # plugins/admin: {"type": "error", "message"} (the socket's error reply too)
    "type": "object", "required": ["type", "message"],
    "properties": {"type": {"enum": ["error"]}, "message": {"type": "string"}},
}


def add_routes(app: web.Application) -> None:
    app.router.add_get("/openapi.json", serve_document)


async def serve_document(request: web.Request) -> web.Response:
    return json_response(build_document(request.app))


def routes_of(app: web.Application) -> list[tuple[str, str]]:
    """(method, path pattern) of every route `app` serves, the engine routes' own included.

    HEAD routes that aiohttp adds beside each GET are left out; 503 until the engine
    routes are bound (before, their routes are not known).
    """
    engine_routes = app[ENGINE_ROUTES]
    if engine_routes.inner is None:
        raise APIError(503, "the engine is still starting", code="starting")
    found: list[tuple[str, str]] = []
    for router in (app.router, engine_routes.inner.router):
        gets = {r.resource.canonical for r in router.routes() if r.method == "GET" and r.resource is not None}
        for route in router.routes():
            if route.resource is None or route.handler == engine_routes.dispatch:
                continue  # a mount point: the inner router's routes stand for it
            path = route.resource.canonical
            if not (route.method == "HEAD" and path in gets):
                found.append((route.method, path))
    return found


def build_document(app: web.Application) -> dict[str, Any]:
    server = app[STATE].config.server
    components: Components = {}
    schema_of(ErrorBody, components)
    paths: dict[str, dict[str, Any]] = {}
    for method, path in routes_of(app):
        doc = ROUTE_DOCS.get((method, path), RouteDoc("(undocumented)"))
        paths.setdefault(path, {})[method.lower()] = operation(method, path, doc, server, components)
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "tierserve", "version": version(),
                 "description": "OpenAI-compatible and native LLM serving API, and the admin API."},
        "paths": paths,
        "components": {
            "schemas": {**components, "AdminError": ADMIN_ERROR},
            "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer", "description": "server.api_key"},
                "adminKey": {"type": "http", "scheme": "bearer",
                             "description": "server.admin_api_key (without one: loopback clients only)"},
            },
        },
    }


def operation(method: str, path: str, doc: RouteDoc, server: ServerConfig, components: Components) -> Schema:
    guard = guard_of(path)
    op: Schema = {
        "operationId": operation_id(method, path),
        "summary": doc.summary,
        "x-tierserve-auth": guard.value,
        "security": security(guard, server),
        "responses": responses(guard, doc, server),
    }
    params = re.findall(r"\{(\w+)\}", path)
    if params:
        op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params]
    if doc.body is not None:
        body = schema_of(doc.body, components)
        required = bool(components[doc.body.__name__].get("required"))
        op["requestBody"] = {"required": required, "content": {"application/json": {"schema": body}}}
    return op


def operation_id(method: str, path: str) -> str:
    """get_v1_models_model, get_admin (for /admin) and get_admin_index (for /admin/)."""
    return method.lower() + re.sub(r"[^A-Za-z0-9]+", "_", path + "index" if path.endswith("/") else path).rstrip("_")


def security(guard: Guard, server: ServerConfig) -> list[dict[str, list[str]]]:
    if guard is Guard.API_KEY and server.api_key:
        return [{"apiKey": []}]
    if guard is Guard.ADMIN_KEY and server.admin_api_key:
        return [{"adminKey": []}]
    return []  # open, or (admin without a key) loopback clients only


def responses(guard: Guard, doc: RouteDoc, server: ServerConfig) -> Schema:
    success: Schema = {doc.media: {}}
    if doc.streams:
        success["text/event-stream"] = {}
    out: Schema = {"200": {"description": "Success", "content": success}}
    statuses = set(doc.errors)
    if guard is Guard.API_KEY and server.api_key:
        statuses.add(401)
    if guard is Guard.ADMIN_KEY:
        statuses.add(401 if server.admin_api_key else 403)
    for status in sorted(statuses):
        # The admin handlers answer their own errors; the mount points' 503 is the API's.
        admin = guard is Guard.ADMIN_KEY and status != 503
        ref = "#/components/schemas/" + ("AdminError" if admin else "ErrorBody")
        out[str(status)] = {"description": _STATUS_TEXT[status],
                            "content": {"application/json": {"schema": {"$ref": ref}}}}
    return out


# --- JSON Schema from annotations ---------------------------------------------------


def schema_of(tp: Any, components: Components) -> Schema:
    """The JSON Schema of an annotation; dataclasses go to `components`, by reference."""
    if tp is Any or tp is object:
        return {}
    if tp is type(None):
        return {"type": "null"}
    if tp in _PRIMITIVES:
        return {"type": _PRIMITIVES[tp]}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if tp.__name__ not in components:
            components[tp.__name__] = {}  # placed first: a model may refer to itself
            components[tp.__name__] = model_schema(tp, components)
        return {"$ref": f"#/components/schemas/{tp.__name__}"}
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return {"enum": list(args)}
    if origin is Union or origin is types.UnionType:
        return union([schema_of(a, components) for a in args])
    if origin in (list, tuple) and (origin is list or args[1:] == (...,)):
        items = schema_of(args[0], components) if args else {}
        return {"type": "array", "items": items} if items else {"type": "array"}
    if origin is dict:
        values = schema_of(args[1], components) if args else {}
        return {"type": "object", "additionalProperties": values} if values else {"type": "object"}
    raise TypeError(f"/openapi.json: no JSON Schema for the annotation {tp!r}")


def union(parts: list[Schema]) -> Schema:
    """`{"type": [...]}` when every member is a bare type, else anyOf."""
    if all(set(p) == {"type"} and isinstance(p["type"], str) for p in parts):
        return {"type": [p["type"] for p in parts]}
    return {"anyOf": parts}


def nullable(schema: Schema) -> Schema:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {**schema, "type": [kind, "null"]} if kind != "null" else schema
    if isinstance(kind, list):
        return schema if "null" in kind else {**schema, "type": [*kind, "null"]}
    if set(schema) == {"anyOf"}:
        return {"anyOf": [*schema["anyOf"], {"type": "null"}]}
    return {"anyOf": [schema, {"type": "null"}]}


def model_schema(cls: type, components: Components) -> Schema:
    """An object schema of a dataclass's fields (plus its SAMPLING_FIELDS)."""
    props: Schema = {}
    required: list[str] = []
    for name, schema, has_default in fields_of(cls, components):
        props[name] = schema
        if not has_default:
            required.append(name)
    for name in getattr(cls, "SAMPLING_FIELDS", ()):
        props[name] = dict(next(s for n, s, _ in fields_of(SamplingParams, components) if n == name))
    out: Schema = {"type": "object", "properties": props}
    if required:
        out["required"] = required
    if cls in CLOSED_MODELS:
        out["additionalProperties"] = False
    if cls is SamplingParams:
        props.update({alias: props[name] for alias, name in _ALIASES.items()})  # max_tokens
    doc = cls.__doc__ or ""
    if doc and not doc.startswith(cls.__name__ + "("):  # not dataclass's generated one
        out["description"] = " ".join(doc.split())
    return out


def fields_of(cls: type, components: Components) -> Iterator[tuple[str, Schema, bool]]:
    """(name, schema, has a default) per field, in order."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        schema = schema_of(WIRE_TYPES.get((cls, f.name), hints[f.name]), components)
        schema = {**schema, **WIRE_SCHEMA.get((cls, f.name), {}), **f.metadata.get("schema", {})}
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if cls in CLOSED_MODELS:
            schema = nullable(schema)
        if f.default is not dataclasses.MISSING and f.default is not None:
            default = f.default
            if isinstance(default, tuple):  # a tuple field is an array, or an object (logit_bias) on the wire
                default = dict(default) if "object" in schema.get("type", ()) else list(default)
            schema["default"] = default
        yield f.name, schema, has_default
