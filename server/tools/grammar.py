"""The grammar that holds a tool-calling answer to what the request allows: llguidance Lark
with each call's JSON Schema inlined (``%json``), sent as ``SamplingParams.grammar`` and
enforced per sequence by the engine (docs/architecture.md "Grammar constraints").

A call is a JSON object ``{"name": <const>, "arguments": <the function's parameters>}`` (key
``parameters`` for Llama 3), one schema per callable function under ``anyOf``, written with the
separators ``json.dumps`` uses (what the templates show the model). Per ``tool_choice``:

- ``required`` / a named function: the answer is the format's call section and nothing else,
  one or more calls (exactly one when ``parallel_tool_calls`` is false);
- ``auto``: free text, and once the format's marker appears (``<tool_call>``,
  ``[TOOL_CALLS]``) the call grammar: a lazy lexeme, as in the "Tool
  calling" section of llguidance's syntax guide and llama.cpp's grammar triggers. Llama 3's calls are the whole answer, so its
  ``auto`` is text that does not start with ``{``, or calls. The generic format's ``auto`` is
  llama.cpp's: the envelope is always JSON, calls or ``{"response": <text>}``;
- ``none``: no grammar (and no tools in the prompt).

With a JSON response format (``response_format``, the Responses API's ``text.format``) under
``auto``, the answer that is not a call is a document of that format instead of free text: the
format's schema where the free text was (Hermes and Mistral: the document, or the calls
straight away; the generic format: ``{"response": <the document>}``). ``required`` and a named
function answer with calls, so the format has nothing to hold there.
"""
from __future__ import annotations

import json

import llguidance

from engine.errors import InvalidRequest
from engine.llama.grammar import check
from server.tools.formats import ToolFormat
from server.tools.spec import AUTO, ToolRequest

#: Separators as json.dumps writes them, no other whitespace: what the templates show.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_schema(fmt: ToolFormat, request: ToolRequest, defs: dict) -> dict:
    """One call of any function the request lets the model call. Each function's definitions
    (``$defs``, ``definitions``: what pydantic writes for nested models) move into ``defs``,
    which goes to the root of the whole grammar's schema, under names of their own."""
    schemas = [{"type": "object", "properties": {"name": {"const": t.name},
                                                 fmt.args_keys[0]: _hoist(t.parameters, f"f{i}.", defs)},
                "required": ["name", fmt.args_keys[0]], "additionalProperties": False}
               for i, t in enumerate(request.callable())]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _hoist(parameters: dict, prefix: str, defs: dict) -> dict:
    """``parameters`` with its local references (``#``, ``#/$defs/X``, ``#/definitions/X``)
    pointing at ``#/$defs/<prefix>X`` (its root at ``#/$defs/<prefix>``), those definitions
    added to ``defs``: embedded in a larger schema, they would otherwise resolve against its
    root."""
    seen = []

    def walk(node):
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and value == "#":
                seen.append(True)
                value = f"#/$defs/{prefix}"
            elif key == "$ref" and isinstance(value, str):
                for section in ("#/$defs/", "#/definitions/"):
                    if value.startswith(section):
                        value = f"#/$defs/{prefix}{value[len(section):]}"
            elif key in ("$defs", "definitions") and node is parameters and isinstance(value, dict):
                defs.update((f"{prefix}{name}", walk(d)) for name, d in value.items())
                continue
            out[key] = walk(value)
        return out

    hoisted = walk(parameters)
    if seen:
        defs[prefix] = hoisted
    return hoisted


def _json(schema: dict, defs: dict) -> str:
    return "%json " + json.dumps({**schema, **({"$defs": defs} if defs else {}), "x-guidance": COMPACT})


