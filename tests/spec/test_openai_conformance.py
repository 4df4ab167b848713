"""Conformance to OpenAI's own OpenAPI document (``tests/spec/openai/openapi-subset.json``), and the
faults public bug reports found in OpenAI-compatible servers, each as a kind.

Responses are validated with ``jsonschema`` against the document's components; schemathesis'
requests generated from it are sent to a real server by tests/spec/generated_requests.py.
"""
from __future__ import annotations

import json
import time

import openai
import pytest

from tests.support.http import (CHAT, COMPLETIONS, MODEL, content, error, ok, open_stream, post, request,
                                stream_chunks)
from tests.support.openai_document import DOC, conforms
from tests.support.servers import AppServer, running_server

GREEDY = {"temperature": 0}


def events(reply) -> list[dict]:
    return stream_chunks(reply.events())


# -- responses validate against the document --------------------------------------------------------
@pytest.mark.parametrize("extra", [{}, {"logprobs": True, "top_logprobs": 2}, {"n": 2, "seed": 3, "temperature": 1},
                                   {"stop": ["."]}])
def test_chat_responses_and_chunks_conform(app, extra):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, **GREEDY, **extra}
    conforms("CreateChatCompletionResponse", ok(post(app, CHAT, body)))
    chunks = events(post(app, CHAT, {**body, "stream": True, "stream_options": {"include_usage": True}}))
    for chunk in chunks:
        conforms("CreateChatCompletionStreamResponse", chunk)
    app.wait_idle()


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}, {"n": 2, "seed": 3, "temperature": 1},
                                   {"prompt": ["Hi", "Hello"]}])
def test_completion_responses_and_chunks_conform(app, extra):
    body = {"prompt": "Hi", "max_tokens": 6, **GREEDY, **extra}
    conforms("CreateCompletionResponse", ok(post(app, COMPLETIONS, body)))
    for chunk in events(post(app, COMPLETIONS, {**body, "stream": True})):
        # The document makes finish_reason a required string on every legacy completion chunk;
        # OpenAI's API (and every SDK) sends null until a choice's last chunk, and so does this
        # server (docs/api.md "API"): a choice's last chunk validates as it is, others with their
        # null finish_reason in place of a final one.
        for choice in chunk["choices"]:
            if choice["finish_reason"] is None:
                choice["finish_reason"] = "length"
        conforms("CreateCompletionResponse", chunk)
    app.wait_idle()


def test_models_conform(app):
    conforms("ListModelsResponse", json.loads(request(app, "GET", "/v1/models").body))
    conforms("Model", json.loads(request(app, "GET", f"/v1/models/{MODEL}").body))


# -- 1. numeric ranges as wide as OpenAI's --------------------------------------------------------
def _bounded_fields(component: str) -> dict[str, tuple]:
    """Every numeric request field of ``component`` with a bound: name -> (minimum, maximum)."""
    schemas = DOC["components"]["schemas"]

    def props(schema):
        out = {}
        for part in schema.get("allOf", [schema]):
            out.update(props(schemas[part["$ref"].split("/")[-1]]) if "$ref" in part else part.get("properties", {}))
        return out

    fields = {}
    for name, spec in props(schemas[component]).items():
        for option in spec.get("anyOf", [spec]):
            if option.get("type") in ("number", "integer") and ("minimum" in option or "maximum" in option):
                fields[name] = (option.get("minimum"), option.get("maximum"))
    return fields


@pytest.mark.parametrize("path,component", [(CHAT, "CreateChatCompletionRequest"),
                                            (COMPLETIONS, "CreateCompletionRequest")])
def test_every_bound_the_document_allows_is_served(app, path, component):
    fields = _bounded_fields(component)
    assert {"temperature", "top_p", "n", "presence_penalty", "frequency_penalty"} <= set(fields)
    base = {"messages": [{"role": "user", "content": "Hi"}]} if path == CHAT else {"prompt": "Hi"}
    for name, bounds in fields.items():
        for value in bounds:
            if value is None:
                continue
            body = {**base, "max_tokens": 2, name: value}
            if name == "top_logprobs":
                body["logprobs"] = True
            r = post(app, path, body)
            if name == "n" and value > app.engine.capacity:  # more choices than the server can hold
                assert "capacity" in error(r, 400, param="n")["message"]
            elif name == "best_of" and value > 1:  # listed in docs/api.md as not implemented
                error(r, 400, param="best_of")
            else:
                assert r.status == 200, (name, value, r.body[:300])
    app.wait_idle()


