"""Requests schemathesis generates from the two OpenAPI documents, sent to real servers: this
server's own (``server/http/openapi.json``; positive, streamed and negative cases) and OpenAI's
(``tests/spec/openai/openapi-subset.json``; positive cases).

Not collected by ``make test``: ``tests/spec/test_generated_requests.py`` runs this module in a pytest
of its own, without xdist, for two reasons:

* schemathesis gives every operation's test one node id (``generated_requests.py::test_...``,
  the operation only in the display name), and ``make test``'s ``--dist loadfile`` keeps one
  item per node id: in the suite, each of these tests ran one operation of the 5 to 8 it has.
  Here all 41 run (48 s alone on this 2-core machine).
* schemathesis builds every case of its coverage phase when pytest collects a test (7.8 CPU-s
  for these four), and each of the three xdist workers collects every file.
"""
from __future__ import annotations

import copy
import json
import pathlib

import hypothesis
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_headers_conformance, response_schema_conformance,
                                               status_code_conformance)

from server.http.openapi import load
from tests.support.http import CHAT, COMPLETIONS, MODEL, post
from tests.support.openai_document import DOC as OPENAI_DOC
from tests.support.servers import running_server

DOC = load()  # this server's document, as tests/spec/test_openapi.py checks it
#: Served by an embedding model, which the servers below but ``embed_server`` do not have.
EMBEDDINGS = "/v1/embeddings"


# -- this server's own document (tests/spec/test_openapi.py) -------------------------------------------------------
@pytest.fixture(scope="module")
def doc_server():
    """Short sequences and little capacity, so generated requests stay cheap."""
    with running_server("--max-slots", "4", "--max-queued", "4", "--max-seq-len", "128", "--workers", "2",
                        "--threads", "8") as server:
        yield server


def _pinned_document() -> dict:
    """The document, with ``model`` pinned to the served name (any other is a documented 404, but
    then little else would be generated). It is the document the server serves (test 1):
    ``schemathesis.pytest.from_fixture``, which could load it from the server, fails under pytest 9."""
    doc = copy.deepcopy(DOC)
    for name in ("CreateChatCompletionRequest", "CreateCompletionRequest", "CreateResponseRequest",
                 "CreateEmbeddingRequest", "InferRequest"):
        doc["components"]["schemas"][name]["properties"]["model"] = {"enum": [MODEL, None]}
    _pin_model_ids(doc)
    return doc


def _pin_model_ids(doc: dict) -> None:
    """Model permissions' ``model_ids`` pinned to the served name: any other is a documented 400,
    and the permissions would never be set."""
    doc["components"]["schemas"]["ProjectModelPermissionsUpdateRequest"]["properties"]["model_ids"]["items"] = \
        {"type": "string", "enum": [MODEL]}


def _cheap_document(stream: bool) -> dict:
    """A narrower document for positive cases: each generating route's token limit required and
    at most 8 (generation stays short), and ``stream`` fixed (schemathesis' coverage phase, left
    to choose, streams nearly always or nearly never). The document's if/then conditions
    (``stream_options`` and ``top_logprobs`` need ``stream``, ``logprobs``) are written as
    ``dependentSchemas`` or left out with their field: that phase generates no case for a body
    with if/then."""
    doc = _pinned_document()
    schemas = doc["components"]["schemas"]
    for name, limits in (("CreateChatCompletionRequest", ("max_tokens", "max_completion_tokens")),
                         ("CreateCompletionRequest", ("max_tokens",)), ("InferRequest", ("max_new_tokens",)),
                         ("CreateResponseRequest", ("max_output_tokens",))):
        schema, props = schemas[name], schemas[name]["properties"]
        for field in limits:
            props[field] = {"type": "integer", "minimum": props[field]["minimum"], "maximum": 8}
        schema["required"] = [*schema.get("required", []), limits[0]]
        if "stream" not in props:
            continue
        schema.pop("allOf", None)
        props["stream"] = {"const": stream}
        schema["required"].append("stream")
        if stream and "anyOf" in props["stream_options"]:
            props["stream_options"] = props["stream_options"]["anyOf"][0]
        elif stream:
            props["stream_options"] = {**props["stream_options"], "type": "object"}
        else:
            del props["stream_options"]
        if "top_logprobs" in props:
            props["top_logprobs"] = {**props["top_logprobs"], "type": "integer"}
            schema["dependentSchemas"] = {"top_logprobs": {"properties": {"logprobs": {"const": True}},
                                                           "required": ["logprobs"]}}
    return doc


def _schema(doc: dict, mode: schemathesis.GenerationMode):
    """The schema of ``doc`` generating ``mode`` cases: its coverage phase's (the documents'
    bounds, enums and variants, some 4,600 requests in this module) and 10 random ones an
    operation. The random phase costs most per request (hypothesis draws each case: 33 of the
    module's 69 client CPU-seconds with 20 an operation); the coverage phase is what finds the
    edges."""
    schema = schemathesis.openapi.from_dict(doc)
    schema.config.generation.update(modes=[mode], max_examples=10)
    return schema


