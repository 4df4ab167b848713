"""``bench.json_corpus``: the corpus is what its docstring says, and each verdict keeps its
definition (valid, stopped, derailed, as asked). The figures come from full runs against real
servers (bench/RESULTS.md, "JSON layout"); these checks need no model."""
from __future__ import annotations

import collections
import json

import jsonschema
import llguidance
import pytest

from bench.json_corpus import CORPUS, KINDS, OPTIONS, depth, judge, reached_depth, response_format

GIVEN = next(e for e in CORPUS if e["given"] == {"animal": "cat"})
TREE = next(e for e in CORPUS if e["name"] == "tree" and e["depth"] == 4)


def test_the_corpus_has_every_kind_and_each_schema_compiles():
    kinds = collections.Counter(e["kind"] for e in CORPUS)
    assert len(CORPUS) > 32 and set(kinds) == set(KINDS) and min(kinds.values()) >= 10, kinds
    for entry in CORPUS:
        for options in (None, *OPTIONS.values()):
            fmt = response_format(entry, options)
            schema = fmt["json_schema"]["schema"] if fmt["type"] == "json_schema" else fmt.get("schema", {})
            assert not llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema))
        if entry["given"] is not None:  # what it asks for is a valid, undeviating answer
            assert json.dumps(entry["given"]) in entry["prompt"] and depth(entry["given"]) == entry["depth"]


def test_depth_counts_containers():
    assert [depth(v) for v in (3, {}, [], {"a": "b"}, {"a": {"b": []}}, [[1], 2])] == [0, 1, 1, 1, 3, 2]
    texts = ['{"a": {"b": []}}', '{"a":{"b":{"c"', '{"a": "{[{["', '{"a": "x\\"{["', '{"a": "x\\\\", "b": [[', "", "4"]
    assert [reached_depth(t) for t in texts] == [3, 3, 1, 1, 3, 0, 0]


@pytest.mark.parametrize("entry,text,finish,verdict,why", [
    (GIVEN, '{"animal": "cat"}', "stop", (True, True, False, True), []),
    (GIVEN, '{"animal": "dog"}', "stop", (True, True, False, False), []),
    (GIVEN, '{"animal":{"dog":{"cat":{"dog":{"dog"', "length", (False, False, True, False),
     ["length", "unfinished", "depth at least 5 > 1"]),
    (GIVEN, '{"animal": "cat", "name": "cat", "age": 10, "ag', "length", (False, False, True, False),
     ["length", "unfinished"]),  # derailed at the asked depth: not nested deeper
    (GIVEN, '{"animal": {"name": "cat"}}', "stop", (True, True, True, False), ["depth 2 > 1"]),  # valid, derailed
    (GIVEN, '{"animal": "cat", "animal": "cat"}', "stop", (False, True, True, False), ["repeated key 'animal'"]),
    (GIVEN, '[1]', "stop", (False, True, False, False), ["not an object"]),
    (TREE, '{"name": "A", "children": [{"name": "B", "children": []}]}', "stop", (True, True, False, False), []),
    (TREE, '{"name": "A", "children": [{"name": "B", "children": [{"name": "C", "children": []}]}]}', "stop",
     (True, True, True, False), ["depth 6 > 4"]),
    (TREE, '{"name": "A"}', "stop", (False, True, False, False), ["invalid: 'children' is a required property"]),
    (TREE, "", None, (False, False, False, False), ["not JSON"]),  # a refusal: no answer
])
def test_verdicts(entry, text, finish, verdict, why):
    got = judge(entry, text, finish)
    assert (got["valid"], got["stopped"], got["derailed"], got["as_asked"]) == verdict and got["why"] == why, got
    assert got["deeper"] == any(w.startswith("depth") for w in why)
    if got["valid"] and entry["schema"] is not None:
        jsonschema.validate(json.loads(text), entry["schema"])
