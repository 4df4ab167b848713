"""The JSON-schema policy of structured outputs: what a client's schema means here, before
llguidance holds the model to it (docs/api.md "Structured outputs").

- Objects that name their keys take no others (:func:`closed_objects`), as llama.cpp's and
  xgrammar's converters read them.
- JSON is written as ``json.dumps`` writes it by default (:data:`SEPARATORS`: ``", "`` between
  items, ``": "`` after a key, no other whitespace): how models write JSON, so they stop where
  they would (held to compact JSON, SmolLM2 asked to repeat ``{"animal": "cat"}`` nested keys
  until its token limit), and no blank space to spend tokens on; a model may be served with
  other separators (``json_separators``, :func:`layout`); a schema's own ``x-guidance`` options
  (llguidance's: separators, whitespace) are honoured, the layout as a whole (:data:`LAYOUT`),
  except ``lenient`` (:data:`EXACT`): a keyword the library cannot enforce is refused, never
  skipped (:func:`guided`).
"""
from __future__ import annotations

import functools
import json
import re

#: The separators JSON is written with by default, as ``json.dumps``' ``separators`` (between
#: items, after a key): ``", "`` and ``": "``. Chosen by ``python -m bench.json_corpus --compare``
#: over compact JSON, one of the two spaced and bounded free whitespace, on SmolLM2 and Gemma 3
#: (docs/api.md "Structured outputs" has the table).
SEPARATORS = (", ", ": ")


def layout(separators: tuple[str, str]) -> dict:
    """llguidance's JSON-schema options that write ``separators`` (between items, after a key;
    each a regular expression to llguidance, a literal here: docs/models.md) and no other
    whitespace."""
    return {"whitespace_flexible": False, "item_separator": separators[0], "key_separator": separators[1]}


#: llguidance's JSON-schema options of tool calls' arguments, whatever the model's separators:
#: :data:`SEPARATORS`, as the chat templates show calls.
JSON_OPTIONS = layout(SEPARATORS)
#: llguidance's options that lay JSON out: a schema that names any of them lays it out alone.
LAYOUT = ("whitespace_flexible", "whitespace_pattern", "item_separator", "key_separator")
#: llguidance's JSON-schema options whatever the schema says: every keyword enforced or refused.
EXACT = {"lenient": False}
#: Each separator's punctuation (:func:`layout`'s order: between items, after a key) with at most
#: 16 characters of JSON's whitespace on each side (RFC 8259, section 2: space, tab, newline,
#: carriage return). llguidance reads a separator as a regular expression; these are literals.
_SEPARATOR = tuple(re.compile(rf"[ \t\n\r]{{0,16}}{p}[ \t\n\r]{{0,16}}") for p in (",", ":"))
#: A ``whitespace_pattern`` this server can tell matches JSON's whitespace only: those four
#: characters (as themselves, escaped, or ``\xHH``), classes of them (no ``^`` or ranges), groups,
#: alternation and quantifiers.
_WHITESPACE_PATTERN = re.compile(r"(?:\{\d{1,3}(?:,\d{0,3})?\}|\\[tnr ]|\\x(?:20|09|0[aA]|0[dD])|[ \t\n\r\[\]()|?*+])*")


def separator_error(text: object, which: int) -> str | None:
    """Why ``text`` cannot be separator ``which`` (0: between items, 1: after a key), or None:
    it must be :data:`_SEPARATOR`'s, so that the JSON written is JSON."""
    if isinstance(text, str) and _SEPARATOR[which].fullmatch(text):
        return None
    return (f"must be {',:'[which]!r} with at most 16 spaces, tabs, newlines or carriage returns on each side, "
            f"got {_shown(text)}")


def check_layout(schema: dict) -> None:
    """Refuse a schema whose own ``x-guidance`` would have llguidance write what is not JSON: a
    separator (:func:`separator_error`) or a ``whitespace_pattern`` (:data:`_WHITESPACE_PATTERN`)
    that may write other characters than JSON's whitespace.

    Raises:
        ValueError: naming the option.
    """
    own = schema.get("x-guidance")
    if not isinstance(own, dict):
        return
    for which, key in enumerate(("item_separator", "key_separator")):
        if key in own and (error := separator_error(own[key], which)):
            raise ValueError(f"x-guidance.{key} {error}")
    pattern = own.get("whitespace_pattern")
    if pattern is not None and not (isinstance(pattern, str) and _WHITESPACE_PATTERN.fullmatch(pattern)):
        raise ValueError("x-guidance.whitespace_pattern must match JSON's whitespace only (spaces, tabs, newlines, "
                         rf"carriage returns: as in [ \t\n\r]{{0,20}}), got {_shown(pattern)}")