def tool_grammar(fmt: ToolFormat, request: ToolRequest, specials: dict[str, int] | None = None,
                 content: dict | None = None) -> str:
    """The llguidance grammar (its JSON form) for ``request`` in format ``fmt``.

    Args:
        specials: the format's marker texts that are one special token of the served model
            (Qwen2.5's ``<tool_call>``, Mistral's ``[TOOL_CALLS]``) and their ids: the grammar
            names the token (``<[id]>``), since the model writes the token, not the text. Free
            text never holds a special token, so such a trigger needs no lazy lexeme.
        content: the JSON schema (with its ``x-guidance`` options) an answer that is not a call
            must follow (None: free text); see the module's docstring.

    Raises:
        InvalidRequest: a function's ``parameters`` llguidance cannot compile (naming it).
        ValueError: ``content`` with a format whose calls and answers could not be told apart
            (Llama 3's: both are a JSON object).
    """
    required = request.choice != AUTO
    defs: dict = {}
    call = _json(call_schema(fmt, request, defs), defs)
    specials = specials or {}
    if content is not None and fmt.name == "llama3_json" and not required:
        raise ValueError("Llama 3's tool calls are a bare JSON object, as a JSON answer would be")
    document = f"%json {json.dumps(content)}" if content is not None else None

    def lit(text: str) -> str:
        return f"<[{specials[text]}]>" if text in specials else json.dumps(text)

    def head(marker: str) -> str:  # free text up to the marker, the marker included
        return (f"head: TEXT {lit(marker)}\n" if marker in specials else
                f"head[lazy]: TEXT {lit(marker)}\n") + "TEXT: /(.|\\n)*/\n"
    if fmt.name == "generic":
        defs = {}
        calls = {"type": "array", "items": call_schema(fmt, request, defs), "minItems": 1}
        if not request.parallel:
            calls["maxItems"] = 1
        envelope = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                    "additionalProperties": False}
        if not required:
            answer = {"type": "string"} if content is None else _hoist(
                {k: v for k, v in content.items() if k != "x-guidance"}, "content.", defs)
            envelope = {"anyOf": [envelope, {"type": "object", "properties": {"response": answer},
                                             "required": ["response"], "additionalProperties": False}]}
        lark = f"start: {_json(envelope, defs)}\n"
    elif fmt.name == "hermes":
        repeat = ' ("\\n" tool_call)*' if request.parallel else ""
        calls = f"tool_call{repeat}"
        closed = f'tool_call: {lit("<tool_call>")} "\\n" call "\\n" {lit("</tool_call>")}\n'
        if required:
            lark = f"start: {calls}\n" + closed
        elif document:  # the document, or the calls straight away
            lark = f"start: document | {calls}\ndocument: {document}\n" + closed
        else:  # text, then calls each opened by the marker (lazy: the text ends at the marker)
            lark = (f"start: opened{'*' if request.parallel else '?'} TEXT\n"
                    f'opened: head "\\n" call "\\n" {lit("</tool_call>")}\n' + head("<tool_call>"))
    elif fmt.name == "mistral":
        repeat = ' (", " call)*' if request.parallel else ""
        calls = f'{lit("[TOOL_CALLS]")} "[" call{repeat} "]"'
        lark = (f"start: {calls}\n" if required else
                f"start: document | {calls}\ndocument: {document}\n" if document else
                f'start: TEXT | head "[" call{repeat} "]"\n' + head("[TOOL_CALLS]"))
    elif fmt.name == "llama3_json":
        repeat = ' ("; " call)*' if request.parallel else ""
        lark = f"start: call{repeat}\n" if required else f"start: calls | TEXT\ncalls: call{repeat}\nTEXT: /([^{{ \\n](.|\\n)*)?/\n"
    else:
        raise ValueError(f"no grammar for format {fmt.name}")
    try:
        grammar = llguidance.grammar_from("lark", f"%llguidance {{}}\n{lark}call: {call}\n")
    except ValueError as e:
        grammar, error = None, str(e)
    else:
        error = check(grammar)
    if error:
        raise InvalidRequest(f"the tools cannot be enforced: {error}", _culprit(fmt, request))
    return grammar


def _culprit(fmt: ToolFormat, request: ToolRequest) -> str:
    """The field to blame: the first function whose parameters do not compile alone."""
    for i, tool in enumerate(request.tools):
        if tool in request.callable():
            defs: dict = {}
            schema = _hoist(tool.parameters, "f0.", defs)
            try:
                alone = check(llguidance.grammar_from("lark", f"%llguidance {{}}\nstart: {_json(schema, defs)}\n"))
            except ValueError as e:
                alone = str(e)
            if alone:
                return f"tools[{i}].function.parameters"
    return "tools"
