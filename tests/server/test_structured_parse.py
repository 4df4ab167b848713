"""The structured-output parsers without a server (server/api/structured.py): the Responses
API's ``text.format`` refused in its own terms (what its clients were sent when it was renamed
from chat's ``response_format``), and a JSON constraint's grammar the one llguidance writes from
the client's schema with the server's options."""
from __future__ import annotations

import json

import llguidance
import pytest

from engine.errors import InvalidRequest
from server.api.structured import parse_structured, parse_text_format
from server.structured.schema import EXACT, JSON_OPTIONS, closed_objects

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
                                    {"x-guidance": 3}])
def test_a_schema_grammar_is_llguidance_own_with_the_server_options(schema):
    """The options resolved as ``grammar_from_json_schema`` resolves them (defaults, the schema's
    own, then the overrides): the schema inlined beside tools means what it means alone."""
    constraint = parse_structured({"structured_outputs": {"json": schema}})
    theirs = llguidance.LLMatcher.grammar_from_json_schema(closed_objects(schema), defaults=JSON_OPTIONS,
                                                          overrides=EXACT)
    ours = json.loads(constraint.grammar())["grammars"]
    assert len(ours) == 1 and ours[0]["json_schema"] == json.loads(theirs)["grammars"][0]["json_schema"]
