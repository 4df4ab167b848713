"""Structured-output requests that must be refused: a malformed ``response_format`` or
``structured_outputs``, a schema or grammar the library cannot compile, one over the size
limit. Each is a 400 naming the field, with the library's message, and none reaches the engine.
The in-process app (the shared ``app`` fixture), its engine client's ``submit`` watched."""
from __future__ import annotations

import json
import time

import pytest

from tests.support.http import error, post

CHAT, LEGACY = "/v1/chat/completions", "/v1/completions"


def schema_format(schema, **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, **extra}}


REFUSED = [
    # malformed shapes
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {}}, "response_format", "with a type"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    ({"response_format": {"type": "text", "schema": {}}}, "response_format.schema", "Unrecognized"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name",
     "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name", "name"),
    ({"response_format": schema_format({}, strict="yes")}, "response_format.json_schema.strict", "boolean"),
    ({"response_format": schema_format({}, description=3)}, "response_format.json_schema.description", "string"),
    ({"response_format": schema_format({}, extra=1)}, "response_format.json_schema.extra", "Unrecognized"),
    ({"response_format": schema_format([1])}, "response_format.json_schema.schema", "JSON Schema"),
    ({"response_format": {"type": "json_object", "schema": "{}"}}, "response_format.schema", "JSON Schema"),
    ({"structured_outputs": []}, "structured_outputs", "must be an object"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "Unrecognized"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "string"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not JSON"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object", "true"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "both"),
    # what llguidance cannot compile: its message
    ({"response_format": schema_format({"type": "strin"})}, "response_format.json_schema.schema", "Invalid type"),
    ({"response_format": schema_format({"type": "string", "pattern": "(("})}, "response_format.json_schema.schema",
     "unclosed group"),
    ({"response_format": schema_format({"type": "array", "uniqueItems": True})}, "response_format.json_schema.schema",
     "uniqueItems"),
    ({"response_format": schema_format({"$ref": "#/$defs/missing"})}, "response_format.json_schema.schema",
     "does not exist"),
    ({"response_format": {"type": "json_object", "schema": {"type": "objec"}}}, "response_format.schema",
     "Invalid type"),
    ({"structured_outputs": {"json": {"minimum": "a"}}}, "structured_outputs.json", ""),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "unclosed character class"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar", "undefined_rule"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar", ""),
    # numbers JSON allows and llguidance cannot hold (beyond 64 bits): refused, never a 500
    ({"response_format": schema_format({"type": "integer", "maximum": -57175174149993036607779535485153574912})},
     "response_format.json_schema.schema", "cannot be enforced"),
    ({"response_format": schema_format({"type": "object", "x": [10 ** 30]})}, "response_format.json_schema.schema",
     "cannot be enforced"),
]


@pytest.fixture
def submits(app, monkeypatch):
    """Every sequence the engine client submits during a test."""
    seen, real = [], app.engine.submit

    def submit(*args, **kwargs):
        seen.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(app.engine, "submit", submit)
    return seen


@pytest.mark.parametrize("fields,param,message", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
@pytest.mark.parametrize("route", [CHAT, LEGACY])
def test_refused_with_400_naming_the_field(app, submits, route, fields, param, message):
    body = {"messages": [{"role": "user", "content": "hi"}]} if route == CHAT else {"prompt": "hi"}
    err = error(post(app, route, {**body, "max_tokens": 4, **fields}), 400, param=param)
    assert message in err["message"], err
    assert submits == []  # it never reached the engine


def test_a_schema_over_the_size_limit_is_refused(app, submits):
    # 40 KiB of schema: within the body limit (64 KiB), over the record's variable section (32 KiB)
    props = {f"field_{i:04d}": {"type": "string", "description": "x" * 20} for i in range(800)}
    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": schema_format(
        {"type": "object", "properties": props})}
    assert 32768 < len(json.dumps(body)) < 65536
    err = error(post(app, CHAT, body), 400, param="response_format.json_schema.schema")
    assert "--max-request-extras-bytes" in err["message"]
    assert submits == []


