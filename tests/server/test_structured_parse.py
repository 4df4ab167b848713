"""The structured-output parsers without a server (server/api/structured.py): the Responses
API's ``text.format`` refused in its own terms (what its clients were sent when it was renamed
from chat's ``response_format``), and a JSON constraint's grammar the one llguidance writes from
the client's schema with the server's options."""
from __future__ import annotations

import dataclasses
import json

import llguidance
import pytest

from engine.errors import InvalidRequest
from server.api.structured import parse_structured, parse_text_format
from server.structured.schema import EXACT, JSON_OPTIONS, LAYOUT, closed_objects, layout

TEXT_FORMAT_REFUSED = [
    (3, "text.format", "text.format must be an object"),
    ({"type": "xml"}, "text.format",
     'text.format must be {"type": "text"}, {"type": "json_object"} or a json_schema format'),
    ({"type": "json_object", "schema": {}}, "text.format",
     'text.format must be {"type": "text"}, {"type": "json_object"} or a json_schema format'),
    ({"type": "json_schema", "name": "a b", "schema": {}}, "text.format.name",
     "text.format.name must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -"),
    ({"type": "json_schema", "schema": {}}, "text.format.name",
     "text.format.name must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -"),
    ({"type": "json_schema", "name": "x", "schema": [1]}, "text.format.schema",
     "text.format.schema must be a JSON Schema (an object)"),
    ({"type": "json_schema", "name": "x", "foo": 1}, "text.format.foo", "Unrecognized text.format field: foo"),
    ({"type": "json_schema", "name": "x", "description": 3}, "text.format.description",
     "text.format.description must be a string"),
    ({"type": "json_schema", "name": "x", "strict": "y"}, "text.format.strict", "text.format.strict must be a boolean"),
    ({"type": "json_schema", "name": "x", "schema": {"type": "object", "minProperties": 3,
                                                     "patternProperties": {"a": {}}}},
     "text.format.schema", "text.format.schema cannot be enforced: minProperties above 1"),
    # a layout of the schema's own that would not write JSON: separators are literals, whitespace is JSON's
    *[({"type": "json_schema", "name": "x", "schema": {"type": "object", "x-guidance": guidance}}, "text.format.schema",
       f"text.format.schema cannot be enforced: x-guidance.{says}")
      for guidance, says in [({"key_separator": ""}, "key_separator must be ':'"),
                             ({"item_separator": ".*"}, "item_separator must be ','"),
                             ({"item_separator": ", ?"}, "item_separator must be ','"),
                             ({"item_separator": ",", "key_separator": 3}, "key_separator must be ':'"),
                             ({"whitespace_flexible": True, "whitespace_pattern": "[ a]*"}, "whitespace_pattern must"),
                             ({"whitespace_pattern": r"\s*"}, "whitespace_pattern must"),
                             ({"whitespace_pattern": "[^x]"}, "whitespace_pattern must"),
                             ({"whitespace_pattern": "[ ,]"}, "whitespace_pattern must")]],
]


@pytest.mark.parametrize("fmt,param,message", TEXT_FORMAT_REFUSED, ids=range(len(TEXT_FORMAT_REFUSED)))
def test_text_format_is_refused_in_its_own_terms(fmt, param, message):
    with pytest.raises(InvalidRequest) as e:
        parse_text_format(fmt)
    assert e.value.param == param and e.value.message.startswith(message), e.value.message


def test_text_format_constraints_name_their_field():
    assert parse_text_format({"type": "text"}) is None
    assert parse_text_format({"type": "json_object"}).param == "text.format"
    assert parse_text_format({"type": "json_schema", "name": "x"}).param == "text.format"
    found = parse_text_format({"type": "json_schema", "name": "x", "schema": {"type": "integer"}, "strict": True})
    assert (found.kind, found.param) == ("json_schema", "text.format.schema")
    chat = parse_structured({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer"}}}})
    assert chat.value == found.value and chat.param == "response_format.json_schema.schema"


@pytest.mark.parametrize("schema", [{"type": "object", "properties": {"a": {"type": "integer"}}},
                                    {"type": "string", "x-guidance": {"item_separator": ", ", "lenient": True}},
                                    {"type": "string", "x-guidance": {"coerce_one_of": True}},
                                    {"x-guidance": 3}])
def test_a_schema_grammar_is_llguidance_own_with_the_server_options(schema):
    """The options resolved as ``grammar_from_json_schema`` resolves them (defaults, the schema's
    own, then the overrides): the schema inlined beside tools means what it means alone."""
    constraint = parse_structured({"structured_outputs": {"json": schema}})
    own = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
    theirs = llguidance.LLMatcher.grammar_from_json_schema(
        closed_objects(schema), defaults={} if set(own) & set(LAYOUT) else JSON_OPTIONS, overrides=EXACT)
    ours = json.loads(constraint.grammar())["grammars"]
    assert len(ours) == 1 and ours[0]["json_schema"] == json.loads(theirs)["grammars"][0]["json_schema"]


def _walk(grammar: str, text: str) -> bool:
    """Whether ``grammar`` takes ``text`` whole (over llguidance's byte tokenizer)."""
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), grammar, log_level=0)
    return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()