def test_top_p_zero_is_greedy(app):
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12}
    assert content(ok(post(app, CHAT, {**body, "top_p": 0, "temperature": 1}))) == \
        content(ok(post(app, CHAT, {**body, "temperature": 0})))


# -- 2. every accepted field takes effect, or is refused ----------------------------------------------
def test_accepted_fields_keep_their_types(app):
    base = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for field, value in (("metadata", "x"), ("metadata", {"k": {"deep": 1}}), ("user", 5), ("service_tier", 5),
                         ("service_tier", "ultra"), ("parallel_tool_calls", "yes")):  # "ultra": OpenAI's enum has none
        error(post(app, CHAT, {**base, field: value}), 400, param=field)
    error(post(app, CHAT, {**base, "stream_options": {"include_usage": True}}), 400, param="stream_options")
    error(post(app, "/infer", {"payload": "Hi", "max_tokens": 3}), 400, param="max_tokens")


def test_other_routes_and_unknown_fields_are_refused(app):
    error(post(app, COMPLETIONS, {"prompt": "Hi", "max_completion_tokens": 3}), 400, param="max_completion_tokens")
    error(post(app, COMPLETIONS, {"prompt": "Hi", "messages": []}), 400, param="messages")
    error(post(app, CHAT, {"messages": [{"role": "user", "content": "Hi"}], "prompt": "Hi"}), 400, param="prompt")
    error(post(app, CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_token": 3}), 400, param="max_token")
    r = ok(post(app, COMPLETIONS, {"prompt": "Hi", "max_tokens": 3, "user": "u-1"}))
    assert r["usage"]["completion_tokens"] <= 3


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f"}]), ("tool_choice", "required"),
    ("store", True),
    ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "mp3"}),
    ("prediction", {"type": "content", "content": "x"}), ("reasoning_effort", "low"), ("verbosity", "low"),
    ("web_search_options", {}), ("moderation", {"model": "m"})])
def test_unimplemented_chat_features_are_refused_by_name(app, field, value):
    error(post(app, CHAT, {"messages": [{"role": "user", "content": "Hi"}], field: value}), 400, param=field)


@pytest.mark.parametrize("field,value", [("tool_choice", "none"), ("response_format", {"type": "text"}),
                                         ("store", False), ("modalities", ["text"]), ("metadata", {"k": "v"}),
                                         ("service_tier", "auto"), ("service_tier", "priority"),
                                         ("verbosity", "medium"),  # OpenAI's default (it was refused on chat)
                                         ("parallel_tool_calls", True), ("logit_bias", {})])
def test_defaults_of_unimplemented_features_are_served(app, field, value):
    ok(post(app, CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, field: value}))
    app.wait_idle()


# -- 3. a trailing assistant message is continued ----------------------------------------------------
PREFILL = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."},
           {"role": "assistant", "content": "The capital of France is"}]