def test_text_format_and_strict_false_are_served(app, submits):
    for fmt in ({"type": "text"}, schema_format({"type": "object"}, strict=False)):
        r = post(app, CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": fmt})
        assert r.status == 200, r.body
    assert len(submits) == 2
    app.wait_idle()


def test_a_grammar_with_no_way_on_is_a_400(app):
    """A schema whose every instance is infinite (a required property
    of its own type) and a regex longer than the library's limits pass the front end's check but
    leave the sequence nothing to generate. That is the client's grammar, not a server fault: 400
    ``constraint_failed`` (it was a 500) naming the field the grammar came from, in the
    Responses API's terms there (a stream's ``response.failed``: ``invalid_prompt``, not
    ``server_error``), and the sequence never goes on unconstrained."""
    endless = {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                                                    "required": ["c"]}}}
    for fields, param in (({"response_format": schema_format(endless)}, "response_format.json_schema.schema"),
                          ({"structured_outputs": {"regex": "a{1000000}"}}, "structured_outputs.regex")):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, **fields}
        error(post(app, CHAT, body), 400, param=param, code="constraint_failed")
    # Text the model's vocabulary cannot spell (found by schemathesis): SmolLM2 has no token for
    # the bytes 0xF1 and 0xF2 that lead UTF-8's planes 4 to 11, so this choice has no way on either.
    unspellable = {"prompt": "x", "max_tokens": 8, "structured_outputs": {"choice": ["/\U00093d7e?", "\U0009d85b"]}}
    error(post(app, "/v1/completions", unspellable), 400, param="structured_outputs.choice", code="constraint_failed")
    body = {"input": "hi", "max_output_tokens": 16, "store": False,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": endless}}}
    error(post(app, "/v1/responses", body), 400, param="text.format.schema", code="constraint_failed")
    status, _, raw = app.request("POST", "/v1/responses", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert status == 200 and [e["type"] for e in events][-2:] == ["error", "response.failed"], events
    assert events[-2]["code"] == "constraint_failed" and events[-2]["param"] == "text.format.schema", events[-2]
    # The response's own error says whose fault it was, in ResponseErrorCode's terms (it said server_error).
    assert events[-1]["response"]["error"]["code"] == "invalid_prompt", events[-1]
    app.wait_idle()


@pytest.mark.parametrize("fields,param", [
    ({"response_format": schema_format({"$ref": "#"})}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": r"[^\s\S]"}}, "structured_outputs.regex")])
def test_a_grammar_with_no_instance_is_refused_up_front(app, submits, fields, param):
    """A schema or regex no text is an instance of (it ended with an
    empty ``stop``): the front end takes it one step over bytes and refuses it, naming the
    field, beside tools too. (Should one reach the engine, its first mask is in error and ends
    the sequence with ``constraint_failed``: engine/llama/grammar.py ``allowed``.)"""
    for extra in ({}, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields, **extra}
        err = error(post(app, CHAT, body), 400, param=param)
        assert "no text is an instance" in err["message"] or (extra and "JSON format only" in err["message"]), err
    assert submits == []


def test_a_schema_too_costly_to_check_is_refused_in_bounded_time(app, submits):
    """A string schema whose ``allOf`` holds 30 ``pattern``s (under
    2 KiB) made llguidance's check intersect their regexes for minutes and gigabytes, in the
    request's thread. The check runs in a child process (server/structured/check.py) and a
    check over its 5 s is a 400 naming the field; the next request is served."""
    slow = {"type": "string", "allOf": [{"pattern": f"^(.*a.*b.*c.*{i}.*)$"} for i in range(30)]}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    start = time.monotonic()
    err = error(post(app, CHAT, {**body, "response_format": schema_format(slow)}), 400,
                param="response_format.json_schema.schema")
    assert "could not check it within 5 s" in err["message"] and time.monotonic() - start < 30
    # The same as a tool's parameters: the tools' grammar was compiled in the request's thread
    # too (over 30 s, a worker's thread held), and is now checked as any grammar, by name.
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": slow}, "required": ["s"]}}}
    start = time.monotonic()
    err = error(post(app, CHAT, {**body, "tools": [tool], "tool_choice": "required"}), 400,
                param="tools[0].function.parameters")
    assert "could not check it within 5 s" in err["message"] and time.monotonic() - start < 30
    r = post(app, CHAT, {**body, "response_format": schema_format({"type": "object"})})
    assert r.status == 200, r.body
    assert len(submits) == 1
    app.wait_idle()


@pytest.mark.parametrize("parameters,message", [
    ({"$ref": "#"}, "no text is an instance"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 2}}, "required": ["a"]},
     "Unsatisfiable schema: required property 'a' is unsatisfiable")])
def test_a_tool_no_call_could_satisfy_is_refused_up_front_by_name(app, submits, parameters, message):
    """A function whose parameters have no instance compiled and reached the engine, which failed
    the request at the first token it refused (a Responses stream's ``response.failed`` then said
    ``server_error``); an unsatisfiable one was refused naming it, but quoting the whole Lark
    grammar. Both are now a 400 naming the function's field with the library's message about the
    schema, in the Responses API's terms there, and nothing is submitted."""
    f = {"name": "f", "parameters": parameters}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "tools": [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
                      {"type": "function", "function": f}]}
    for choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
        err = error(post(app, CHAT, {**chat, "tool_choice": choice}), 400, param="tools[1].function.parameters")
        assert message in err["message"] and "%json" not in err["message"], err
    responses = {"input": "hi", "max_output_tokens": 8, "store": False,
                 "tools": [{"type": "function", **f}]}
    for stream in (False, True):
        err = error(post(app, "/v1/responses", {**responses, "stream": stream}), 400, param="tools[0].parameters")
        assert message in err["message"], err
    assert submits == []


def test_objects_that_name_their_keys_take_no_others():
    """server.structured.schema.closed_objects: what llama.cpp's and xgrammar's converters do with an
    object that says nothing of other keys (pydantic's schemas), and no more: explicit
    ``additionalProperties`` and maps stay open, data (``const``, ``enum``) is not read as schema,
    a schema composing objects is kept as given, and the input is not changed."""
    import copy

    from server.structured.schema import closed_objects
    item = {"type": "object", "properties": {"sku": {"type": "integer"}}}
    schema = {"type": "object",
              "properties": {"items": {"type": "array", "items": item},
                             "tags": {"type": "object", "additionalProperties": {"type": "string"}},
                             "free": {"type": "object", "properties": {}, "additionalProperties": True},
                             "c": {"const": {"properties": {}}}, "e": {"enum": [{"properties": {}}]}},
              "$defs": {"P": {"patternProperties": {"^x": {}}}}}
    given = copy.deepcopy(schema)
    closed = closed_objects(schema)
    assert schema == given
    assert closed["additionalProperties"] is False
    assert closed["properties"]["items"]["items"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["additionalProperties"] == {"type": "string"}  # a map stays a map
    assert closed["properties"]["free"]["additionalProperties"] is True
    assert [closed["properties"][k] for k in "ce"] == [given["properties"][k] for k in "ce"]
    assert closed["$defs"]["P"]["additionalProperties"] is False
    for composed in ({"allOf": [item, {"properties": {"n": {}}}]},
                     {"$ref": "#/$defs/I", "properties": {"n": {}}, "$defs": {"I": item}},
                     {**schema, "anyOf": [{"required": ["items"]}]},
                     # a required key beside a union or a reference
                     {"type": "object", "required": ["a"], "anyOf": [{"properties": {"b": {}}}]},
                     {"$ref": "#/$defs/I", "required": ["y"], "$defs": {"I": item}}):
        assert closed_objects(composed) == composed
    # a required key that properties do not give is one of the keys (it was refused as unsatisfiable)
    assert closed_objects({**item, "required": ["sku", "b"]})["properties"] == {"sku": {"type": "integer"}, "b": True}
    assert closed_objects({"type": "array", "items": [item]})["items"][0]["additionalProperties"] is False  # draft 4


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
    {"type": "object", "required": ["a"], "anyOf": [{"properties": {"b": {"type": "integer"}}},
                                                    {"properties": {"c": {"type": "integer"}}}]},
    {"$defs": {"A": {"type": "object", "properties": {"x": {}}}}, "$ref": "#/$defs/A", "required": ["y"]}])