PAIR = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "integer"}}},
        "required": ["a", "b"]}
SPACED, COMPACT, PRETTY = '{"a": 1, "b": [1, 2]}', '{"a":1,"b":[1,2]}', '{\n  "a": 1,\n  "b": [1, 2]\n}'


@pytest.mark.parametrize("options,takes", [
    (None, {SPACED}),  # the server's: as json.dumps writes it
    ({"coerce_one_of": True}, {SPACED}),  # an option that lays nothing out keeps the server's layout
    ({"whitespace_flexible": False}, {COMPACT}),  # the schema's own layout wins, as llguidance means it
    ({"whitespace_flexible": True}, {SPACED, COMPACT, PRETTY, '{"a":1, "b":[1, 2]}'}),
    ({"key_separator": ": "}, {SPACED, PRETTY}),  # llguidance's defaults for the rest: whitespace flexible
])
def test_json_is_written_with_the_server_separators_unless_the_schema_names_its_own(options, takes):
    schema = PAIR if options is None else {**PAIR, "x-guidance": options}
    for field in ({"response_format": {"type": "json_schema", "json_schema": {"name": "pair", "schema": schema}}},
                  {"structured_outputs": {"json": schema}}):
        grammar = parse_structured(field).grammar()
        for text in (SPACED, COMPACT, PRETTY, '{"a":1, "b":[1, 2]}'):
            assert _walk(grammar, text) == (text in takes), (options, text)
    if options is None:  # any object (json_object) too
        assert _walk(parse_structured({"response_format": {"type": "json_object"}}).grammar(), '{"animal": "cat"}')
        assert not _walk(parse_structured({"response_format": {"type": "json_object"}}).grammar(), '{"animal":"cat"}')


@pytest.mark.parametrize("separators,takes", [((", ", ":"), '{"a":1, "b":[1, 2]}'), ((",", ":"), COMPACT),
                                              ((",\n", ": "), '{"a": 1,\n"b": [1,\n2]}')])
def test_a_model_served_with_other_separators_writes_them_unless_the_schema_names_its_own(separators, takes):
    """A model's ``json_separators`` (``Generator.laid_out`` sets them on the constraint) lay
    out its JSON answers, any object's too; a schema's own layout still wins."""
    for field in ({"response_format": {"type": "json_schema", "json_schema": {"name": "pair", "schema": PAIR}}},
                  {"response_format": {"type": "json_object"}}):
        constraint = dataclasses.replace(parse_structured(field), separators=separators)
        assert constraint.schema["x-guidance"] == {**layout(separators), **EXACT}
        for text in (SPACED, COMPACT, takes):
            assert _walk(constraint.grammar(), text) == (text == takes), (separators, text)
    own = dataclasses.replace(parse_structured({"structured_outputs": {"json": {**PAIR, "x-guidance": {
        "whitespace_flexible": False}}}}), separators=separators)
    assert _walk(own.grammar(), COMPACT) and (takes == COMPACT or not _walk(own.grammar(), takes))


@pytest.mark.parametrize("pattern,text", [(r"[\n ]{0,20}", '{\n  "a": 1}'), (r"( |\n {0,20})?", '{"a":\n 1}'),
                                          (r"[\x20\t]*", '{"a":\t1}')])
def test_a_schema_whitespace_pattern_of_json_whitespace_is_honoured(pattern, text):
    schema = {"type": "object", "x-guidance": {"whitespace_flexible": True, "whitespace_pattern": pattern}}
    assert _walk(parse_structured({"structured_outputs": {"json": schema}}).grammar(), text)
