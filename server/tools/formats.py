"""How a chat template's model writes tool calls: one class per syntax, each holding its
markers, its prompt side, its parser and its grammar together (as llama.cpp's
``common/chat.cpp`` keeps each format's prompt, grammar and parser, and vLLM's ``ToolParser``),
picked from the template's source (:func:`detect`), as vLLM's ``--tool-call-parser`` and
llama.cpp's ``common_chat_templates_apply_jinja`` pick theirs.

| format | templates | a call in the model's text |
|---|---|---|
| :class:`Hermes` | Qwen2.5, Hermes 2 Pro / 3 (``<tool_call>`` in the source) | ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, repeated; text may precede |
| :class:`Mistral` | Mistral Nemo and others with ``[TOOL_CALLS]`` | ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` after optional text |
| :class:`Llama3Json` | Llama 3.1 / 3.2 / 3.3 (JSON tool calling) | the whole answer ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``; calls separated by ``; `` |
| :class:`Generic` | every template that does not render ``tools`` (the bundled SmolLM2's, SmolLM3's) | the whole answer ``{"tool_calls": [{"name": ..., "arguments": {...}}]}``, or ``{"response": "text"}`` |

The generic format is llama.cpp's former "generic" handler (``common_chat_params_init_generic``,
with minja's polyfills for templates without tool support): the tools and the envelope are
described in a system message (:data:`GENERIC_INSTRUCTIONS`), an earlier assistant turn's calls
become its text as the envelope, and a tool result a user message
``{"tool_response": {"tool_call_id", "name", "content"}}``. Everything it adds is message text,
so it is data to the tokenizer as any message text is.

Each format's ``grammar`` writes the Lark rule ``start`` of an answer (the module docstring of
``server/tools/grammar.py`` says what each ``tool_choice`` admits); ``call`` is the shared rule of
one call, written by ``server/tools/grammar.py``.
"""
from __future__ import annotations

import json
import secrets
import string
from typing import Callable

from server.structured.schema import JSON_OPTIONS
from server.tools.parser import CallView, ParseError, held_back, scan_call, skip_ws, string_end, value_end
from server.tools.spec import Tool, ToolRequest

GENERIC_INSTRUCTIONS = (
    "You can call the following tools (JSON Schema of each one's arguments under \"parameters\"):\n{tools}\n\n"
    "Answer in JSON only. To call tools: {{\"tool_calls\": [{{\"name\": \"<tool name>\", \"arguments\": "
    "{{<the arguments>}}}}]}}. To answer the user: {{\"response\": {answer}}}.")
#: The answer's placeholder in :data:`GENERIC_INSTRUCTIONS`: text, or a document of the request's
#: JSON format.
GENERIC_ANSWERS = {False: '\"<your answer>\"', True: "<your answer, as a JSON document of the requested format>"}