def test_schemas_closing_must_not_make_unsatisfiable_are_served(app, schema):
    """Closing objects refused these (a required key it had closed
    out) with "required property ... is unsatisfiable"; served before and again."""
    body = {"messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 4}
    assert post(app, CHAT, {**body, "response_format": schema_format(schema)}).status == 200
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    assert post(app, CHAT, {**body, "tools": [tool]}).status == 200
    app.wait_idle()


@pytest.mark.parametrize("schema", [
    {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
    {"type": "object", "properties": {"m": {"patternProperties": {"^k": {"type": "integer"}}, "minProperties": 3}}}])
def test_a_count_of_keys_that_repeated_keys_could_meet_is_refused(app, submits, schema):
    """llguidance keeps only the keys of ``properties`` unique, so
    ``{"x":1,"x":2}`` ended with ``stop`` under ``minProperties: 2`` (one key to any JSON parser).
    Refused by name, in a format and in a tool's parameters; counts that cannot be faked are served."""
    body = {"messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 4}
    err = error(post(app, CHAT, {**body, "response_format": schema_format(schema)}), 400,
                param="response_format.json_schema.schema")
    assert "minProperties" in err["message"], err
    tool = {"type": "function",
            "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": schema}}}}
    error(post(app, CHAT, {**body, "tools": [tool]}), 400, param="tools[0].function.parameters")
    assert submits == []
    fine = {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1, "maxProperties": 2}
    assert post(app, CHAT, {**body, "response_format": schema_format(fine)}).status == 200
    app.wait_idle()


