"""OpenAI's own OpenAPI document, the subset this server implements
(``tests/spec/openai/openapi-subset.json``; its README says where it comes from), and the check
that a response or an event is a valid instance of one of its components."""
from __future__ import annotations

import json
import pathlib

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

DOC = json.loads((pathlib.Path(__file__).parent.parent / "spec" / "openai" / "openapi-subset.json").read_text())


def _nullable(node):
    """OpenAPI 3.0's ``nullable: true`` (kept in places of this 3.1 document) as JSON Schema."""
    if isinstance(node, list):
        return [_nullable(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable(v) for k, v in node.items()}
    if node.pop("nullable", False) is True:
        return {"anyOf": [node, {"type": "null"}]}
    return node


REGISTRY = Registry().with_resource(
    "urn:openai", Resource.from_contents(_nullable(DOC), default_specification=DRAFT202012))


def conforms(component: str, instance) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``instance`` is a valid ``component``."""
    Draft202012Validator({"$ref": f"urn:openai#/components/schemas/{component}"}, registry=REGISTRY).validate(instance)
