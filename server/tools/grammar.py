"""The grammar that holds a tool-calling answer to what the request allows: llguidance Lark
with each call's JSON Schema inlined (``%json``), sent as ``SamplingParams.grammar`` and
enforced per sequence by the engine (docs/architecture.md "Grammar constraints").

A call is the text ``{"name": "<name>", "arguments": <JSON of the function's parameters>}`` (key
``parameters`` for Llama 3), one Lark rule per callable function: the fixed text as literals,
the arguments a ``%json`` of the function's ``parameters`` as given (and of an object), so its
``$ref``s resolve in it alone and no two functions' definitions meet (nothing is rewritten: a
``$ref`` inside a ``const`` stays data). JSON is written with the separators ``json.dumps`` uses
(what the templates show the model).

Each format writes its own rule ``start`` (``server/tools/formats.py``); this module writes the
rest. Per ``tool_choice``:

- ``required`` / a named function (:attr:`server.tools.spec.ToolRequest.calls_only`): the
  answer is the format's call section and nothing else, one or more calls (exactly one when
  ``parallel_tool_calls`` is false);
- ``auto``: free text, and once the format's marker appears (``<tool_call>``,
  ``[TOOL_CALLS]``) the call grammar: a lazy lexeme, as in the "Tool
  calling" section of llguidance's syntax guide and llama.cpp's grammar triggers. Llama 3's calls are the whole answer, so its
  ``auto`` is text that does not start with ``{``, or calls. The generic format's ``auto`` is
  llama.cpp's: the envelope is always JSON, calls or ``{"response": <text>}``;
- ``none``: no grammar (and no tools in the prompt).

With a JSON response format (``response_format``, the Responses API's ``text.format``) under
``auto``, the answer that is not a call is a document of that format instead of free text: the
format's schema where the free text was (Hermes and Mistral: the document, or the calls
straight away; the generic format: ``{"response": <the document>}``), a ``%json`` of the
format's schema with its own options (``x-guidance``). ``required`` and a named function answer
with calls, so the format has nothing to hold there.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Callable

import llguidance

from engine.errors import InvalidRequest
from server.structured.constraint import OutputConstraint
from server.structured.schema import JSON_OPTIONS, closed_objects
from server.tools.spec import Tool, ToolRequest

if TYPE_CHECKING:  # the formats call this module's helpers
    from server.tools.formats import ToolFormat

def arguments_schema(parameters: dict) -> dict:
    """A function's arguments' schema (with ``x-guidance``'s
    :data:`~server.structured.schema.JSON_OPTIONS`: JSON as ``json.dumps`` writes it, as the
    templates show calls): its ``parameters`` as their own ``%json`` root, and an object
    (OpenAI: ``arguments`` is a JSON object) whatever else the schema says. The request's check
    reads only the root's ``type``, so ``{}`` or a root that reaches another type through
    ``$ref``, ``anyOf`` or ``allOf`` would otherwise let the model write ``null`` or ``[]``
    there; llguidance intersects the two, and one that allows no object does not compile. A root
    without a ``type`` that refers to itself (``"$ref": "#"``) stays as given: the added type would
    narrow every such reference too, so there the root is not held to an object.
    Objects that name their keys take no others (:func:`server.structured.schema.closed_objects`,
    whose ``ValueError`` this raises)."""
    own = parameters if "type" in parameters or '"$ref": "#"' in json.dumps(parameters) else \
        {**parameters, "type": "object"}
    return {**closed_objects(own), "x-guidance": JSON_OPTIONS}


def _calls(fmt: ToolFormat, tools: tuple[Tool, ...], arguments: list[dict]) -> str:
    """The Lark rules ``call`` (one call of any of ``tools``, whose arguments' schemas are
    ``arguments``) and one ``call_<i>`` / ``arguments_<i>`` pair per function."""
    rules, names = [], []
    for i, (tool, schema) in enumerate(zip(tools, arguments)):
        opening = json.dumps(f'{{"name": {json.dumps(tool.name)}, "{fmt.args_keys[0]}": ')
        rules.append(f'call_{i}: {opening} arguments_{i} "}}"\narguments_{i}: %json {json.dumps(schema)}\n')
        names.append(f"call_{i}")
    return f"call: {' | '.join(names)}\n" + "".join(rules)


def tool_grammar(fmt: ToolFormat, request: ToolRequest, specials: dict[str, int] | None = None,
                 content: dict | None = None, arguments: list[dict] | None = None) -> str:
    """The llguidance grammar (its JSON form) for ``request`` in format ``fmt``.

    Args:
        specials: the format's marker texts that are one special token of the served model
            (Qwen2.5's ``<tool_call>``, Mistral's ``[TOOL_CALLS]``) and their ids: the grammar
            names the token (``<[id]>``), since the model writes the token, not the text. Free
            text never holds a special token, so such a trigger needs no lazy lexeme.
        content: the JSON schema (with its ``x-guidance`` options) an answer that is not a call
            must follow (None: free text); see the module's docstring.
        arguments: :func:`arguments_schema` of each callable function, when the caller has them
            already (its check); made here otherwise.

    Checks nothing (:func:`checked_arguments` checks the schemas it holds).

    Raises:
        ValueError: ``content`` with a format whose calls and answers could not be told apart
            (Llama 3's: both are a JSON object); a function's parameters :func:`arguments_schema`
            refuses.
    """
    specials = specials or {}
    document = f"%json {json.dumps(content)}" if content is not None else None

    def lit(text: str) -> str:
        return f"<[{specials[text]}]>" if text in specials else json.dumps(text)

    def head(marker: str) -> str:  # free text up to the marker, the marker included
        return (f"head: TEXT {lit(marker)}\n" if marker in specials else
                f"head[lazy]: TEXT {lit(marker)}\n") + "TEXT: /(.|\\n)*/\n"
    start = fmt.grammar(request, lit, head, document)
    tools = request.callable()
    if arguments is None:
        arguments = [arguments_schema(t.parameters) for t in tools]
    return llguidance.grammar_from("lark", f"%llguidance {{}}\n{start}{_calls(fmt, tools, arguments)}")


def checked_arguments(request: ToolRequest, content: OutputConstraint | None,
                      check_schemas: Callable[[list[dict]], tuple[int, str]]) -> list[dict]:
    """:func:`arguments_schema` of each function the model may call, checked with the JSON
    format's schema (``content``, checked first) by ``check_schemas`` (a memo of
    :func:`server.structured.check.check_schemas`: one build for all of them).

    Raises:
        InvalidRequest: naming the first part at fault (``content.param``, or the function's
            ``parameters`` as the client sent them: :meth:`ToolRequest.parameters_param`), with
            the library's message about that schema; ``tools`` when they cannot be enforced
            only together.
    """
    params, parts = [], []  # a part: its schema, or why it has none
    if content is not None:
        params.append(content.param)
        parts.append(content.schema)
    callable_ = request.callable()
    for i, tool in enumerate(request.tools):
        if tool in callable_:
            params.append(request.parameters_param(i))
            try:
                parts.append(arguments_schema(tool.parameters))
            except ValueError as e:
                parts.append(str(e))
    broken = next((k for k, part in enumerate(parts) if isinstance(part, str)), len(parts))
    index, error = check_schemas(parts[:broken]) if broken else (-1, "")
    if not error and broken < len(parts):
        index, error = broken, parts[broken]
    if error:
        param = params[index] if index >= 0 else "tools"
        raise InvalidRequest(f"{param} cannot be enforced: {error}", param)
    return parts[1:] if content is not None else parts
