"""Structured-output fields -> :class:`server.structured.constraint.OutputConstraint`: a
request's ``response_format`` or ``structured_outputs`` (chat and completions), or the Responses
API's ``text.format`` (docs/api.md "Structured outputs").

Shapes taken (every other shape is a 400 naming the field, under the ``where`` each parser is
given: the client's own path):

- OpenAI's ``response_format`` (API reference, Chat Completions): ``{"type": "text"}`` (no
  constraint), ``{"type": "json_object"}`` (any JSON object), ``{"type": "json_schema",
  "json_schema": {"name", "description", "schema", "strict"}}``;
- instructor's and llama-cpp-python's ``{"type": "json_object", "schema": {...}}``;
- the Responses API's ``text.format``, flat: ``{"type": "json_schema", "name", "schema",
  "description", "strict"}``, ``{"type": "json_object"}``, ``{"type": "text"}``;
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, or its JSON text), ``regex``,
  ``choice`` (a list of strings), ``grammar`` (llguidance's Lark, or llama.cpp's GBNF, which
  llguidance converts) and ``json_object`` (true).

A schema is enforced exactly whatever ``strict`` says (``server/structured/schema.py``). Whether
llguidance can compile the constraint is the generator's check (``server/structured/check.py``).
"""
from __future__ import annotations

import re

import llguidance

from engine.errors import InvalidRequest
from server.api import json_text
from server.structured.constraint import CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, OutputConstraint
from server.structured.schema import check_layout, closed_objects

#: OpenAI's rule for a JSON schema format's ``name``.
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_ANY_OBJECT = {"type": "object"}
_VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_SPEC_KEYS = {"name", "description", "schema", "strict"}


def parse_structured(body: dict) -> OutputConstraint | None:
    """The constraint a chat or completions body's ``response_format`` or ``structured_outputs``
    asks for (None: unconstrained); at most one of them may ask for one.

    Raises:
        InvalidRequest: a malformed shape, naming the field (``response_format.json_schema.name``...).
    """
    fmt, so = body.get("response_format"), body.get("structured_outputs")
    found = parse_response_format(fmt) if fmt is not None else None
    if so is not None:
        if found is not None:
            raise InvalidRequest("response_format and structured_outputs cannot both ask for a format",
                                 "structured_outputs")
        found = parse_structured_outputs(so)
    return found


def parse_response_format(fmt, where: str = "response_format") -> OutputConstraint | None:
    """OpenAI's ``response_format`` (None for ``text``).

    Raises:
        InvalidRequest: naming the field under ``where``.
    """
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise InvalidRequest(f"{where} must be an object with a type (text, json_object or json_schema)", where)
    kind = fmt["type"]
    allowed = {"text": {"type"}, "json_object": {"type", "schema"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise InvalidRequest(f"{where}.type must be text, json_object or json_schema, got {kind!r}", f"{where}.type")
    _known(fmt, allowed[kind], where)
    if kind == "text":
        return None
    if kind == "json_object":
        schema = fmt.get("schema")
        return _json(JSON_OBJECT, _ANY_OBJECT, where) if schema is None else _json(JSON_SCHEMA, schema, f"{where}.schema")
    spec, where = fmt.get("json_schema"), f"{where}.json_schema"
    if not isinstance(spec, dict):
        raise InvalidRequest(f"{where} must be an object with a name and a schema", where)
    _known(spec, _SPEC_KEYS, where)
    return _schema_format(spec, where)


def parse_text_format(fmt, where: str = "text.format") -> OutputConstraint | None:
    """The Responses API's ``text.format`` (None for ``text``): ``response_format``'s JSON
    schema format flattened (``name``, ``schema``... beside ``type``).

    Raises:
        InvalidRequest: naming the field under ``where``.
    """
    if not isinstance(fmt, dict):
        raise InvalidRequest(f"{where} must be an object", where)
    kind = fmt.get("type")
    if kind == "text" and set(fmt) == {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return _json(JSON_OBJECT, _ANY_OBJECT, where)
    if kind == "json_schema":
        unknown = sorted(set(fmt) - {"type"} - _SPEC_KEYS)
        if unknown:
            raise InvalidRequest(f"Unrecognized {where} field: {unknown[0]}", f"{where}.{unknown[0]}")
        return _schema_format(fmt, where)
    raise InvalidRequest(f"{where} must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or a json_schema "
                         "format", where)


def _schema_format(spec: dict, where: str) -> OutputConstraint:
    """A JSON schema format's ``name``, ``description``, ``strict`` and ``schema`` (the object
    at ``where``; its keys already known)."""
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequest(f"{where}.name must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -", f"{where}.name")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise InvalidRequest(f"{where}.description must be a string", f"{where}.description")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise InvalidRequest(f"{where}.strict must be a boolean", f"{where}.strict")
    schema = spec.get("schema")
    return _json(JSON_OBJECT, _ANY_OBJECT, where) if schema is None else _json(JSON_SCHEMA, schema, f"{where}.schema")


def parse_structured_outputs(so, where: str = "structured_outputs") -> OutputConstraint:
    """vLLM's ``structured_outputs``.

    Raises:
        InvalidRequest: naming the field under ``where``.
    """
    if not isinstance(so, dict):
        raise InvalidRequest(f"{where} must be an object with one of {', '.join(_VLLM_KINDS)}", where)
    _known(so, set(_VLLM_KINDS), where)
    given = [k for k in _VLLM_KINDS if k in so]
    if len(given) != 1:
        raise InvalidRequest(f"{where} must hold exactly one of {', '.join(_VLLM_KINDS)}, got "
                             f"{', '.join(given) or 'none'}", where)
    kind, value = given[0], so[given[0]]
    param = f"{where}.{kind}"
    if kind == "json":
        if value is None:
            raise InvalidRequest(f"{param} must be a JSON Schema or its JSON text", param)
        if isinstance(value, str):
            try:
                value = json_text.loads(value)
            except ValueError as e:
                raise InvalidRequest(f"{param} is not JSON: {e}", param) from None
        return _json(JSON_SCHEMA, value, param)
    if kind == "json_object":
        if value is not True:
            raise InvalidRequest(f"{param} must be true", param)
        return _json(JSON_OBJECT, _ANY_OBJECT, param)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise InvalidRequest(f"{param} must be a non-empty array of non-empty strings", param)
        return OutputConstraint(CHOICE, tuple(value), param)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{param} must be a non-empty string", param)
    if kind == "regex":
        return OutputConstraint(REGEX, value, param)
    try:  # GBNF's conversion to Lark refuses what it cannot read (the compile is the check's)
        llguidance.grammar_from("grammar", value)
    except ValueError as e:
        raise InvalidRequest(f"{param}: {e}", param) from None
    return OutputConstraint(GRAMMAR, value, param)


def _json(kind: str, schema, param: str) -> OutputConstraint:
    """A JSON constraint of ``schema``, its objects that name their keys closed to others and its
    own layout one that writes JSON (``server/structured/schema.py``)."""
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param} must be a JSON Schema (an object)", param)
    try:
        check_layout(schema)
        return OutputConstraint(kind, closed_objects(schema), param)
    except ValueError as e:
        raise InvalidRequest(f"{param} cannot be enforced: {e}", param) from None


def _known(obj: dict, keys: set[str], where: str) -> None:
    unknown = sorted(set(obj) - keys)
    if unknown:
        raise InvalidRequest(f"Unrecognized field {where}.{unknown[0]}", f"{where}.{unknown[0]}")