def test_trailing_assistant_message_is_continued(app, chat, tokenizer):
    continued = ok(post(app, CHAT, {"messages": PREFILL, "max_tokens": 8, **GREEDY}))
    # The user's turn with the generation prompt (42 tokens), then the assistant's text (5).
    assert len(chat.encode(PREFILL[:1])) == 42
    assert continued["usage"]["prompt_tokens"] == 42 + len(tokenizer.encode(PREFILL[1]["content"])) == 47
    assert not content(continued).lstrip().startswith("The capital")
    explicit = ok(post(app, CHAT, {"messages": PREFILL, "max_tokens": 8, "continue_final_message": True,
                                   "add_generation_prompt": False, **GREEDY}))
    assert content(explicit) == content(continued)
    new_turn = ok(post(app, CHAT, {"messages": PREFILL, "max_tokens": 8, "add_generation_prompt": True, **GREEDY}))
    assert new_turn["usage"]["prompt_tokens"] == 53  # the assistant turn closed, a new one opened
    error(post(app, CHAT, {"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": True}),
          400, param="continue_final_message")
    error(post(app, CHAT, {"messages": PREFILL[:1], "continue_final_message": True}), 400,
          param="continue_final_message")
    # A format holds the continuation alone, so prefix and answer were no
    # document together ('{"a":1,' + '{"a":2,"b":"123"}'). Refused, as with tools; a new turn is served.
    fmt = {"response_format": {"type": "json_object"}, "max_tokens": 4}
    for continued_too in ({}, {"continue_final_message": True}):
        err = error(post(app, CHAT, {"messages": PREFILL, **fmt, **continued_too}), 400, param="continue_final_message")
        assert "add_generation_prompt" in err["message"], err
    error(post(app, CHAT, {"messages": PREFILL, "max_tokens": 4, "structured_outputs": {"regex": "[a-z]+"}}), 400,
          param="continue_final_message")
    ok(post(app, CHAT, {"messages": PREFILL, **fmt, "add_generation_prompt": True}))
    app.wait_idle()


# -- 4. integers whose meaning changes further down ----------------------------------------------------
@pytest.mark.parametrize("seed", [4294967295, -1, 2**63 - 1, -2**63, 0])
def test_every_seed_is_reproducible(app, seed):
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12, "temperature": 1.2,
            "seed": seed}
    assert content(ok(post(app, CHAT, body))) == content(ok(post(app, CHAT, body)))


# -- 5. prompt arrays ----------------------------------------------------------------------------------
def test_prompt_in_all_four_forms(app, tokenizer):
    texts = ["Once upon a time", "The capital of France is"]
    ids = [tokenizer.encode(t, add_bos=True) for t in texts]
    by_text = ok(post(app, COMPLETIONS, {"prompt": texts, "max_tokens": 5, "n": 2, **GREEDY}))
    assert [c["index"] for c in by_text["choices"]] == [0, 1, 2, 3]
    assert by_text["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
    assert by_text["usage"]["completion_tokens"] == sum(
        ok(post(app, COMPLETIONS, {"prompt": t, "max_tokens": 5, **GREEDY}))["usage"]["completion_tokens"] * 2
        for t in texts)
    by_ids = ok(post(app, COMPLETIONS, {"prompt": ids, "max_tokens": 5, "n": 2, **GREEDY}))
    assert [c["text"] for c in by_ids["choices"]] == [c["text"] for c in by_text["choices"]]
    one = ok(post(app, COMPLETIONS, {"prompt": ids[1], "max_tokens": 5, **GREEDY}))
    assert one["choices"][0]["text"] == by_text["choices"][2]["text"]
    streamed = events(post(app, COMPLETIONS, {"prompt": texts, "max_tokens": 5, "stream": True, **GREEDY}))
    assert {c["choices"][0]["index"] for c in streamed} == {0, 1}
    for default in ({}, {"prompt": None}, {"prompt": ""}):  # OpenAI's default: "<|endoftext|>", one token
        assert ok(post(app, COMPLETIONS, {**default, "max_tokens": 2}))["usage"]["prompt_tokens"] == 1
    error(post(app, COMPLETIONS, {"prompt": [1, 10**6], "max_tokens": 2}), 400, param="prompt")
    error(post(app, COMPLETIONS, {"prompt": [[1], "x"], "max_tokens": 2}), 400, param="prompt")
    app.wait_idle()


# -- 6. CORS ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cors_app(app, tokenizer, chat):
    """The same in-process engine behind an app with CORS and two model names."""
    from dataclasses import replace

    from server.generation.pipeline import Generator
    config = replace(app.config, cors_allow_origins="*", model_id=f"{MODEL},gpt-4o-mini,org/model-x,gpt-4o-mini")
    return AppServer(config, Generator(app.engine, tokenizer, chat))


def test_cors_preflight_and_headers_on_every_response(cors_app):
    status, headers, _ = cors_app.request("OPTIONS", CHAT, None, {
        "Origin": "https://example.org", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 200 and headers["access-control-allow-origin"] == "*"
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"].lower()
    origin = {"Origin": "https://example.org", "Content-Type": "application/json"}
    for body in ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                 {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True},
                 {"messages": []}):
        status, headers, _ = cors_app.request("POST", CHAT, json.dumps(body).encode(), origin)
        assert headers["access-control-allow-origin"] == "*", (status, body)
    cors_app.wait_idle()


# -- 7. routing ---------------------------------------------------------------------------------------
def test_head_on_every_get_route_and_empty_model_is_no_route(app):
    for path in ("/v1/models", f"/v1/models/{MODEL}", "/health"):
        status, _, body = app.request("HEAD", path)
        assert status == 200 and body == b"", path
    err = error(request(app, "GET", "/v1/models/"), 404, param=None, code=None)
    assert "no route" in err["message"]


# -- 9. model names -------------------------------------------------------------------------------------
def test_model_aliases(cors_app):
    listed = json.loads(request(cors_app, "GET", "/v1/models").body)
    assert [m["id"] for m in listed["data"]] == [MODEL, "gpt-4o-mini", "org/model-x"]  # duplicates dropped
    conforms("Model", json.loads(request(cors_app, "GET", "/v1/models/org/model-x").body))
    r = ok(post(cors_app, CHAT, {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}],
                                 "max_tokens": 2}))
    assert r["model"] == "gpt-4o-mini"
    assert ok(post(cors_app, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2}))["model"] == MODEL
    error(post(cors_app, CHAT, {"model": "gpt-5", "messages": [{"role": "user", "content": "Hi"}]}), 404,
          param="model", code="model_not_found")
    cors_app.wait_idle()