class ToolFormat:
    """One tool-call syntax (a subclass per format; one instance each, below).

    Attributes:
        name: as in vLLM's ``--tool-call-parser``. native: the template renders ``tools`` itself
            (otherwise the generic prompt does). markers: texts that open a call section in free text.
        literals: every fixed text of its call syntax that a model's vocabulary may hold as one
            special token (markers and closing tags).
        args_keys: the call object's key for its arguments (the first is the one the grammar
            writes). id_length: a call id's length when the template demands one (Mistral's 9
            alphanumerics), else 0 (``call_`` + 24 hex).
    """

    name: str = ""
    native: bool = True
    markers: tuple[str, ...] = ()
    literals: tuple[str, ...] = ()
    args_keys: tuple[str, ...] = ("arguments",)
    id_length: int = 0

    def __repr__(self) -> str:
        return f"<tool format {self.name}>"

    def new_id(self) -> str:
        """A fresh call id in the form the template accepts back in the next turn."""
        if self.id_length:
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(self.id_length))
        return f"call_{secrets.token_hex(12)}"

    # -- the prompt ----------------------------------------------------------------------------
    def prompt_messages(self, messages: list[dict], tools: tuple[Tool, ...], json_answer: bool) -> list[dict]:
        """``messages`` as the template is given them (a native template renders calls itself)."""
        return messages

    def template_tools(self, tools: tuple[Tool, ...]) -> list[dict] | None:
        """The template's ``tools`` (None: none)."""
        return [t.openai() for t in tools] or None

    def prompt_chars(self, tools: tuple[Tool, ...]) -> int:
        """Characters the prompt adds around the tools' parameters at least (beyond their JSON text)."""
        return 0

    # -- the parser ----------------------------------------------------------------------------
    def parse(self, text: str, final: bool, json_answer: bool = False) -> tuple[str, list[CallView]]:
        """What ``text`` (a choice's whole text so far) holds: its content and its calls.
        Content only grows from one call to the next with a longer text (see
        ``server/tools/parser.py``). ``json_answer``: the request's JSON format holds the
        answers that are not calls, so an answer is read as JSON text."""
        raise NotImplementedError

    # -- the grammar ---------------------------------------------------------------------------
    def grammar(self, request: ToolRequest, lit: Callable[[str], str], head: Callable[[str], str],
                document: str | None) -> str:
        """The Lark rule ``start`` of an answer to ``request`` (and the rules it needs but
        ``call``). ``lit(text)``: a fixed text (its special token's ``<[id]>`` where it is one);
        ``head(marker)``: the rules ``head`` (free text up to ``marker``, it included) and
        ``TEXT``; ``document``: the JSON format's ``%json`` an answer that is not a call follows
        (None: free text).

        Raises:
            ValueError: ``document`` with a format whose calls and answers could not be told apart.
        """
        raise NotImplementedError

    def _calls_after(self, text: str, i: int, sep: str, close: str | None) -> tuple[list[CallView], int | None]:
        """Call objects from ``text[i]`` on, separated by ``sep`` (whitespace around it
        skipped), up to ``close`` (None: the text's end); returns them and the index past
        ``close`` (None while not reached)."""
        calls: list[CallView] = []
        while True:
            view, end = scan_call(text, i, self.args_keys)
            if end is None:
                if view.name is not None or view.arguments:
                    calls.append(view)
                return calls, None
            calls.append(view)
            i = skip_ws(text, end)
            if text.startswith(sep, i):
                i += len(sep)
                continue
            if close is None or text.startswith(close, i):
                return calls, (i + len(close or ""))
            if i == len(text) or close.startswith(text[i:]):
                return calls, None
            raise ParseError(f"expected {sep!r} or {close!r} at {i}")


class Hermes(ToolFormat):
    name, markers, literals = "hermes", ("<tool_call>",), ("<tool_call>", "</tool_call>")
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool, json_answer: bool = False) -> tuple[str, list[CallView]]:
        content, calls, pos = [], [], 0
        while True:
            k = text.find(self.OPEN, pos)
            tail = text[pos:] if k < 0 else text[pos:k]
            if calls:
                tail = tail.lstrip()  # the newlines between calls are not content
            if k < 0:
                content.append(tail if final else held_back(tail, self.markers))
                return "".join(content), calls
            content.append(tail.rstrip())
            try:
                view, end = scan_call(text, k + len(self.OPEN))
            except ParseError:
                if calls:
                    return "".join(content), calls  # text past a malformed call is dropped
                return (text if final else held_back(text, self.markers)), []
            calls.append(view)
            if end is None:
                return "".join(content), calls
            after = skip_ws(text, end)
            if text.startswith(self.CLOSE, after):
                pos = after + len(self.CLOSE)
            elif after == len(text) or self.CLOSE.startswith(text[after:]):
                return "".join(content), calls
            else:
                pos = after  # no closing tag: what follows is read as it comes

    def grammar(self, request, lit, head, document):
        repeat = ' ("\\n" tool_call)*' if request.parallel else ""
        closed = f'tool_call: {lit(self.OPEN)} "\\n" call "\\n" {lit(self.CLOSE)}\n'
        if request.calls_only:
            return f"start: tool_call{repeat}\n" + closed
        if document:  # the document, or the calls straight away
            return f"start: document | tool_call{repeat}\ndocument: {document}\n" + closed
        # text, then calls each opened by the marker (lazy: the text ends at the marker)
        return (f"start: opened{'*' if request.parallel else '?'} TEXT\n"
                f'opened: head "\\n" call "\\n" {lit(self.CLOSE)}\n' + head(self.OPEN))


class Mistral(ToolFormat):
    name, markers, literals, id_length = "mistral", ("[TOOL_CALLS]",), ("[TOOL_CALLS]",), 9
    MARKER, SEPARATOR = "[TOOL_CALLS]", ", "

    def parse(self, text: str, final: bool, json_answer: bool = False) -> tuple[str, list[CallView]]:
        k = text.find(self.MARKER)
        if k < 0:
            return (text if final else held_back(text, self.markers)), []
        i = skip_ws(text, k + len(self.MARKER))
        content = text[:k].rstrip()
        if i == len(text):
            return content, []
        try:
            if text[i] != "[":
                raise ParseError("expected '['")
            calls, _ = self._calls_after(text, i + 1, self.SEPARATOR.strip(), "]")
        except ParseError:
            return (text if final else held_back(text, self.markers)), []
        return content, calls

    def grammar(self, request, lit, head, document):
        repeat = f" ({json.dumps(self.SEPARATOR)} call)*" if request.parallel else ""
        if request.calls_only:
            return f'start: {lit(self.MARKER)} "[" call{repeat} "]"\n'
        if document:
            return f'start: document | {lit(self.MARKER)} "[" call{repeat} "]"\ndocument: {document}\n'
        return f'start: TEXT | head "[" call{repeat} "]"\n' + head(self.MARKER)


