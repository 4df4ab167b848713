"""This server's own OpenAPI document (``GET /openapi.json``, ``server/http/openapi.json``) is true.

Its routes are the app's routes (read from the Falcon app); it is a valid OpenAPI 3.1 document;
its request fields and bounds are those the parsers take; each documented status is answered
as documented (bodies, SSE chunks and headers validated with ``jsonschema``, including 401, 403,
429 and 503, which need tenants or a full server). schemathesis' requests generated from it are
sent to a real server by tests/spec/generated_requests.py.
"""
from __future__ import annotations

import configparser
import contextlib
import copy
import importlib.metadata
import json
import pathlib
import time
from dataclasses import replace

import falcon.inspect
import pytest
import schemathesis
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from engine.request import DEADLINE_MS_BOUNDS, SamplingParams
from server import errors
from server.api import requests as params
from server.api.infer import INFER_FIELDS, MAX_NEW_TOKENS_BOUNDS
from server.responses import request as responses
from server.http.openapi import admin_paths, load
from tests.support.http import CHAT, COMPLETIONS, MODEL, Reply, open_stream, parse_sse, post, request
from tests.support.servers import AppServer, admin_app, running_server

DOC = load()
ROOT = pathlib.Path(__file__).resolve().parents[2]
REGISTRY = Registry().with_resource("urn:doc", Resource.from_contents(DOC, default_specification=DRAFT202012))


def schema_of(component: str) -> dict:
    return DOC["components"]["schemas"][component]


def resolve(node: dict) -> dict:
    """``node`` with its local ``$ref`` (``#/components/...``) followed."""
    while "$ref" in node:
        target = DOC
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


def _validator(schema: dict) -> Draft202012Validator:
    # The document's "#/components/..." references resolve against the registered document.
    return Draft202012Validator(json.loads(json.dumps(schema).replace('"#/components/', '"urn:doc#/components/')),
                                registry=REGISTRY)


def app_routes(app: falcon.App) -> set[tuple[str, str]]:
    """``(path, method)`` of every responder the app's resources define (not Falcon's defaults:
    OPTIONS and 405), path templates in OpenAPI's spelling (``{model:path}`` -> ``{model}``)."""
    out = set()
    for route in falcon.inspect.inspect_routes(app):
        path = route.path.replace(":path}", "}")
        out |= {(path, m.method.lower()) for m in route.methods if not m.internal}
    return out


def document_routes(doc: dict) -> set[tuple[str, str]]:
    return {(path, method) for path, item in doc["paths"].items() for method in item
            if method in ("get", "head", "post", "put", "patch", "delete", "options", "trace")}


def conforms(path: str, method: str, reply: Reply, status: int | None = None) -> dict:
    """Check ``reply`` against the document's response for its status (``status`` when given):
    the status is listed, required headers are present and valid, and the body validates
    against the listed media type's schema (an event stream event by event: ``[DONE]``, or JSON
    valid against the event's ``contentSchema``). Returns the response object."""
    assert status is None or reply.status == status, (reply.status, reply.body[:300])
    operation = DOC["paths"][path][method.lower()]
    assert str(reply.status) in operation["responses"], (path, method, reply.status, reply.body[:300])
    response = resolve(operation["responses"][str(reply.status)])
    for name, header in response.get("headers", {}).items():
        header = resolve(header)
        value = reply.headers.get(name.lower())
        if value is None:
            assert not header.get("required"), (path, reply.status, name)
            continue
        schema = header["schema"]
        _validator(schema).validate(int(value) if schema.get("type") == "integer" else value)
    content = response.get("content", {})
    if method.upper() == "HEAD" or not content:
        assert reply.body == b"", reply.body[:200]
        return response
    media = reply.headers["content-type"].split(";")[0].strip()
    assert media in content, (path, reply.status, media)
    if media == "application/json":
        _validator(content[media]["schema"]).validate(json.loads(reply.body))
    elif media == "text/event-stream" and "event" in resolve(content[media]["schema"])["properties"]:
        data = resolve(content[media]["schema"])["properties"]["data"]  # Responses: event: and data:, no [DONE]
        for block in reply.body.decode("utf-8").split("\n\n")[:-1]:
            kind, payload = block.split("\n")
            event = json.loads(payload.removeprefix("data: "))
            assert kind == f"event: {event['type']}", block
            _validator(data["contentSchema"]).validate(event)
    elif media == "text/event-stream":
        done, payload = resolve(content[media]["schema"])["properties"]["data"]["anyOf"]
        events = parse_sse(reply.body)
        assert events[-1] == done["const"] and events.count(done["const"]) == 1
        for event in events[:-1]:
            _validator(payload["contentSchema"]).validate(event)
    return response