def _shown(value: object) -> str:
    """``value`` as an error shows it: its ``repr``, cut to 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def guided(schema: dict, separators: tuple[str, str] = SEPARATORS) -> dict:
    """``schema`` with its ``x-guidance`` options resolved as llguidance's
    ``grammar_from_json_schema(schema, defaults=..., overrides=EXACT)`` resolves them (defaults,
    then the schema's own, then the overrides; a non-object ``x-guidance`` is none), where the
    defaults are ``layout(separators)`` unless the schema names any of the :data:`LAYOUT` options:
    then its layout is its own, completed by llguidance's defaults (so ``{"whitespace_flexible":
    false}`` is llguidance's compact JSON, not this server's separators without flexible
    whitespace). The schema a grammar holds, alone or inlined beside tools (``%json``). Returns a
    new dict."""
    own = schema.get("x-guidance")
    own = own if isinstance(own, dict) else {}
    defaults = {} if any(k in own for k in LAYOUT) else layout(separators)
    return {**schema, "x-guidance": {**defaults, **own, **EXACT}}


#: JSON Schema (2020-12) keywords whose value is a schema, a list of schemas, or an object of
#: schemas; any other keyword's value is data (``const``, ``enum``, ``default``...) or a number.
_SCHEMA = ("additionalProperties", "items", "additionalItems", "not", "contains", "propertyNames", "if", "then",
           "else", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: dict) -> dict:
    """``schema`` with every object schema that names its keys (``properties`` or
    ``patternProperties``) and says nothing of other keys (no ``additionalProperties`` or
    ``unevaluatedProperties``) closed to them (``additionalProperties: false``): how llama.cpp's
    converter (``json-schema-to-grammar``) and xgrammar's strict mode, vLLM's default, read such a
    schema, and what clients that write schemas from classes (pydantic: instructor,
    pydantic-ai...) mean; a small model given open objects adds keys until its token limit.
    ``additionalProperties: true`` (or a schema) keeps an object open. A name in ``required``
    that ``properties`` does not give is one of the object's keys (added as ``true``; an object
    with ``patternProperties`` and such a name is left open). A schema that composes objects
    anywhere (``allOf``, or ``properties``, ``patternProperties`` or ``required`` beside
    ``anyOf``, ``oneOf`` or ``$ref``) is kept as given: llguidance intersects the parts, and a
    part closed to another's keys would refuse them. Returns a new schema;
    ``schema`` is not changed. Memoized by the schema's JSON text (the last 256): a request's
    check and its grammar, and a client's next request with the same schema or tools, walk it
    once (a 46 KB schema takes 11 ms); the result is shared, so it is never to be changed.

    Raises:
        ValueError: ``minProperties`` above 1 where keys may come from ``additionalProperties`` or
            ``patternProperties``: llguidance keeps only the keys of ``properties`` unique, so a
            document could meet the count with one key repeated .
    """
    return _closed_objects(json.dumps(schema))


@functools.lru_cache(maxsize=256)
def _closed_objects(text: str) -> dict:
    """:func:`closed_objects` of the schema whose JSON text is ``text``."""
    schema = json.loads(text)

    def composes(node) -> bool:
        if not isinstance(node, dict):
            return False
        keys = any(k in node for k in ("properties", "patternProperties", "required"))
        return "allOf" in node or (keys and any(k in node for k in ("anyOf", "oneOf", "$ref"))) or \
            any(composes(n) for _, _, n in _subschemas(node))
    close = not composes(schema)

    def walk(node, path: str):
        if not isinstance(node, dict):
            return node  # true, false
        out = dict(node)
        for key, name, sub in _subschemas(node):
            walked = walk(sub, f"{path}/{key}" + (f"/{name}" if name is not None else ""))
            if name is None:
                out[key] = walked
            else:
                out[key] = out[key].copy() if out[key] is node[key] else out[key]
                out[key][name] = walked
        declared = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        undeclared = [k for k in node.get("required") or () if isinstance(k, str) and k not in declared]
        if close and ("properties" in node or "patternProperties" in node) and "additionalProperties" not in node \
                and "unevaluatedProperties" not in node and not (undeclared and "patternProperties" in node):
            out["additionalProperties"] = False
            if undeclared:
                out["properties"] = {**out.get("properties", {}), **dict.fromkeys(undeclared, True)}
        open_keys = out.get("additionalProperties", True) is not False or "patternProperties" in node
        least = node.get("minProperties")
        if open_keys and isinstance(least, (int, float)) and not isinstance(least, bool) and least > 1:
            raise ValueError(f"minProperties above 1 (at {path or '/'}) needs keys kept unique, and the keys "
                             "beyond properties (additionalProperties, patternProperties) are not: a repeated key "
                             "could meet the count")
        return out
    return walk(schema, "")


def _subschemas(node: dict):
    """``(keyword, index or name or None, subschema)`` for each schema directly inside ``node``."""
    for key in _SCHEMA:
        if isinstance(node.get(key), list) and key == "items":  # draft 4's tuple form
            yield from ((key, i, n) for i, n in enumerate(node[key]))
        elif key in node:
            yield key, None, node[key]
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            yield from ((key, i, n) for i, n in enumerate(node[key]))
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from ((key, k, n) for k, n in node[key].items())