class Llama3Json(ToolFormat):
    """Llama 3's JSON tool calling. Its templates render one call per turn; several are written
    separated by :attr:`SEPARATOR` (vLLM's ``llama3_json`` parser reads them so), which the
    grammar writes and the parser reads with any whitespace around its ``;``."""

    name, markers, literals = "llama3_json", ("<|python_tag|>",), ("<|python_tag|>",)
    args_keys = ("parameters", "arguments")
    TAG, SEPARATOR = "<|python_tag|>", "; "

    def parse(self, text: str, final: bool, json_answer: bool = False) -> tuple[str, list[CallView]]:
        i = skip_ws(text, 0)
        if text.startswith(self.TAG, i):
            i = skip_ws(text, i + len(self.TAG))
        if not final and self.TAG.startswith(text[i:]):
            return "", []  # nothing yet, or the tag's start: undecided
        if text[i:i + 1] != "{":
            return text, []  # a call is the whole answer (vLLM's llama3_json): this one is text
        try:
            calls, _ = self._calls_after(text, i, self.SEPARATOR.strip(), None)
        except ParseError:
            return text, []  # JSON that is no call
        return "", calls

    def grammar(self, request, lit, head, document):
        if document is not None and not request.calls_only:
            raise ValueError("Llama 3's tool calls are a bare JSON object, as a JSON answer would be")
        repeat = f" ({json.dumps(self.SEPARATOR)} call)*" if request.parallel else ""
        if request.calls_only:
            return f"start: call{repeat}\n"
        return f"start: calls | TEXT\ncalls: call{repeat}\nTEXT: /([^{{ \\n](.|\\n)*)?/\n"


class Generic(ToolFormat):
    """The envelope ``{"tool_calls": [...]}`` or ``{"response": ...}``. Its grammar holds every
    answer to it, so a start of it that ``max_tokens`` cut (``{"tool``) is no content; text that
    is not the envelope (a model unconstrained) is content."""

    name, native = "generic", False
    #: The envelope's keys (llama.cpp's former generic handler).
    KEYS = ("response", "tool_calls", "tool_call")
    SEPARATOR = ", "

    def prompt_messages(self, messages, tools, json_answer):
        return generic_messages(messages, tools, json_answer)

    def template_tools(self, tools):
        return None

    def prompt_chars(self, tools):
        return generic_indentation(tools)

    def parse(self, text: str, final: bool, json_answer: bool = False) -> tuple[str, list[CallView]]:
        i = skip_ws(text, 0)
        if i == len(text):
            return (text if final else ""), []
        if text[i] != "{":
            return text, []  # the model answered in plain text
        try:
            j = skip_ws(text, i + 1)
            if j == len(text):
                return "", []
            end = string_end(text, j) if text[j] == '"' else -1
            if end == -1:
                raise ParseError("expected a key")
            if end is None:
                if not any(k.startswith(text[j + 1:]) for k in self.KEYS):
                    raise ParseError("unknown key")
                return "", []
            key = json.loads(text[j:end])
            if key not in self.KEYS:
                raise ParseError(f"unknown key {key!r}")
            j = skip_ws(text, end)
            if j < len(text) and text[j] != ":":
                raise ParseError("expected ':'")
            j = skip_ws(text, j + 1)
            if j >= len(text):
                return "", []
            if key == "response":  # a string, or a document of the request's JSON format
                return (_json_value_prefix(text, j) if json_answer else _json_string_prefix(text, j, final)), []
            if key == "tool_calls" and text[j] == "[":
                calls, _ = self._calls_after(text, j + 1, self.SEPARATOR.strip(), "]")
                return "", calls
            if key == "tool_call":
                view, _ = scan_call(text, j)
                return "", [view]
            raise ParseError(f"unknown key {key!r}")
        except ParseError:
            return (text if final or value_end(text, i) is not None else ""), []

    def grammar(self, request, lit, head, document):
        repeat = f" ({json.dumps(self.SEPARATOR)} call)*" if request.parallel else ""
        calls = f'"{{\\"tool_calls\\": [" call{repeat} "]}}"'
        if request.calls_only:
            return f"start: {calls}\n"
        # or the answer: a JSON string, or a document of the format
        return (f'start: {calls} | "{{\\"response\\": " answer "}}"\n'
                f'answer: {document or "%json " + json.dumps(TEXT_ANSWER)}\n')


