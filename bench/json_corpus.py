"""The structured-output corpus: whether a model, held to a JSON format, writes a valid document
and stops, or walks off (issue 47). Against any OpenAI-compatible ``/v1/chat/completions``
(this server, llama.cpp's ``llama-server``), greedy (``temperature`` 0).

    python -m bench.json_corpus --url http://127.0.0.1:8080 --model local-model [--max-tokens 200]
                                [--concurrency 4] [--x-guidance '{"whitespace_flexible": false}'] [--json out.json]
    python -m bench.json_corpus --compare [--llama-server PATH] [--models smollm2,gemma]
                                [--options compact,spaces,bounded] [--json out.json]

The corpus (:data:`CORPUS`, 102 requests), by kind:

* ``json_object``: ``response_format: {"type": "json_object"}`` with a prompt that names what
  to describe (12);
* ``given``: ``json_object``, asked to reply with a given small object, written as
  ``json.dumps`` writes it (5 prompts x 5 objects): the kind that derailed SmolLM2 under
  compact JSON (``{"animal":{"dog":{"cat":{"dog":...`` until ``max_tokens``);
* ``json_schema`` requests, 5 prompts a schema: ``closed`` (flat objects, an optional key),
  ``enum``, ``array`` (of strings, of bounded integers), ``nested`` (an object in an object,
  an array of objects), ``open`` (``additionalProperties: true``, a schema of the values
  alone, a free ``{"type": "object"}`` property) and ``recursive`` (a tree of nodes through
  ``$ref``, a linked list through ``anyOf`` with null); 2 schemas each, ``open`` 3.

Each answer is judged (:func:`judge`):

* **valid**: its text parses as JSON and is an instance of the request's schema (JSON Schema
  2020-12 with format checks, the schema as sent; ``json_object``: an object); a text with a
  key repeated in one object is not valid (JSON's names should be unique, and a parser keeps
  only one of them).
* **valid and stopped**: valid, and ``finish_reason`` is ``stop``.
* **derailed**: any of: it ran to ``max_tokens`` (``finish_reason: "length"``; every request
  asks for a document of well under 100 tokens, so 200 is room enough); it nests deeper than
  the request asks (``depth``: 0 for a scalar, 1 + the deepest member for an object or array,
  so ``{"animal": "cat"}`` is 1; a request's bound is the given object's depth, the depth of
  the structure its prompt describes for a recursive schema, :data:`FREE_DEPTH` (3) for a free
  ``json_object`` and an ``open`` schema, and the schema's own bound otherwise); a key repeated
  in one object. A derailed answer may
  still be valid (``{"animal": {"name": "cat"}}`` for ``{"animal": "cat"}`` is an object).
* **nested deeper** (``deeper``): derailed by depth, an unfinished answer judged by the depth its
  text reaches (:func:`reached_depth`): the issue's derailment, a given object answered
  ``{"animal":{"dog":{"cat":{"dog":...``, is a given answer nested deeper; a repetition at the
  asked depth until ``max_tokens`` (``{"name": "cat", "age": 10, "age_in_years": 10, ...``) is not.
* **as asked** (``given`` only): the parsed document equals the given object.

``run`` returns ``{"total", "valid_and_stopped", "derailed", "deeper", "as_asked", "errors", "tokens",
"by_kind": {kind: the same counts}, "answers": [one record per request]}``; the answers come
back in :data:`CORPUS`'s order whatever the concurrency, and at temperature 0 they are the same
on every run of one server build (up to the batch's effect on llama.cpp's arithmetic).

``x_guidance`` (this server only) gives every request's schema llguidance's JSON options
(``x-guidance``: separators, whitespace), a ``json_object`` request becoming the same format
with a schema (``{"type": "object", "x-guidance": ...}``): how one server measures each of
:data:`OPTIONS`, since a schema's own options win over the server's.

``--compare`` starts the servers itself, one at a time, for each model of ``--models``
(``smollm2``: the bundled SmolLM2-135M-Instruct with its own template, on the weights the
engine computes with; ``gemma``: Gemma 3 270M with ``--chat-template``
:data:`tests.support.model.GEMMA_TEMPLATE`): this server (``--max-slots 4``, ``--deterministic``
so that a run's answers do not depend on which requests shared a batch) once per option of
``--options`` (:data:`OPTIONS`; ``compact`` is the default before issue 47, ``spaces`` the
default since), then ``llama-server`` on the same file (``-np 4 -c 8192``, its template through
``--jinja``; its JSON grammar allows a space or up to two newlines and 20 spaces or tabs
between tokens), and prints one table. Each started server gets ``--threads`` compute threads.
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jsonschema

#: llguidance's JSON layouts measured by ``--compare`` (the ``x-guidance`` of every request):
#: ``compact`` (no whitespace: the default before issue 47), ``spaces`` (``json.dumps``'
#: separators and no other whitespace: the default since, ``server.structured.schema.JSON_OPTIONS``)
#: and bounded free whitespace: ``bounded`` (up to 20 spaces or newlines between any two tokens),
#: ``indent`` (a space, or a newline and up to 20 spaces), ``indent_colon`` (``indent`` with
#: ``": "`` after every key); one separator spaced: ``colon`` (``","`` and ``": "``), ``comma``
#: (``", "`` and ``":"``).
OPTIONS = {
    "compact": {"whitespace_flexible": False},
    "spaces": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    "bounded": {"whitespace_flexible": True, "whitespace_pattern": r"[\n ]{0,20}"},
    "indent": {"whitespace_flexible": True, "whitespace_pattern": r"( |\n {0,20})?"},
    "indent_colon": {"whitespace_flexible": True, "key_separator": ": ", "item_separator": ",",
                     "whitespace_pattern": r"( |\n {0,20})?"},
    "colon": {"whitespace_flexible": False, "item_separator": ",", "key_separator": ": "},
    "comma": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ":"},
}
#: The nesting bound of a free ``json_object`` answer and of an ``open`` schema's: their prompts
#: name a thing, not a shape.
FREE_DEPTH = 3
#: The format checks of validation (``email``, ``date``...).
_FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER

_STR = {"type": "string", "maxLength": 32}

SCHEMAS = {  # kind -> name -> (schema, [(prompt, depth bound or None: the schema's)])
    "closed": {
        "person": ({"type": "object", "properties": {"name": _STR, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 120}},
                    "required": ["name", "age"], "additionalProperties": False},
                   ["Give a person's name and age as JSON.", "Who wrote Hamlet, and how old did he live to be? "
                    "Answer in JSON.", "Make up a character for a story. Reply in JSON.",
                    "Tell me about your best friend in JSON.", "Who is the oldest person you know of? Reply in JSON."]),
        "book": ({"type": "object", "properties": {"title": {"type": "string", "maxLength": 48}, "author": _STR,
                                                   "year": {"type": "integer"}},
                  "required": ["title", "author"], "additionalProperties": False},
                 ["Recommend a book. Answer in JSON.", "What is a famous novel by Jane Austen? Reply in JSON.",
                  "Name a science fiction book as JSON.", "Which book should a child read first? Answer in JSON.",
                  "Give the book Moby Dick as JSON."]),
    },
    "enum": {
        "weather": ({"type": "object", "properties": {
            "city": _STR, "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
            "temperature": {"type": "integer", "minimum": -50, "maximum": 50}},
            "required": ["city", "condition", "temperature"], "additionalProperties": False},
            ["What is the weather in Paris today? Answer in JSON.", "Describe a cold winter day in Oslo as JSON.",
             "Report the weather of a beach town in JSON.", "It is raining in London. Answer in JSON.",
             "What is the weather like in the desert? Reply in JSON."]),
        "ticket": ({"type": "object", "properties": {
            "summary": {"type": "string", "maxLength": 48}, "priority": {"enum": ["low", "medium", "high"]},
            "status": {"type": "string", "enum": ["open", "closed"]}},
            "required": ["summary", "priority", "status"], "additionalProperties": False},
            ["The login page is down. File a support ticket as JSON.", "A typo on the about page: write the "
             "ticket in JSON.", "Close the ticket about the slow search. Answer in JSON.",
             "Customers cannot pay with a card. Open a ticket in JSON.", "Write a ticket for a broken link, as JSON."]),
    },
    "array": {
        "shopping": ({"type": "object", "properties": {"items": {"type": "array", "items": _STR, "minItems": 1,
                                                                 "maxItems": 5}},
                      "required": ["items"], "additionalProperties": False},
                     ["What do I need to bake bread? Answer in JSON.", "Write a short shopping list as JSON.",
                      "List three fruits in JSON.", "What should I pack for a beach trip? Answer in JSON.",
                      "Name the primary colors as JSON."]),
        "scores": ({"type": "object", "properties": {
            "student": _STR, "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                                        "maxItems": 4}},
            "required": ["student", "scores"], "additionalProperties": False},
            ["Ann scored 90, 85 and 77 on her tests. Answer in JSON.", "Give a student's test scores as JSON.",
             "Bob got 60 and 72. Reply in JSON.", "Eve's grades: 100 and 95. Answer in JSON.",
             "Make up a student who failed one test, as JSON."]),
    },
    "nested": {
        "employee": ({"type": "object", "properties": {
            "name": _STR, "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 48},
                                                                       "city": _STR},
                                      "required": ["street", "city"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False},
            ["Give an employee and their address as JSON.", "Where does Sherlock Holmes live? Answer in JSON.",
             "Make up a customer with a home address in JSON.", "Where does the president of France live? "
             "Reply in JSON.", "Give a dentist and the address of her office as JSON."]),
        "order": ({"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1}, "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object", "properties": {"product": _STR, "quantity": {"type": "integer", "minimum": 1,
                                                                                "maximum": 99}},
                "required": ["product", "quantity"], "additionalProperties": False}}},
            "required": ["id", "lines"], "additionalProperties": False},
            ["Order 42: two apples and one pear. Write it as JSON.", "Make up a small order as JSON.",
             "An order of three notebooks. Answer in JSON.", "I bought a pizza and two sodas. Write the order in "
             "JSON.", "Order 7: one lamp. Answer in JSON."]),
    },
    "open": {
        "product": ({"type": "object", "properties": {"id": {"type": "integer"}, "name": _STR},
                     "required": ["id", "name"], "additionalProperties": True},
                    ["Describe a product with an id and a name in JSON.", "A laptop for sale: answer in JSON.",
                     "Give a product from a grocery store as JSON.", "Describe a red bicycle for sale in JSON.",
                     "A cheap phone: reply in JSON."]),
        "inventory": ({"type": "object", "additionalProperties": {"type": "integer", "minimum": 0},
                       "maxProperties": 4},
                      ["How many apples and pears are in stock? Answer in JSON, a count per fruit.",
                       "Count the pets: two cats and one dog. Reply in JSON.",
                       "Give stock counts for three items as JSON.", "We have 5 pens and 2 erasers. Answer in "
                       "JSON.", "How many books are on each shelf? Reply in JSON."]),
        "event": ({"type": "object", "properties": {"title": _STR, "details": {"type": "object"}},
                   "required": ["title", "details"], "additionalProperties": False},
                  ["A birthday party on Friday: describe it in JSON.", "Describe a concert as JSON.",
                   "A team meeting at 10 in room 4. Answer in JSON.", "Describe a wedding in JSON.",
                   "Plan a picnic as JSON."]),
    },
    "recursive": {
        "tree": ({"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 24},
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["name", "children"], "additionalProperties": False}}},
            [("A tree as JSON: a root named A whose children are B and C, which have no children.", 4),
             ("A family tree in JSON: Mary, her son Tom, and Tom's daughter Ann.", 6),
             ("A folder tree as JSON: a folder docs holding two empty folders, work and home.", 4),
             ("A tree in JSON: one node named root, with no children.", 2),
             ("A company chart as JSON: the CEO, with two managers, Kim and Lee, who have nobody under them.", 4)]),
        "list": ({"$ref": "#/$defs/cell", "$defs": {"cell": {"type": "object", "properties": {
            "value": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/cell"}, {"type": "null"}]}},
            "required": ["value", "next"], "additionalProperties": False}}},
            [("The numbers 1, 2 and 3 as a linked list in JSON.", 3), ("A linked list of 5 and 7 as JSON.", 2),
             ("A linked list holding only 42, as JSON.", 1), ("The list 10, 20 as a linked list in JSON.", 2),
             ("Write the numbers 3, 2, 1 as a linked list in JSON.", 3)]),
    },
}

FREE_PROMPTS = ["Describe a cat as a JSON object.", "Give the capital of France as JSON.",
                "What is 2 + 2? Answer in JSON.", "Describe your favourite color in JSON.",
                "Tell me about the planet Mars in JSON.", "Give a recipe's name and its cooking time as JSON.",
                "What day comes after Monday? Reply with a JSON object.", "Describe a car as JSON.",
                "Who painted the Mona Lisa? Answer in JSON.", "Describe a house as a JSON object.",
                "Summarize the weather today in JSON.", "Tell me about dogs in JSON."]
GIVEN_PROMPTS = ["Repeat this JSON object: {}", "Reply with JSON: {}", "Say {} in JSON.",
                 "Return {} as a JSON object.", "Answer with exactly {}"]
GIVEN_OBJECTS = [{"animal": "cat"}, {"color": "red", "size": 3}, {"name": "Ann", "age": 31}, {"ok": True},
                 {"tags": ["a", "b"]}]


def depth(value) -> int:
    """Nesting depth of a JSON value: 0 for a scalar, 1 + its deepest member's for an object or
    an array (``{}`` and ``[]`` are 1)."""
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


def reached_depth(text: str) -> int:
    """The deepest nesting the start of a JSON text reaches (containers open at once, brackets in
    strings not counted): an unfinished answer's lower bound on :func:`depth`
    (``{"animal":{"dog":{"cat"`` reaches 3)."""
    deepest = level = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c in "{[":
            level += 1
            deepest = max(deepest, level)
        elif c in "}]":
            level -= 1
    return deepest


def _corpus() -> list[dict]:
    """:data:`CORPUS`: ``{"kind", "name", "prompt", "schema", "json_object", "depth", "given"}``
    each (``schema`` None: any object; ``depth`` None: the schema bounds it)."""
    out = [{"kind": "json_object", "name": f"free{i}", "prompt": p, "schema": None, "json_object": True,
            "depth": FREE_DEPTH, "given": None} for i, p in enumerate(FREE_PROMPTS)]
    out += [{"kind": "given", "name": f"given{i}.{j}", "prompt": p.format(json.dumps(obj)), "schema": None,
             "json_object": True, "depth": depth(obj), "given": obj}
            for j, p in enumerate(GIVEN_PROMPTS) for i, obj in enumerate(GIVEN_OBJECTS)]
    for kind, schemas in SCHEMAS.items():
        for name, (schema, prompts) in schemas.items():
            for prompt in prompts:
                prompt, bound = prompt if isinstance(prompt, tuple) else (prompt, FREE_DEPTH if kind == "open" else None)
                out.append({"kind": kind, "name": name, "prompt": prompt, "schema": schema, "json_object": False,
                            "depth": bound, "given": None})
    return out


#: Every request of the corpus, in a fixed order.
CORPUS = _corpus()
KINDS = ("json_object", "given", *SCHEMAS)


def response_format(entry: dict, x_guidance: dict | None = None) -> dict:
    """The request's ``response_format``; with ``x_guidance``, its schema carries those options
    (a ``json_object`` request then sends the schema of any object, ``{"type": "object"}``)."""
    if entry["json_object"]:
        if x_guidance is None:
            return {"type": "json_object"}
        return {"type": "json_object", "schema": {"type": "object", "x-guidance": x_guidance}}
    schema = entry["schema"] if x_guidance is None else {**entry["schema"], "x-guidance": x_guidance}
    return {"type": "json_schema", "json_schema": {"name": entry["name"], "schema": schema, "strict": True}}


def _pairs(pairs: list) -> dict:
    """``json.loads``' object hook that raises on a key repeated in one object."""
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise _Repeated(next(k for k in keys if keys.count(k) > 1))
    return dict(pairs)


class _Repeated(ValueError):
    pass


def judge(entry: dict, text: str, finish: str | None) -> dict:
    """One answer's verdict: ``{"valid", "stopped", "derailed", "why", "as_asked"}`` (``why``:
    the reasons it derailed or is invalid, e.g. ``["length", "depth 4 > 1"]``); see the module's
    docstring for the definitions."""
    why, valid, doc = [], False, None
    if finish == "length":
        why.append("length")
    try:
        doc = json.loads(text, object_pairs_hook=_pairs)
    except _Repeated as e:
        why.append(f"repeated key {e.args[0]!r}")
    except ValueError:
        why.append("not JSON" if finish != "length" else "unfinished")
    if doc is not None:
        if entry["schema"] is None:
            valid = isinstance(doc, dict)
            if not valid:
                why.append("not an object")
        else:
            errors = list(jsonschema.Draft202012Validator(entry["schema"], format_checker=_FORMATS).iter_errors(doc))
            valid = not errors
            if errors:
                why.append(f"invalid: {errors[0].message[:80]}")
        if entry["depth"] is not None and depth(doc) > entry["depth"]:
            why.append(f"depth {depth(doc)} > {entry['depth']}")
    elif entry["depth"] is not None and reached_depth(text) > entry["depth"]:
        why.append(f"depth at least {reached_depth(text)} > {entry['depth']}")
    derailed = any(w == "length" or w.startswith(("depth", "repeated")) for w in why)
    return {"valid": valid, "stopped": finish == "stop", "derailed": derailed,
            "deeper": any(w.startswith("depth") for w in why), "why": why,
            "as_asked": entry["given"] is not None and doc == entry["given"]}


def ask(base_url: str, model: str, entry: dict, max_tokens: int, x_guidance: dict | None = None,
        timeout_s: float = 600, preface: str = "") -> dict:
    """One request of the corpus, unstreamed, greedy: ``{"finish", "text", "tokens", "error"}``
    (``error``: the HTTP status and body of a refusal, else None); ``preface``: a text before the
    prompt, in the same user message (Gemma's template takes no system message)."""
    body = {"model": model, "messages": [{"role": "user", "content": preface + entry["prompt"]}], "temperature": 0,
            "max_tokens": max_tokens, "response_format": response_format(entry, x_guidance)}
    request = urllib.request.Request(base_url.rstrip("/") + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            reply = json.load(r)
    except urllib.error.HTTPError as e:
        return {"finish": None, "text": "", "tokens": 0, "error": f"HTTP {e.code}: {e.read()[:300]!r}"}
    choice = reply["choices"][0]
    return {"finish": choice["finish_reason"], "text": choice["message"].get("content") or "",
            "tokens": (reply.get("usage") or {}).get("completion_tokens", 0), "error": None}


def _counts(records: list[dict]) -> dict:
    return {"total": len(records), "valid_and_stopped": sum(r["valid"] and r["stopped"] for r in records),
            "derailed": sum(r["derailed"] for r in records), "deeper": sum(r["deeper"] for r in records),
            "as_asked": sum(r["as_asked"] for r in records),
            "errors": sum(r["error"] is not None for r in records), "tokens": sum(r["tokens"] for r in records)}


def run(base_url: str, model: str, *, max_tokens: int = 200, concurrency: int = 4,
        x_guidance: dict | None = None, preface: str = "") -> dict:
    """Every request of :data:`CORPUS` against ``base_url`` (``http://host:port``), ``concurrency``
    at a time; the counts of the module's docstring, overall and ``by_kind``, and ``answers``
    (each request's kind, name, prompt, finish, text, tokens, error and verdict), in corpus order.

    Args:
        model: the ``model`` field sent (this server: one of its ids; llama-server: any).
        max_tokens: each request's ``max_tokens``.
        x_guidance: llguidance's JSON options given every request's schema (this server only).
        preface: a text before every prompt (the same requests in another context: a second
            sample of the model's answers, to check a finding on the first).
    """
    def one(entry):
        answer = ask(base_url, model, entry, max_tokens, x_guidance, preface=preface)
        verdict = judge(entry, answer["text"], answer["finish"])
        return {"kind": entry["kind"], "name": entry["name"], "prompt": entry["prompt"], **answer, **verdict}

    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(one, CORPUS))
    return {**_counts(answers), "by_kind": {k: _counts([a for a in answers if a["kind"] == k]) for k in KINDS},
            "answers": answers}


def summary(result: dict) -> str:
    """One line: the overall counts and ``valid_and_stopped/total`` by kind."""
    kinds = " ".join(f"{k} {v['valid_and_stopped']}/{v['total']}" for k, v in result["by_kind"].items())
    return (f"valid and stopped {result['valid_and_stopped']}/{result['total']}, derailed {result['derailed']} "
            f"(given: {result['by_kind']['given']['derailed']}, of them nested deeper "
            f"{result['by_kind']['given']['deeper']}), as asked {result['as_asked']}/"
            f"{result['by_kind']['given']['total']}, errors {result['errors']}, {result['tokens']} tokens; {kinds}")


def compare(models: list[str], options: list[str], llama_server: str | None, max_tokens: int,
            threads: int, preface: str = "") -> dict:
    """:func:`run` on this server once per option and on ``llama-server``, for each model, each
    server started alone; ``{model: {option or "llama-server": run's result}}``."""
    import os
    import subprocess

    from bench.common import wait_healthy
    from engine.config import default_model_path
    from engine.llama.library import amx_faults
    from engine.llama.weights import weights_path
    from tests.support.model import GEMMA_TEMPLATE, gemma_path
    from tests.support.servers import free_port, running_server

    paths = {"smollm2": (default_model_path(), None), "gemma": (gemma_path(), GEMMA_TEMPLATE)}
    results = {}
    for name in models:
        path, template = paths[name]
        results[name] = {}
        ours = ["--model", path, "--max-slots", "4", "--max-seq-len", "2048", "--kv-cache-tokens", "8192",
                "--workers", "1", "--engine-threads", str(threads), "--deterministic"] + (["--chat-template", template] if template else [])
        with running_server(*ours) as server:
            for option in options:
                result = run(server.url, "local-model", max_tokens=max_tokens, x_guidance=OPTIONS[option],
                             preface=preface)
                results[name][option] = result
                print(f"{name} ours {option}: {summary(result)}", flush=True)
        if llama_server:
            weights = weights_path(path, "auto")  # what the engine computes with (SmolLM2: Q8_0)
            port = free_port()
            # Where this CPU faults on AMX, the engine loads without llama.cpp's extra buffer
            # types (engine/llama/library.py); llama-server then needs the same, or it dies.
            repack = ["--no-repack"] if amx_faults(weights) else []
            chat = ["--jinja"] + (["--chat-template-file", template] if template else [])
            proc = subprocess.Popen([llama_server, "-m", weights, "--port", str(port), "-np", "4", "-c", "8192",
                                     "-t", str(threads or len(os.sched_getaffinity(0))), *repack, *chat],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_healthy(port, proc)
                result = run(f"http://127.0.0.1:{port}", "local-model", max_tokens=max_tokens, preface=preface)
            finally:
                proc.terminate()
                proc.wait(30)
            results[name]["llama-server"] = result
            print(f"{name} llama-server: {summary(result)}", flush=True)
    return results


def table(results: dict) -> str:
    """The markdown table of :func:`compare`'s results: one row per model and server/option."""
    head = ["model", "server, JSON", "valid & stopped", "derailed (given)", "as asked", "tokens",
            *(f"{k}" for k in KINDS)]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, runs in results.items():
        for option, r in runs.items():
            kinds = [f"{r['by_kind'][k]['valid_and_stopped']}/{r['by_kind'][k]['total']}" for k in KINDS]
            rows.append(f"| {model} | {option} | {r['valid_and_stopped']}/{r['total']} | {r['derailed']} "
                        f"({r['by_kind']['given']['derailed']}) | {r['as_asked']}/{r['by_kind']['given']['total']} "
                        f"| {r['tokens']} | " + " | ".join(kinds) + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.json_corpus", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="the server's base URL (http://host:port)")
    p.add_argument("--model", default="local-model", help="the model field sent")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--x-guidance", type=json.loads, default=None,
                   help="llguidance's JSON options for every schema (JSON; this server only)")
    p.add_argument("--compare", action="store_true", help="start the servers and compare (see above)")
    p.add_argument("--models", default="smollm2,gemma")
    p.add_argument("--options", default=",".join(OPTIONS), help="of " + ", ".join(OPTIONS))
    p.add_argument("--llama-server", default=None, help="a llama-server binary to compare with")
    p.add_argument("--threads", type=int, default=1, help="compute threads of each started server (0: theirs)")
    p.add_argument("--preface", default="", help="a text before every prompt (a second sample)")
    p.add_argument("--answers", action="store_true", help="print every answer")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    from bench.common import save
    if a.compare:
        results = compare(a.models.split(","), a.options.split(","), a.llama_server, a.max_tokens, a.threads,
                          a.preface)
        print(table(results))
    elif a.url:
        results = run(a.url, a.model, max_tokens=a.max_tokens, concurrency=a.concurrency, x_guidance=a.x_guidance,
                      preface=a.preface)
        print(summary(results))
    else:
        p.error("give --url or --compare")
    if a.answers:
        for model, runs in (results.items() if a.compare else [("", {"": results})]):
            for label, r in runs.items():
                for x in r["answers"]:
                    print(f"{model} {label} {x['kind']} {x['name']} {x['finish']} {x['tokens']} {x['why']} {x['text']!r}")
    save(results, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