def test_costly_checks_do_not_hold_the_others_past_a_checks_time():
    """Ten costly schemas at once queued behind one checker process,
    refused 5, 10, ... 30 s later, and a trivial new schema sent beside them waited 30 s. Checks
    now run in up to ``children`` processes, and one that finds them all busy for a check's time
    is a 503 (``ChecksBusy``: the server's state, not the client's schema), never a longer wait."""
    import threading

    import llguidance

    from server.structured.check import TOO_SLOW, ChecksBusy, GrammarChecker
    slow = llguidance.LLMatcher.grammar_from_json_schema(
        {"type": "string", "allOf": [{"pattern": f"^(.*a.*b.*c.*{i}.*)$"} for i in range(30)]})
    quick = llguidance.LLMatcher.grammar_from_json_schema({"type": "integer"})
    for children in (1, 2):  # a shorter wait than a check's time: all children are busy throughout
        checker = GrammarChecker(timeout_s=2.5, children=children, wait_s=0.5)
        assert checker.check(quick) == ""  # a child started and idle
        verdicts = []
        busy = [threading.Thread(target=lambda: verdicts.append(checker.check(slow))) for _ in range(children)]
        for t in busy:
            t.start()
        time.sleep(0.3)
        start = time.monotonic()
        with pytest.raises(ChecksBusy):
            checker.check(quick)
        assert time.monotonic() - start < 2
        for t in busy:
            t.join()
        assert verdicts == [TOO_SLOW.format(2.5)] * children
        assert checker.check(quick) == ""  # a new child after the killed ones
    checker = GrammarChecker(timeout_s=1.5, children=2)
    threading.Thread(target=checker.check, args=(slow,)).start()
    time.sleep(0.3)
    assert checker.check(quick) == ""  # the other child serves it meanwhile