# -- 1. the document's routes are the app's ------------------------------------------------------------
def test_document_routes_are_the_apps_routes(app):
    served = json.loads(request(app, "GET", "/openapi.json").body)
    assert document_routes(served) == app_routes(app.client.app)
    # with metrics on, only the Admin API is left out (this app has no control plane)
    assert served == {**DOC, "paths": {p: v for p, v in DOC["paths"].items() if p not in admin_paths()}}


def test_with_admin_keys_the_whole_document_is_served(app):
    """An app over a control plane with an admin key serves every route of the document."""
    admin = admin_app(app)
    served = json.loads(request(admin, "GET", "/openapi.json").body)
    assert document_routes(served) == app_routes(admin.client.app)
    assert served == DOC


def test_without_metrics_the_document_has_no_metrics_route(app):
    for change in ({"metrics": False}, {"metrics_port": 9999}):
        other = AppServer(replace(app.config, **change), app.generator)
        served = json.loads(request(other, "GET", "/openapi.json").body)
        assert "/metrics" not in served["paths"]
        if change == {"metrics": False}:
            assert document_routes(served) == app_routes(other.client.app)


# -- 2. a valid OpenAPI 3.1 document ---------------------------------------------------------------------
def _schemas(node, where=""):
    """Every Schema Object of the document (under ``schema`` keys and ``components.schemas``)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "schema" or where.endswith("/components/schemas"):
                yield f"{where}/{key}", value
            else:
                yield from _schemas(value, f"{where}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _schemas(value, f"{where}/{i}")


def _refs(node):
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_document_is_valid_openapi_3_1():
    schemathesis.openapi.from_dict(copy.deepcopy(DOC)).validate()  # against OpenAPI 3.1's own schema
    schemas = list(_schemas(DOC))
    assert len(schemas) > 40
    for where, schema in schemas:
        try:
            Draft202012Validator.check_schema(schema)
        except Exception as e:
            raise AssertionError(where) from e
    for ref in _refs(DOC):
        assert ref.startswith("#/components/"), ref
        resolve({"$ref": ref})  # raises KeyError when it points nowhere
    ids = [op["operationId"] for item in DOC["paths"].values() for op in item.values()]
    assert len(ids) == len(set(ids))
    assert DOC["info"]["version"] == importlib.metadata.version("inference-server")


def test_document_ships_as_package_data():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert "openapi.json" in cfg["options.package_data"]["server.http"].replace(",", " ").split()


# -- 3. request fields and bounds are the parsers' --------------------------------------------------------
def test_request_fields_are_the_parsers_fields():
    assert set(schema_of("CreateChatCompletionRequest")["properties"]) == params.CHAT_FIELDS
    assert set(schema_of("CreateCompletionRequest")["properties"]) == params.COMPLETION_FIELDS
    assert set(schema_of("InferRequest")["properties"]) == INFER_FIELDS
    assert set(schema_of("CreateResponseRequest")["properties"]) == responses.FIELDS
    for component in ("CreateChatCompletionRequest", "CreateCompletionRequest", "InferRequest", "CreateResponseRequest"):
        assert schema_of(component)["additionalProperties"] is False  # an unknown field is a 400


def _bounds(prop: dict) -> tuple:
    lo = prop.get("minimum", prop.get("exclusiveMinimum"))
    return lo, prop.get("maximum"), "exclusiveMinimum" in prop, "integer" in prop["type"]


@pytest.mark.parametrize("component", ["CreateChatCompletionRequest", "CreateCompletionRequest"])
def test_numeric_bounds_are_the_parsers_bounds(component):
    props = schema_of(component)["properties"]
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty"):
        b = SamplingParams.bounds(name)
        assert _bounds(props[name]) == (b["lo"], b["hi"], b["lo_open"], b["integer"]), name
    logprobs = SamplingParams.bounds("logprobs")
    top = props["top_logprobs" if component.startswith("CreateChat") else "logprobs"]
    assert (top["minimum"], top["maximum"]) == (logprobs["lo"], logprobs["hi"])
    assert props["n"]["maximum"] == params.MAX_N and props["stop"]["anyOf"][1]["maxItems"] == params.MAX_STOPS
    deadline = DEADLINE_MS_BOUNDS
    assert _bounds(props["deadline_ms"]) == (deadline["lo"], deadline["hi"], deadline["lo_open"], False)
    # The parser's own tables (not re-stated here): fields served only at their default value.
    policy = params.CHAT if component.startswith("CreateChat") else params.COMPLETIONS
    for name, (served, _) in policy.default_only.items():
        if name in props and "enum" in props[name]:
            assert props[name]["enum"] == [*served, None], name
        elif name in props:
            assert served == [] and props[name]["type"] == "null", name
    assert _bounds(schema_of("InferRequest")["properties"]["max_new_tokens"])[:2] == \
        (MAX_NEW_TOKENS_BOUNDS["lo"], MAX_NEW_TOKENS_BOUNDS["hi"])


def test_error_types_are_the_error_contracts():
    for name, response in DOC["components"]["responses"].items():
        if name.startswith("Head"):
            continue
        status = next(int(s) for path in DOC["paths"].values() for op in path.values()
                      for s, r in op["responses"].items() if r.get("$ref", "").endswith(f"/{name}"))
        schema = resolve(response["content"]["application/json"]["schema"])
        kind = schema["allOf"][1]["properties"]["error"]["properties"]["type"]
        # a 429 is also OpenAI's insufficient_quota, whose type is its code
        assert kind.get("const", errors._TYPES[status]) == errors._TYPES[status], name
        assert kind.get("enum", [errors._TYPES[status]])[0] == errors._TYPES[status], name


def _subclasses(cls: type) -> list[type]:
    return [cls, *(c for sub in cls.__subclasses__() for c in _subclasses(sub))]


def test_error_codes_are_the_documented_codes():
    """Every error class with a ``code`` (engine/errors.py, the store's) answers with a status
    whose schema lists that code (``constraint_failed`` was left out of the 400's, and
    schemathesis found it with a ``choice`` this model's vocabulary cannot spell)."""
    from engine.errors import ConstraintFailed, RequestError

    documented: dict[int, set] = {}
    for item in DOC["paths"].values():
        for op in item.values():
            for status, response in op.get("responses", {}).items():
                content = resolve(response).get("content", {}).get("application/json")
                schema = resolve(content["schema"]) if content and int(status) >= 400 else {}
                if "allOf" in schema:  # an error object (not the store's raw 424 body, say)
                    code = schema["allOf"][1]["properties"]["error"]["properties"].get("code", {})
                    documented.setdefault(int(status), set()).update(code.get("enum", [code.get("const")]))
    checked = 0
    for cls in {*_subclasses(RequestError), *_subclasses(ConstraintFailed)}:
        if cls.code is None:
            continue
        status = errors.http_status(cls.__new__(cls))
        assert cls.code in documented[status], (cls.__name__, status, cls.code, documented[status])
        checked += 1
    assert checked >= 8


# -- 4. every documented status is answered as documented -------------------------------------------------
def test_answers_conform_in_process(app):
    """200 on every route (streams included, with logprobs and usage), and the client errors."""
    hi = [{"role": "user", "content": "Hi"}]
    for path, body in (
            (CHAT, {"messages": hi, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}),
            (CHAT, {"messages": hi, "max_tokens": 3, "n": 2, "stream": True, "stream_options": {"include_usage": True},
                    "logprobs": True, "top_logprobs": 1}),
            (CHAT, {"messages": hi, "max_tokens": 24, "stream": True, "tool_choice": "required",  # content null first
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}),
            (COMPLETIONS, {"prompt": ["Hi", "Yo"], "max_tokens": 3, "logprobs": 2}),
            (COMPLETIONS, {"prompt": [1, 2], "max_tokens": 3, "logprobs": 1, "stream": True,
                           "stream_options": {"include_usage": True}}),
            (CHAT, {"messages": hi, "max_tokens": 3, "stream": True, "stream_options": {"include_obfuscation": True}}),
            (COMPLETIONS, {"prompt": "Hi", "max_tokens": 3, "stream": True,
                           "stream_options": {"include_obfuscation": True, "include_usage": True}}),
            (COMPLETIONS, {"max_tokens": 0, "priority": "high", "deadline_ms": 5000}),
            (COMPLETIONS, {"prompt": [[1, 2, 3]], "max_tokens": 1, "echo": True, "logprobs": 1}),
            (COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, "echo": True, "logprobs": 1, "stream": True}),
            ("/tokenize", {"prompt": "Hi", "return_token_strs": True}),
            ("/tokenize", {"messages": hi, "add_generation_prompt": True}),
            ("/detokenize", {"tokens": [1, 2]}),
            ("/infer", {"payload": "Hi", "max_new_tokens": 3, "tenant_id": "x"})):
        conforms(path, "post", post(app, path, body), 200)
    for path, template in (("/v1/models", None), (f"/v1/models/{MODEL}", "/v1/models/{model}"), ("/health", None),
                           ("/health/ready", None), ("/health/live", None), ("/metrics", None),
                           ("/openapi.json", None), ("/tokenizer_info", None)):
        for method in DOC["paths"][template or path]:
            conforms(template or path, method, request(app, method.upper(), path), 200)
    for path, body, status in (
            (CHAT, {"messages": hi, "top_logprobs": 2}, 400), (CHAT, {"messages": [], "max_tokens": 2}, 400),
            (CHAT, {"messages": hi, "max_tokens": 600}, 400),  # context_length_exceeded
            (CHAT, {"messages": hi, "tools": [{"type": "function"}]}, 400), (COMPLETIONS, b"[1]", 400),
            (COMPLETIONS, {"prompt": "Hi", "model": "nope"}, 404),
            ("/tokenize", {"prompt": "Hi", "messages": hi}, 400), ("/detokenize", {"tokens": [-1]}, 400),
            ("/tokenize", {"prompt": "Hi", "model": "nope"}, 404),
            ("/infer", {"payload": "x" * 70_000}, 413)):  # over --max-body-bytes
        conforms(path, "post", post(app, path, body), status)
    conforms("/infer", "post", post(app, "/infer", b"payload=Hi", "application/x-www-form-urlencoded"), 415)
    for method in ("get", "head"):
        conforms("/v1/models/{model}", method, request(app, method.upper(), "/v1/models/nope"), 404)
    conforms("/v1/models/{model}", "get", request(app, "GET", "/v1/models/"), 404)
    # the Responses routes, stored and not
    ask = {"input": [{"role": "user", "content": "Hi"}], "max_output_tokens": 3, "metadata": {"a": "b"}}
    stored = conforms("/v1/responses", "post", reply := post(app, "/v1/responses", ask), 200) and reply.json()
    conforms("/v1/responses", "post", post(app, "/v1/responses", {**ask, "stream": True}), 200)
    conforms("/v1/responses", "post", post(app, "/v1/responses", {**ask, "stream": True, "stream_options": {
        "include_obfuscation": True}}), 200)
    conforms("/v1/responses", "post", post(app, "/v1/responses", {**ask, "background": True}), 400)
    conforms("/v1/responses", "post", post(app, "/v1/responses", {**ask, "previous_response_id": "resp_x"}), 404)
    one, items = f"/v1/responses/{stored['id']}", "/v1/responses/{response_id}/input_items"
    for method in ("get", "head"):  # HEAD was refused (405) once
        conforms("/v1/responses/{response_id}", method, request(app, method.upper(), one), 200)
        conforms(items, method, request(app, method.upper(), one + "/input_items?limit=1&order=asc"), 200)
        conforms(items, method, request(app, method.upper(), one + "/input_items?limit=0"), 400)
    conforms("/v1/responses/{response_id}", "delete", request(app, "DELETE", one), 200)
    for method in ("get", "head", "delete"):
        conforms("/v1/responses/{response_id}", method, request(app, method.upper(), one), 404)
    for reply in (request(app, "POST", "/v1/models"), request(app, "GET", "/v2/nothing")):  # 405, 404: any route
        assert reply.status in (404, 405) and reply.headers["x-request-id"]
        _validator({"$ref": "#/components/schemas/Error"}).validate(reply.json())
    app.wait_idle()


TENANTS = {"tenants": [
    {"id": "doc-metered", "api_keys": ["doc-key-metered"], "requests_per_second": {"rate": 0.001, "burst": 1}},
    {"id": "doc-free", "api_keys": ["doc-key-free"]}]}


def test_tenant_errors_conform(app):
    """401 (no key or an unknown one), 403 (another tenant's id) and 429 (over a rate)."""
    from server.generation.pipeline import Generator
    from server.tenancy.ratelimit import RateLimiter
    from server.tenancy.tenants import TenantRegistry, Tenants, parse

    generator = Generator(app.engine, app.generator.tokenizer, app.generator.template, RateLimiter(app.engine.buckets))
    tenant_app = AppServer(app.config, generator, TenantRegistry(Tenants(parse(TENANTS))))

    def call(method, path, body=None, key=None):
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        return request(tenant_app, method, path, None if body is None else json.dumps(body).encode(), headers)

    for key in (None, "unknown"):
        conforms("/v1/models", "get", call("GET", "/v1/models", key=key), 401)
        conforms("/v1/models", "head", call("HEAD", "/v1/models", key=key), 401)
        conforms(CHAT, "post", call("POST", CHAT, {"messages": []}, key), 401)
    for path in ("/health", "/health/live", "/metrics", "/openapi.json"):  # no key needed
        conforms(path, "get", call("GET", path), 200)
    conforms("/infer", "post", call("POST", "/infer", {"payload": "Hi", "tenant_id": "doc-metered"}, "doc-key-free"),
             403)
    body = {"prompt": "Hi", "max_tokens": 1}
    served = call("POST", COMPLETIONS, body, "doc-key-metered")
    conforms(COMPLETIONS, "post", served, 200)
    # an admitted answer carries the buckets as admission found them, as OpenAI's answers do (they
    # came with a 429 only; a helper's note); a tenant with no limits gets none
    assert served.headers["x-ratelimit-limit-requests"] == "1"
    assert served.headers["x-ratelimit-remaining-requests"] == "0"
    free = call("POST", COMPLETIONS, {**body, "stream": True}, "doc-key-free")
    assert free.status == 200 and not any(h.startswith("x-ratelimit") for h in free.headers)
    limited = call("POST", COMPLETIONS, body, "doc-key-metered")
    conforms(COMPLETIONS, "post", limited, 429)
    assert limited.headers["x-ratelimit-remaining-requests"] == "0"
    tenant_app.wait_idle()


@pytest.fixture(scope="module")
def full():
    """One slot and one queue place, long sequences: two requests fill it."""
    with running_server("--max-slots", "1", "--max-queued", "1", "--max-seq-len", "2048", "--workers", "1",
                        "--threads", "8") as server:
        yield server


def test_unavailable_conforms(full):
    """503 with Retry-After when every slot and queue place is taken."""
    with contextlib.ExitStack() as held:  # leaving closes both: the clients left, their sequences are cancelled
        for _ in range(2):  # a stream holds its mailbox until it ends or its client leaves
            stream = held.enter_context(open_stream(full, COMPLETIONS, {"prompt": "Once", "max_tokens": 2000,
                                                                        "ignore_eos": True, "stream": True},
                                                    timeout=60))
            assert stream.status == 200
        end = time.monotonic() + 60
        while full.engine.mailboxes_in_use() < 2:
            assert time.monotonic() < end, "the two streams were not both admitted"
            time.sleep(0.01)
        for path, body in ((CHAT, {"messages": [{"role": "user", "content": "Hi"}]}), (COMPLETIONS, {}),
                           ("/infer", {"payload": "Hi"})):
            reply = post(full, path, body)
            conforms(path, "post", reply, 503)
            assert reply.json()["error"]["code"] == "server_overloaded"
    full.wait_idle(60)
