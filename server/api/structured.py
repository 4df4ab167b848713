"""Structured outputs: a request's ``response_format`` or ``structured_outputs`` -> the
llguidance grammar the engine holds each sequence to (``SamplingParams.grammar``;
docs/architecture.md "Grammar constraints", docs/api.md "Structured outputs").

Shapes taken (every other shape is a 400 naming the field):

- OpenAI's ``response_format`` (API reference, Chat Completions): ``{"type": "text"}`` (no
  constraint), ``{"type": "json_object"}`` (any JSON object), ``{"type": "json_schema",
  "json_schema": {"name", "description", "schema", "strict"}}``;
- instructor's and llama-cpp-python's ``{"type": "json_object", "schema": {...}}``;
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, or its JSON text), ``regex``,
  ``choice`` (a list of strings), ``grammar`` (llguidance's Lark, or llama.cpp's GBNF, which
  llguidance converts) and ``json_object`` (true).

JSON is constrained compact (no whitespace between tokens: ``whitespace_flexible`` false), so a
small model cannot spend its tokens on blank space. A schema is enforced exactly whatever
``strict`` says: a keyword llguidance cannot enforce is refused, never skipped; an object that
names its keys and says nothing of others takes no others, as llama.cpp and xgrammar read it
(:func:`engine.llama.grammar.closed_objects`).
"""
from __future__ import annotations

import re

import llguidance

from engine.errors import InvalidRequest
from engine.llama.grammar import closed_objects
from server.api import json_text

#: llguidance's JSON-schema options: compact JSON (``,`` and ``:`` with no spaces around).
JSON_OPTIONS = {"whitespace_flexible": False}
#: OpenAI's rule for ``json_schema.name``.
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_ANY_OBJECT = {"type": "object"}
_EXACT = {"lenient": False}
_VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def parse_structured(body: dict) -> tuple[str | None, str | None]:
    """``(grammar, param)``: the llguidance grammar a request's structured-output fields ask for
    and the field it came from, as precise as it goes (``response_format.json_schema.schema``,
    ``structured_outputs.regex``...; ``(None, None)``: unconstrained). Not yet checked against the
    library's compiler: that is :func:`engine.llama.grammar.check`'s (the generator runs it).

    Raises:
        InvalidRequest: a malformed shape, naming the field (``response_format.json_schema.name``...).
    """
    fmt, so = body.get("response_format"), body.get("structured_outputs")
    found = _response_format(fmt) if fmt is not None else (None, None)
    if so is not None:
        if found[0] is not None:
            raise InvalidRequest("response_format and structured_outputs cannot both ask for a format",
                                 "structured_outputs")
        found = _structured_outputs(so)
    return found


def _response_format(fmt) -> tuple[str | None, str | None]:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise InvalidRequest("response_format must be an object with a type (text, json_object or json_schema)",
                             "response_format")
    kind = fmt["type"]
    allowed = {"text": {"type"}, "json_object": {"type", "schema"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise InvalidRequest(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                             "response_format.type")
    _known(fmt, allowed[kind], "response_format")
    if kind == "text":
        return None, None
    if kind == "json_object":
        schema = fmt.get("schema")
        if schema is None:
            return _json(_ANY_OBJECT, "response_format"), "response_format"
        return _json(schema, "response_format.schema"), "response_format.schema"
    spec = fmt.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise InvalidRequest(f"{where} must be an object with a name and a schema", where)
    _known(spec, {"name", "description", "schema", "strict"}, where)
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequest(f"{where}.name must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -", f"{where}.name")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise InvalidRequest(f"{where}.description must be a string", f"{where}.description")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise InvalidRequest(f"{where}.strict must be a boolean", f"{where}.strict")
    schema = spec.get("schema")
    if schema is None:
        return _json(_ANY_OBJECT, where), where
    return _json(schema, f"{where}.schema"), f"{where}.schema"


def _structured_outputs(so) -> tuple[str, str]:
    where = "structured_outputs"
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
        return _json(value, param), param
    if kind == "json_object":
        if value is not True:
            raise InvalidRequest(f"{param} must be true", param)
        return _json(_ANY_OBJECT, param), param
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise InvalidRequest(f"{param} must be a non-empty array of non-empty strings", param)
        return llguidance.grammar_from("choice", value), param
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{param} must be a non-empty string", param)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value), param
    try:  # Lark as it is, GBNF converted (llguidance's gbnf_to_lark)
        return llguidance.grammar_from("grammar", value), param
    except ValueError as e:
        raise InvalidRequest(f"{param}: {e}", param) from None


def _json(schema, param: str) -> str:
    """The grammar of a JSON schema, its objects that name their keys closed to others
    (:func:`engine.llama.grammar.closed_objects`). A schema's ``x-guidance`` options are
    llguidance's own (whitespace, separators) and are honoured, except ``lenient``: a keyword the
    library cannot enforce is always refused, never skipped."""
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param} must be a JSON Schema (an object)", param)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(closed_objects(schema), defaults=JSON_OPTIONS,
                                                             overrides=_EXACT)
    except ValueError as e:
        raise InvalidRequest(f"{param} cannot be enforced: {e}", param) from None


def _known(obj: dict, keys: set[str], where: str) -> None:
    unknown = sorted(set(obj) - keys)
    if unknown:
        raise InvalidRequest(f"Unrecognized field {where}.{unknown[0]}", f"{where}.{unknown[0]}")
