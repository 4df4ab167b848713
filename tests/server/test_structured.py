"""Structured outputs against a real server (gunicorn, engine process, the real model):
``response_format`` json_schema / json_object (and instructor's ``schema``), vLLM's
``structured_outputs`` json / regex / choice / grammar, on chat and legacy completions, streamed
and not, n = 2, at temperature 0 and 1. Every choice that ends with ``stop`` is valid; every
other ending is ``length``. The corpus of schemas is tests/server/structured/schemas.json.

One module server; the requests of a run go concurrently, so its sequences share batches."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest

from tests.support.http import CHAT, COMPLETIONS, chat_body, post, stream_chunks
from tests.support.servers import running_server

CORPUS = json.loads((Path(__file__).parent / "structured" / "schemas.json").read_text())
MAX_TOKENS = 28
N = 2  # n > 1: every choice constrained on its own; greedy choices must be one text
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.fixture(scope="module")
def srv():
    with running_server("--max-slots", "32", "--max-seq-len", "160", "--max-queued", "40",
                        "--workers", "2", "--threads", "32", grpc=True) as s:
        yield s


def answer(srv, path: str, body: dict) -> tuple[int, dict]:
    """One request (:func:`tests.support.http.post`); a streamed one is reassembled into the
    non-streamed shape (text joined per choice, the last finish_reason), after checking every
    event is JSON, none is an error and the stream ends with one ``[DONE]``. (A stream that
    waits in the queue gets keep-alive comments: skipped.)"""
    r = post(srv, path, body, timeout=300)
    if not body.get("stream") or r.status != 200:
        return r.status, r.json()
    texts, reasons = {}, {}
    for event in stream_chunks(r.events(comments=True)):
        for c in event["choices"]:
            piece = c["delta"].get("content") if path == CHAT else c["text"]
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
            if c["finish_reason"]:
                reasons[c["index"]] = c["finish_reason"]
    key = "message" if path == CHAT else "text"
    choices = [{"index": i, "finish_reason": reasons.get(i),
                key: {"content": texts.get(i, ""), "refusal": None} if path == CHAT else texts.get(i, "")}
               for i in range(body.get("n", 1))]
    return 200, {"choices": choices}


def texts(path: str, reply: dict) -> list[tuple[str, str]]:
    """``(text, finish_reason)`` of every choice."""
    out = []
    for c in sorted(reply["choices"], key=lambda c: c["index"]):
        if path == CHAT:
            assert c["message"]["refusal"] is None
            out.append((c["message"]["content"], c["finish_reason"]))
        else:
            out.append((c["text"], c["finish_reason"]))
    return out


def run_all(srv, jobs: list[tuple[str, dict]]) -> list[list[tuple[str, str]]]:
    """Every ``(path, body)`` at once (20 threads: with n = 2, 40 sequences, more than the
    server's 32 slots, so some wait in its queue), each 200; their choices' ``(text, finish_reason)``."""
    def one(job):
        status, reply = answer(srv, *job)
        assert status == 200, (job, reply)
        return texts(job[0], reply)
    with ThreadPoolExecutor(20) as pool:
        return list(pool.map(one, jobs))


def variants(body: dict, k: int) -> list[dict]:
    """Body ``k`` with n = N, short, in one of four ways by turns (greedy or at temperature 1,
    streamed or not), and every eighth greedy both streamed and not (its texts must be equal).
    Every combination for every schema would take several times the seconds the suite can give
    this file."""
    combos = [[(0, False)], [(1, True)], [(0, True)], [(1, False)]][k % 4]
    combos += [(0, not combos[0][1])] if k % 8 == 0 else []
    return [{**body, "temperature": t, "stream": s, "n": N, "max_tokens": MAX_TOKENS, "seed": 7} for t, s in combos]


def check_endings(outputs: list[list[tuple[str, str]]], valid) -> float:
    """Every ``stop`` choice passes ``valid`` (raises otherwise); every other ending is
    ``length``. Returns the fraction that stopped."""
    stops = total = 0
    for choices in outputs:
        for text, reason in choices:
            total += 1
            assert reason in ("stop", "length"), (reason, text)
            if reason == "stop":
                stops += 1
                valid(text)
    return stops / total


def test_schema_corpus_every_stop_validates(srv):
    assert len(CORPUS) >= 50
    jobs, schemas = [], []
    for k, entry in enumerate(CORPUS):
        fmt = {"type": "json_schema", "json_schema": {"name": entry["name"], "schema": entry["schema"], "strict": True}}
        for body in variants(chat_body(f"Give one example of {entry['name'].replace('_', ' ')} as JSON.",
                                       response_format=fmt), k):
            jobs.append((CHAT, body))
            schemas.append(entry["schema"])
    outputs = run_all(srv, jobs)
    stopped, greedy = 0.0, {}
    for schema, choices, (_, body) in zip(schemas, outputs, jobs):
        validator = jsonschema.Draft202012Validator(schema, format_checker=FORMATS)
        stopped += check_endings([choices], lambda text: validator.validate(json.loads(text)))
        if body["temperature"] == 0:  # greedy: the n choices are one text, streamed or not
            assert len(set(choices)) == 1, choices
            greedy.setdefault(json.dumps(body["response_format"]), set()).add(tuple(choices))
    assert all(len(v) == 1 for v in greedy.values())  # joined deltas equal the non-streamed text
    assert stopped / len(outputs) > 0.5  # most documents are finished within MAX_TOKENS


def test_json_object_regex_and_choice_on_both_routes(srv):
    def is_object(text):
        assert isinstance(json.loads(text), dict)

    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
    choices = ["red", "green", "blue"]
    counter = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
               "additionalProperties": False}
    cases = [
        ({"response_format": {"type": "json_object"}}, is_object),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "anything"}}}, is_object),
        ({"response_format": {"type": "json_object", "schema": counter}},
         lambda t: jsonschema.validate(json.loads(t), counter)),
        ({"structured_outputs": {"json_object": True}}, is_object),
        ({"structured_outputs": {"json": json.dumps({"type": "array", "items": {"type": "integer"}, "maxItems": 3})}},
         lambda t: jsonschema.validate(json.loads(t), {"type": "array", "items": {"type": "integer"}, "maxItems": 3})),
        ({"structured_outputs": {"regex": date}}, lambda t: re.fullmatch(date, t) or pytest.fail(t)),
        ({"structured_outputs": {"choice": choices}}, lambda t: t in choices or pytest.fail(t)),
        ({"structured_outputs": {"grammar": 'start: "A" | "B" | "C"'}}, lambda t: t in "ABC" or pytest.fail(t)),
        ({"structured_outputs": {"grammar": 'root ::= ("yes" | "no") "!"'}},  # llama.cpp GBNF
         lambda t: t in ("yes!", "no!") or pytest.fail(t)),
    ]
    jobs, checks, of_case = [], [], []
    for k, (fields, valid) in enumerate(cases):
        for path, base in ((CHAT, chat_body("Answer.", **fields)), (COMPLETIONS, {"prompt": "Answer:", **fields})):
            for body in variants(base, k):
                jobs.append((path, body))
                checks.append(valid)
                of_case.append(k)
    outputs = run_all(srv, jobs)
    stopped = [check_endings([choices], valid) for choices, valid in zip(outputs, checks)]
    # regex, choice and grammar are short: they always finish within MAX_TOKENS; every JSON case
    # but a free-form json_object (which rarely closes within MAX_TOKENS) validates a document
    for k, (fields, _) in enumerate(cases[1:5], 1):
        assert any(s > 0 for s, case in zip(stopped, of_case) if case == k), fields
    assert all(s == 1.0 for s, (_, body) in zip(stopped, jobs) if "structured_outputs" in body
               and ("json" not in body["structured_outputs"] and "json_object" not in body["structured_outputs"]))
    srv.wait_idle()


def test_over_grpc(srv):
    """ChatRequest.response_format / structured_outputs: the same grammars as HTTP, unary and
    streamed, n = N, at temperature 0 and 1; a bad schema is INVALID_ARGUMENT naming the field."""
    import grpc

    from proto import inference_pb2 as pb
    from proto import inference_pb2_grpc
    from tests.support.grpc_channel import open_channel, wait_serving

    channel = open_channel(srv.grpc_port)
    wait_serving(channel)
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    person = CORPUS[0]["schema"]
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
    cases = [
        ({"response_format": pb.ResponseFormat(type="json_schema", json_schema=pb.JsonSchema(
            name="person", schema=json.dumps(person), strict=True))},
         lambda t: jsonschema.validate(json.loads(t), person)),
        ({"response_format": pb.ResponseFormat(type="json_object")}, lambda t: isinstance(json.loads(t), dict) or
         pytest.fail(t)),
        ({"structured_outputs": pb.StructuredOutputs(regex=date)}, lambda t: re.fullmatch(date, t) or pytest.fail(t)),
        ({"structured_outputs": pb.StructuredOutputs(choice=["yes", "no"])}, lambda t: t in ("yes", "no") or
         pytest.fail(t)),
    ]

    def one(job):
        fields, stream, temperature = job
        request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="A person as JSON.")], n=N,
                                 max_tokens=MAX_TOKENS, temperature=temperature, seed=7, **fields)
        if not stream:
            return [(c.text, c.finish_reason) for c in stub.ChatComplete(request, timeout=300).choices]
        texts, reasons = [""] * N, [None] * N
        for chunk in stub.ChatCompleteStream(request, timeout=300):
            texts[chunk.index] += chunk.text
            reasons[chunk.index] = chunk.finish_reason or reasons[chunk.index]
        return list(zip(texts, reasons))

    jobs = [(fields, stream, t) for fields, _ in cases for stream in (False, True) for t in (0.0, 1.0)]
    with ThreadPoolExecutor(8) as pool:
        outputs = list(pool.map(one, jobs))
    stopped = {id(fields): [] for fields, _ in cases}
    for (fields, _, _), choices in zip(jobs, outputs):
        valid = next(v for f, v in cases if f is fields)
        stopped[id(fields)].append(check_endings([choices], valid))
    # As over HTTP: most documents of a schema are finished within MAX_TOKENS (and validated);
    # regex and choice always finish. A free-form json_object rarely closes within MAX_TOKENS.
    schema, _, regex, choice = (stopped[id(fields)] for fields, _ in cases)
    assert sum(schema) / len(schema) > 0.5, schema
    assert regex == [1.0] * len(regex) and choice == [1.0] * len(choice), (regex, choice)
    bad = pb.ResponseFormat(type="json_schema", json_schema=pb.JsonSchema(name="x", schema='{"type": "strin"}'))
    with pytest.raises(grpc.RpcError) as e:
        stub.ChatComplete(pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="x")], max_tokens=4,
                                         response_format=bad), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "Invalid type" in e.value.details()
    assert ("param", "response_format.json_schema.schema") in tuple(e.value.trailing_metadata())
    channel.close()
    srv.wait_idle()


def test_an_object_that_names_its_keys_takes_no_others(srv):
    """A pydantic class's schema (instructor's, pydantic-ai's, smolagents', llm's) says nothing
    of other keys, JSON Schema leaves them open, and the model added them until its limit
    (``{"pt":[1,2],"f":[1,2,3,...`` ended by ``length``). Such an object now takes none (as
    llama.cpp's and xgrammar's converters read it), and the document ends; one that says
    ``additionalProperties: true`` still may."""
    pair = {"properties": {"pt": {"maxItems": 2, "minItems": 2, "type": "array",
                                  "prefixItems": [{"type": "integer"}, {"type": "integer"}]}},
            "required": ["pt"], "type": "object"}
    body = chat_body("Make up an example.", max_tokens=100, temperature=0,
                     response_format={"type": "json_schema", "json_schema": {"name": "WithTuple", "schema": pair}})
    status, reply = answer(srv, CHAT, body)
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop" and set(json.loads(choice["message"]["content"])) == {"pt"}, choice
    jsonschema.validate(json.loads(choice["message"]["content"]), {**pair, "additionalProperties": False})


def test_json_is_written_as_the_model_writes_it_and_ends(srv):
    """JSON comes with the separators ``json.dumps`` writes (docs/api.md "Structured outputs").
    Asked to repeat a small object, SmolLM2 held to compact JSON nested keys until its token
    limit (``{"animal":{"dog":{"cat":{"dog":...``); allowed its own spacing, it writes the object
    and ends. A schema's own ``x-guidance`` layout wins: compact, where it asks for it."""
    person = {**CORPUS[0]["schema"], "x-guidance": {"whitespace_flexible": False}}
    bodies = [chat_body('Repeat this JSON object: {"animal": "cat"}', max_tokens=40, temperature=0,
                        response_format={"type": "json_object"}),
              chat_body("Give a person's name and age as JSON.", max_tokens=40, temperature=0,
                        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": person}})]
    with ThreadPoolExecutor(2) as pool:
        (_, given), (_, compact) = pool.map(lambda body: answer(srv, CHAT, body), bodies)
    choice = given["choices"][0]
    assert choice["finish_reason"] == "stop" and given["usage"]["completion_tokens"] < 40, choice
    text = choice["message"]["content"]  # the object asked for, or one like it: one key, a string
    assert list(json.loads(text)) == ["animal"] and isinstance(json.loads(text)["animal"], str), text
    assert text == json.dumps(json.loads(text)), text
    choice = compact["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    text = choice["message"]["content"]
    jsonschema.validate(json.loads(text), CORPUS[0]["schema"])
    assert text == json.dumps(json.loads(text), separators=(",", ":")), text


def test_each_name_once_in_an_object(srv):
    """A name comes once in an object (RFC 8259 §4; engine/llama/json_keys.py): counting books
    per shelf under an open schema, the model writes a second name where its first choice is
    ``"books"`` again, and ends; asked to repeat ``"color"`` under a schema of three names, the
    name that the grammar could only finish as a repeat is refused where it starts."""
    inventory = {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}, "maxProperties": 4}
    three = {"type": "object", "patternProperties": {"^(color|size|weight)$": {"type": "string"}},
             "additionalProperties": False}
    bodies = [chat_body(prompt, max_tokens=60, temperature=0,
                        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
              for prompt, schema in (("How many books are on each shelf? Reply in JSON.", inventory),
                                     ('Repeat exactly: {"color": "black", "color": "black", "color": "black"}', three))]
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda body: answer(srv, CHAT, body), bodies))
    for (status, reply), body in zip(replies, bodies):
        assert status == 200, reply
        choice = reply["choices"][0]
        names = json.loads(choice["message"]["content"], object_pairs_hook=lambda pairs: [k for k, _ in pairs])
        assert choice["finish_reason"] == "stop" and len(names) == len(set(names)) >= 1, choice
        jsonschema.validate(json.loads(choice["message"]["content"]), body["response_format"]["json_schema"]["schema"])
    assert len(json.loads(replies[0][1]["choices"][0]["message"]["content"])) > 1