# Positive: requests the document allows, generating little, streamed and not. Negative: requests
# it forbids, from the document as it is (so a forbidden value the server takes anyway is a failure).
# The Admin API's routes run against a server with an admin key (below), the others against one without.
POSITIVE = _schema(_cheap_document(stream=False), schemathesis.GenerationMode.POSITIVE).exclude(
    tag="Admin").exclude(path=EMBEDDINGS)
STREAMING = _schema(_cheap_document(stream=True), schemathesis.GenerationMode.POSITIVE).include(
    path=[CHAT, COMPLETIONS, "/v1/responses"])
NEGATIVE = _schema(_pinned_document(), schemathesis.GenerationMode.NEGATIVE).include(method="POST").exclude(
    tag="Admin").exclude(path=EMBEDDINGS)
OWN_ADMIN = _schema(_pinned_document(), schemathesis.GenerationMode.POSITIVE).include(tag="Admin")
OWN_ADMIN.config.generation.update(max_examples=2)  # the coverage phase's cases, and two random ones
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]
SETTINGS = hypothesis.settings(deadline=None, suppress_health_check=list(hypothesis.HealthCheck))


def _call(case, server) -> None:
    """One example on an idle server: a stream's mailboxes are freed just after its client read
    ``[DONE]``, and an example with ``n`` up to the server's capacity would otherwise meet a
    (correct, documented) 503 ``server_overloaded``, which ``not_a_server_error`` counts."""
    server.wait_idle(60)
    case.call_and_validate(base_url=server.url, timeout=60, checks=CHECKS)


@POSITIVE.parametrize()
@SETTINGS
def test_schemathesis_positive(case, doc_server):
    _call(case, doc_server)


@STREAMING.parametrize()
@SETTINGS
def test_schemathesis_streaming(case, doc_server):
    _call(case, doc_server)


@NEGATIVE.parametrize()
@SETTINGS
def test_schemathesis_negative(case, doc_server):
    _call(case, doc_server)


# -- OpenAI's document (tests/spec/test_openai_conformance.py) ---------------------------------------------
def _openai_pinned_document() -> dict:
    """The document with every request's ``model`` pinned to the served name."""
    doc = copy.deepcopy(OPENAI_DOC)
    schemas = doc["components"]["schemas"]
    for name in ("CreateChatCompletionRequest", "CreateCompletionRequest", "ResponseProperties"):
        for part in schemas[name].get("allOf", [schemas[name]]):
            if "model" in part.get("properties", {}):
                part["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    # Generation kept short, as in this server's document above: each generating route's token
    # limit required and at most 8. Left out, a request generates up to the sequence limit
    # (docs/api.md), and the server's decoding was most of this module's time (the legacy
    # route's cases alone took 16 of its 67 s).
    for name, fields in (("CreateChatCompletionRequest", ("max_tokens", "max_completion_tokens")),
                         ("CreateCompletionRequest", ("max_tokens",)), ("CreateResponse", ("max_output_tokens",))):
        for part in schemas[name].get("allOf", [schemas[name]]):
            if fields[0] in part.get("properties", {}):
                for field in fields:
                    part["properties"][field] = {"type": "integer", "minimum": 0, "maximum": 8}
                part["required"] = [*part.get("required", []), fields[0]]
    # The document gives a deleted response's 404 as the bare ``Error`` object; OpenAI's API (and
    # every SDK, which reads ``body["error"]``) wraps it, as every other error: {"error": Error}.
    for path in ("/responses/{response_id}",):
        for operation in doc["paths"][path].values():
            if "404" not in operation["responses"]:
                continue
            media = operation["responses"]["404"]["content"]["application/json"]
            media["schema"] = {"type": "object", "properties": {"error": media["schema"]}, "required": ["error"]}
    return doc


OPENAI = schemathesis.openapi.from_dict(_openai_pinned_document())
OPENAI.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE], max_examples=10)


@pytest.fixture(scope="module")
def small_server():
    """Short sequences and little capacity, so generated requests stay cheap; served under the one
    name the document pins ``model`` to, in requests and in responses alike (``ResponseProperties``
    holds both): a response to a request without ``model`` names the first served name."""
    with running_server("--max-slots", "4", "--max-queued", "4", "--max-seq-len", "64", "--workers", "2",
                        "--threads", "8", "--model-id", MODEL) as server:
        yield server


@OPENAI.parametrize()
@SETTINGS
def test_schemathesis_openai_document(case, small_server):
    case.call_and_validate(base_url=small_server.url + "/v1", checks=[not_a_server_error, response_schema_conformance],
                           timeout=60)