#: The generic envelope's text answer: a JSON string, written as ``json.dumps`` writes it.
TEXT_ANSWER = {"type": "string", "x-guidance": JSON_OPTIONS}
HERMES, MISTRAL, LLAMA3_JSON, GENERIC = Hermes(), Mistral(), Llama3Json(), Generic()


def detect(source: str, takes_tools: bool) -> ToolFormat:
    """The format of a template (its Jinja source; ``takes_tools``: it reads ``tools``). A
    template that reads ``tools`` in a syntax not known here gets the generic format, whose
    output this server can read."""
    if takes_tools:
        if "<tool_call>" in source:
            return HERMES
        if "[TOOL_CALLS]" in source:
            return MISTRAL
        if "<|python_tag|>" in source or '"parameters": dictionary of argument name' in source:
            return LLAMA3_JSON
    return GENERIC


def _json_string_prefix(text: str, i: int, final: bool) -> str:
    """The decoded text of the JSON string at ``text[i]``, as far as it is certain."""
    if text[i] != '"':
        raise ParseError("response must be a string")
    end = string_end(text, i)
    raw = text[i + 1:end - 1] if end is not None else text[i + 1:]
    for cut in range(0, min(len(raw), 12) + 1):  # an escape (a surrogate pair: 12) may be incomplete
        try:
            decoded = json.loads(f'"{raw[:len(raw) - cut]}"')
        except ValueError:
            continue
        if end is None and decoded and "\ud800" <= decoded[-1] <= "\udbff":
            decoded = decoded[:-1]  # half a surrogate pair: its other half decides
        return decoded
    return ""


def _json_value_prefix(text: str, i: int) -> str:
    """The JSON value at ``text[i]`` as written (compact, as the grammar holds it), as far as it
    goes: the answer of a request with a JSON format, so it stays JSON text."""
    end = value_end(text, i)
    return text[i:end] if end is not None else text[i:]



# -- the generic format's prompt -------------------------------------------------------------------
#: Spaces a level of the tool description's JSON is indented by.
GENERIC_INDENT = 2


def generic_indentation(tools: tuple[Tool, ...]) -> int:
    """Characters the indentation of :func:`generic_messages`' tool description adds to the
    tools' parameters as ``json.dumps`` writes them without it, at least: with
    ``indent=GENERIC_INDENT`` each member of a non-empty array or object starts a new line
    indented by its level (a parameters object's members are at level 3: the list, then each
    function object), where ``, `` becomes ``,`` and a line break. A lower bound found without
    rendering, for the size check before it: a deeply nested schema grows hundreds of times
    when indented."""
    total = 0
    stack: list = [(t.parameters, 3) for t in tools]
    while stack:
        value, level = stack.pop()
        members = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        total += len(members) * GENERIC_INDENT * level
        stack.extend((m, level + 1) for m in members if isinstance(m, (dict, list)))
    return total


def generic_messages(messages: list[dict], tools: tuple[Tool, ...], json_answer: bool = False) -> list[dict]:
    """``messages`` as a template without tool syntax can render them: the tools' description
    in the system message (the first one, extended, or a new one; ``json_answer``: the answer
    is a document of the request's JSON format), earlier calls as their envelope text, tool
    results as user messages. Every message is then ``{"role", "content": str}``."""
    names = {}
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"], "id": c["id"]}
                     for c in m["tool_calls"]]
            names.update((c["id"], c["name"]) for c in calls)
            envelope = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            out.append({"role": "assistant", "content": f"{m['content']}\n{envelope}" if m["content"] else envelope})
        elif m["role"] == "tool":
            result = {"tool_call_id": m["tool_call_id"], "name": names.get(m["tool_call_id"]), "content": m["content"]}
            out.append({"role": "user", "content": json.dumps({"tool_response": result}, ensure_ascii=False)})
        else:
            out.append({"role": m["role"], "content": m["content"] or "", **({"name": m["name"]} if "name" in m else {})})
    if tools:
        described = json.dumps([t.openai()["function"] for t in tools], ensure_ascii=False, indent=GENERIC_INDENT)
        instructions = GENERIC_INSTRUCTIONS.format(tools=described, answer=GENERIC_ANSWERS[json_answer])
        if out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out