# -- cheap rejection --------------------------------------------------------------------------------------
def test_huge_bodies_are_refused_before_rendering(app):
    many = {"messages": [{"role": "user", "content": "x"}] * 600}
    assert "limit of 512" in error(post(app, CHAT, many), 400, param="messages")["message"]
    huge = {"messages": [{"role": "user", "content": "word " * 12_000}]}
    err = error(post(app, CHAT, huge), 400, param="messages", code="context_length_exceeded")
    assert "at least" in err["message"]
    error(post(app, COMPLETIONS, {"prompt": "x" * 60_000}), 400, param="prompt", code="context_length_exceeded")
    short = {"messages": [{"role": "user", "content": "ab " * 13}] * 500}  # ~5 template tokens each
    assert "at least" in error(post(app, CHAT, short), 400, param="messages")["message"]
    assert "prompts" in error(post(app, COMPLETIONS, {"prompt": [[1]] * 5000}), 400, param="prompt")["message"]
    error(post(app, COMPLETIONS, {"prompt": [1] * 5000}), 400, param="prompt", code="context_length_exceeded")


# -- 8. streams are never silent (a real gunicorn server: status line timing is on the wire) ----------------
def test_queued_stream_sends_headers_at_once_and_keep_alives():
    with running_server("--max-slots", "1", "--max-queued", "2", "--max-seq-len", "256", "--workers", "1",
                        "--threads", "4", "--sse-keepalive-s", "0.2") as server:
        with open_stream(server, COMPLETIONS, {"prompt": "Once", "max_tokens": 200, "ignore_eos": True, "stream": True,
                                               **GREEDY}, timeout=60) as first:  # the blocker
            first.readline()
            end = time.monotonic() + 30  # the slot table is published at the end of the engine's step
            while (held := server.engine.slot_mailboxes()[0]) == -1:
                assert time.monotonic() < end
                time.sleep(0.005)
            with open_stream(server, COMPLETIONS, {"prompt": "Hi", "max_tokens": 3, "stream": True, **GREEDY},
                             timeout=60) as r:  # the status line, while the only slot is still the blocker's
                assert r.status == 200 and server.engine.slot_mailboxes()[0] == held
                line = r.readline()
                while line == b"\n":
                    line = r.readline()
                assert line == b": keep-alive\n" and server.engine.slot_mailboxes()[0] == held
                rest = r.read()
                assert rest.rstrip().endswith(b"data: [DONE]")
            # The OpenAI SDK reads a stream with keep-alive comments.
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
            pieces = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt="Hi", max_tokens=3,
                                                                           stream=True, temperature=0)]
            assert len(pieces) >= 1
        server.wait_idle(30)