# -- OpenAI's Admin API document (server/control/, server/http/admin.py) ---------------------------------------
ADMIN_DOC = json.loads((pathlib.Path(__file__).parent / "openai" / "openapi-admin-subset.json").read_text())
ADMIN_KEY = "generated-requests-admin-key-0"
#: What the document has that the admin server does not serve: embeddings (an embedding model's,
#: below).
NOT_SERVED = ("/embeddings",)
_pin_model_ids(ADMIN_DOC)
ADMIN = schemathesis.openapi.from_dict({**ADMIN_DOC, "paths": {p: v for p, v in ADMIN_DOC["paths"].items()
                                                               if p not in NOT_SERVED}})
ADMIN.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE], max_examples=2)


@pytest.fixture(scope="module")
def admin_server():
    """A server with an admin key and its own state, and a project with a service account and a
    key, whose ids every generated request's path names (a generated id would be a 404, which
    OpenAI's document does not list)."""
    with running_server("--workers", "1", "--max-slots", "2", "--model-id", MODEL,
                        env={"ADMIN_KEYS": ADMIN_KEY}) as server:
        auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
        project = post(server, "/v1/organization/projects", {"name": "generated"}, headers=auth).json()
        account = post(server, f"/v1/organization/projects/{project['id']}/service_accounts",
                       {"name": "generated"}, headers=auth).json()
        server.ids = {"project_id": project["id"], "service_account_id": account["id"],
                      "api_key_id": account["api_key"]["id"], "rate_limit_id": f"rl-{MODEL}"}
        yield server


def _admin_call(case, server, checks) -> None:
    """``case`` with the admin key, and the path's ids those of the server's project."""
    case.path_parameters = {**(case.path_parameters or {}),
                            **{k: v for k, v in server.ids.items() if k in (case.path_parameters or {})}}
    case.headers = {**(case.headers or {}), "Authorization": f"Bearer {ADMIN_KEY}"}
    case.call_and_validate(base_url=server.url + ("/v1" if not case.path.startswith(("/v1", "/admin")) else ""),
                           checks=checks, timeout=60)


@OWN_ADMIN.parametrize()
@SETTINGS
def test_schemathesis_own_admin_routes(case, admin_server):
    """This server's document, every status it lists."""
    _admin_call(case, admin_server, CHECKS)


@ADMIN.parametrize()
@SETTINGS
def test_schemathesis_openai_admin_document(case, admin_server):
    """Every answer is no server error and, where the document lists its status, valid against it
    (a deleted key's later 404, or a 400 for a field this server refuses, it does not list)."""
    _admin_call(case, admin_server, [not_a_server_error, response_schema_conformance])


# -- embeddings: both documents against a server whose model embeds -------------------------------------------------
@pytest.fixture(scope="module")
def embed_server(tmp_path_factory, model_path):
    """The bundled model as an embedding model (mean pooling), served under the pinned name."""
    path = tmp_path_factory.mktemp("embed") / "models.toml"
    path.write_text(f'[[models]]\nnames = ["{MODEL}"]\npath = "{model_path}"\nkind = "embed"\npooling = "mean"\n'
                    'max_slots = 4\nmax_queued = 8\nmax_seq_len = 1024\nn_batch = 1024\n')
    with running_server("--models", str(path), "--workers", "1", "--threads", "8") as server:
        yield server


def _openai_embeddings_document() -> dict:
    """OpenAI's ``/embeddings`` with ``model`` pinned; its ``Embedding.embedding`` is a number array,
    but with ``encoding_format: "base64"`` OpenAI (and this server) answer the vector's bytes as a
    base64 string, which its SDK decodes."""
    doc = copy.deepcopy(ADMIN_DOC)
    schemas = doc["components"]["schemas"]
    schemas["CreateEmbeddingRequest"]["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    vector = schemas["Embedding"]["properties"]["embedding"]
    schemas["Embedding"]["properties"]["embedding"] = {"anyOf": [vector, {"type": "string"}]}
    return {**doc, "paths": {"/embeddings": doc["paths"]["/embeddings"]}}


OWN_EMBEDDINGS = _schema(_pinned_document(), schemathesis.GenerationMode.POSITIVE).include(path=EMBEDDINGS)
OWN_EMBEDDINGS_NEGATIVE = _schema(_pinned_document(), schemathesis.GenerationMode.NEGATIVE).include(path=EMBEDDINGS)
OPENAI_EMBEDDINGS = schemathesis.openapi.from_dict(_openai_embeddings_document())
OPENAI_EMBEDDINGS.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE], max_examples=10)


@OWN_EMBEDDINGS.parametrize()
@SETTINGS
def test_schemathesis_own_embeddings(case, embed_server):
    _call(case, embed_server)


@OWN_EMBEDDINGS_NEGATIVE.parametrize()
@SETTINGS
def test_schemathesis_own_embeddings_negative(case, embed_server):
    _call(case, embed_server)


@OPENAI_EMBEDDINGS.parametrize()
@SETTINGS
def test_schemathesis_openai_embeddings(case, embed_server):
    case.call_and_validate(base_url=embed_server.url + "/v1", checks=[not_a_server_error, response_schema_conformance],
                           timeout=60)
