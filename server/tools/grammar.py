"""The grammar that holds a tool-calling answer to what the request allows: llguidance Lark
with each call's JSON Schema inlined (``%json``), sent as ``SamplingParams.grammar`` and
enforced per sequence by the engine (docs/architecture.md "Grammar constraints").

A call is the text ``{"name": "<name>", "arguments": <JSON of the function's parameters>}`` (key
``parameters`` for Llama 3), one Lark rule per callable function: the fixed text as literals,
the arguments a ``%json`` of the function's ``parameters`` as given (and of an object), so its
``$ref``s resolve in it alone and no two functions' definitions meet (nothing is rewritten: a
``$ref`` inside a ``const`` stays data). JSON is written with the separators ``json.dumps`` uses (what the
templates show the model). Per ``tool_choice``:

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
straight away; the generic format: ``{"response": <the document>}``), a ``%json`` of the
format's schema with its own options (``x-guidance``). ``required`` and a named function answer
with calls, so the format has nothing to hold there.
"""
from __future__ import annotations

import json
from typing import Callable

import llguidance

from engine.errors import InvalidRequest
from engine.llama.grammar import check, closed_objects
from server.tools.formats import ToolFormat
from server.tools.spec import AUTO, ToolRequest

#: Separators as json.dumps writes them, no other whitespace: what the templates show.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _arguments_schema(parameters: dict) -> dict:
    """A function's arguments' schema (with ``x-guidance``'s :data:`COMPACT`): its ``parameters``
    as their own ``%json`` root, and an object
    (OpenAI: ``arguments`` is a JSON object) whatever else the schema says. The request's check
    reads only the root's ``type``, so ``{}`` or a root that reaches another type through
    ``$ref``, ``anyOf`` or ``allOf`` would otherwise let the model write ``null`` or ``[]``
    there; llguidance intersects the two, and one that allows no object does not compile. A root
    without a ``type`` that refers to itself (``"$ref": "#"``) stays as given: the added type would
    narrow every such reference too (a helper's finding), so there the root is not held to an object.
    Objects that name their keys take no others (:func:`engine.llama.grammar.closed_objects`,
    whose ``ValueError`` this raises)."""
    own = parameters if "type" in parameters or '"$ref": "#"' in json.dumps(parameters) else \
        {**parameters, "type": "object"}
    return {**closed_objects(own), "x-guidance": COMPACT}


def _calls(fmt: ToolFormat, request: ToolRequest) -> str:
    """The Lark rules ``call`` (one call of any function the request lets the model call) and
    one ``call_<i>`` / ``arguments_<i>`` pair per function."""
    rules, names = [], []
    for i, tool in enumerate(request.callable()):
        opening = json.dumps(f'{{"name": {json.dumps(tool.name)}, "{fmt.args_keys[0]}": ')
        arguments = json.dumps(_arguments_schema(tool.parameters))
        rules.append(f'call_{i}: {opening} arguments_{i} "}}"\narguments_{i}: %json {arguments}\n')
        names.append(f"call_{i}")
    return f"call: {' | '.join(names)}\n" + "".join(rules)


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

    Checks nothing (:func:`check_parameters` names a function that cannot be enforced; the
    caller checks the whole).

    Raises:
        ValueError: ``content`` with a format whose calls and answers could not be told apart
            (Llama 3's: both are a JSON object).
    """
    required = request.choice != AUTO
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
        calls = '"{\\"tool_calls\\": [" call' + (' (", " call)*' if request.parallel else "") + ' "]}"'
        lark = f"start: {calls}\n"
        if not required:  # or the answer: a JSON string, or a document of the format
            lark = (f'start: {calls} | "{{\\"response\\": " answer "}}"\n'
                    f'answer: {document or "%json " + json.dumps({"type": "string", "x-guidance": COMPACT})}\n')
    elif fmt.name == "hermes":
        repeat = ' ("\\n" tool_call)*' if request.parallel else ""
        closed = f'tool_call: {lit("<tool_call>")} "\\n" call "\\n" {lit("</tool_call>")}\n'
        if required:
            lark = f"start: tool_call{repeat}\n" + closed
        elif document:  # the document, or the calls straight away
            lark = f"start: document | tool_call{repeat}\ndocument: {document}\n" + closed
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
    return llguidance.grammar_from("lark", f"%llguidance {{}}\n{lark}{_calls(fmt, request)}")


def check_parameters(request: ToolRequest, checker: Callable[[str], str] | None = None) -> None:
    """Refuse, by name, the first function the model may call whose ``parameters`` llguidance
    cannot compile, or that leave a call no first character (no instance at all, as
    ``{"$ref": "#"}``; one whose every instance is infinite further in, as a required property
    of its own type, is found only at the token that reaches it: ``constraint_failed``): each function's
    arguments alone, taken by ``checker`` (a memo of :func:`engine.llama.grammar.check` with
    ``text_only``, that check itself by default: arguments hold no special token). Run before
    the whole grammar is checked, whose message would name only ``tools`` and quote its Lark.

    Raises:
        InvalidRequest: naming the function's ``parameters`` as the client sent them
            (:attr:`Tool.path`), with the library's message.
    """
    for i, tool in enumerate(request.tools):
        if tool in request.callable():
            param = f"{tool.path or f'tools[{i}].function'}.parameters"
            try:
                grammar = llguidance.grammar_from("json_schema", _arguments_schema(tool.parameters))
            except ValueError as e:
                error = str(e)
            else:
                error = checker(grammar) if checker is not None else check(grammar, text_only=True)
            if error:
                raise InvalidRequest(f"{param} cannot be enforced: {error}", param)
