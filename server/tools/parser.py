"""Reading tool calls out of the model's text as it streams (front end, as vLLM v1 keeps its
tool parsers).

:class:`ToolCallParser` is fed a choice's text deltas; after each it returns the new content
text and the new pieces of calls (:class:`ToolCallDelta`). Each feed
re-reads the choice's whole text with its format's ``parse`` (``server/tools/formats.py``),
which says what the text holds so far: content, and calls each with a name (once complete)
and its arguments' raw text so far. The parser sends what is new. So arguments go out as the
model's own text, never re-serialised partial JSON (the cause of vLLM's broken streamed
arguments, vllm#10395 and #19056), and the streamed pieces joined are exactly the answer a
non-streamed request gets, which is made of the same pieces.

A format's ``parse`` holds back text that could still be the start of a call marker, and
whitespace just before one, until the next delta decides; with ``final`` it holds nothing.
JSON is scanned with the regular expressions below (strings and brackets), so a long answer
costs C-speed scans, not a Python loop per character.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WS = " \t\n\r"
#: A JSON string from its opening quote: group 1 is the closing quote ("" while incomplete).
_STRING = re.compile(r'"(?:[^"\\]|\\.)*("?)', re.S)
#: What matters to a bracket count: strings (skipped whole) and brackets.
_SIGNIFICANT = re.compile(r'"(?:[^"\\]|\\.)*"?|[{}\[\]]', re.S)
#: The end of a number or literal.
_SCALAR_END = re.compile(r"[,}\]\s]")


class ParseError(ValueError):
    """The text is not the format's call syntax (an unconstrained model's free writing)."""


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def string_end(s: str, i: int) -> int | None:
    """End (past the closing quote) of the JSON string at ``s[i] == '"'``; None if incomplete."""
    m = _STRING.match(s, i)
    return m.end() if m.group(1) else None


def value_end(s: str, i: int) -> int | None:
    """End of the JSON value that starts at ``s[i]``; None if it is incomplete."""
    c = s[i]
    if c == '"':
        return string_end(s, i)
    if c in "{[":
        depth = 0
        for m in _SIGNIFICANT.finditer(s, i):
            t = m.group()
            if t[0] == '"':
                if len(t) < 2 or not (t.endswith('"') and _STRING.match(t).group(1)):
                    return None  # a string still open
                continue
            depth += 1 if t in "{[" else -1
            if depth == 0:
                return m.end()
        return None
    m = _SCALAR_END.search(s, i)
    return m.start() if m else None


@dataclass
class ToolCallDelta:
    """A piece of one tool call of a choice (OpenAI's ``delta.tool_calls[]``): ``index`` counts
    the choice's calls from 0; the first piece of a call carries its ``id`` and ``name``, later
    ones only text of its ``arguments`` (raw JSON text as the model wrote it)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class CallView:
    """What the text says of one call so far: its function ``name`` (None until complete), the
    raw text of its arguments so far, and whether the call is complete."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False


def scan_call(s: str, i: int, args_keys: tuple[str, ...] = ("arguments",)) -> tuple[CallView, int | None]:
    """The call object (``{"name": ..., "arguments": {...}}``, keys in any order, others
    skipped) starting at or after whitespace from ``s[i]``; returns it and the index past its
    closing brace (None while incomplete).

    Raises:
        ParseError: not a call object.
    """
    view = CallView()
    i = skip_ws(s, i)
    if i == len(s):
        return view, None
    if s[i] != "{":
        raise ParseError(f"expected a call object at {i}")
    i += 1
    while True:
        i = skip_ws(s, i)
        if i == len(s):
            return view, None
        if s[i] == "}":
            if view.name is None:
                raise ParseError("a call without a name")
            view.complete = True
            return view, i + 1
        if s[i] == ",":
            i += 1
            continue
        if s[i] != '"':
            raise ParseError(f"expected a key at {i}")
        end = string_end(s, i)
        if end is None:
            return view, None
        key = json.loads(s[i:end])
        i = skip_ws(s, end)
        if i == len(s):
            return view, None
        if s[i] != ":":
            raise ParseError(f"expected ':' at {i}")
        i = skip_ws(s, i + 1)
        if i == len(s):
            return view, None
        end = value_end(s, i)
        if key in args_keys:
            if s[i] != "{":
                raise ParseError("arguments must be an object")
            view.arguments = s[i:end if end is not None else len(s)]
        elif key == "name":
            if s[i] != '"':
                raise ParseError("a name must be a string")
            if end is not None:
                view.name = json.loads(s[i:end])
        if end is None:
            return view, None
        i = end


def held_back(text: str, markers: tuple[str, ...]) -> str:
    """``text`` without its end where a marker could be starting, and without the whitespace
    before it (both sent once the next delta shows no call follows)."""
    cut = len(text)
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-k:]):
                cut = min(cut, len(text) - k)
                break
    return text[:cut].rstrip(_WS)


class ToolCallParser:
    """One choice's tool calls and content, from its text deltas.

    Args:
        fmt: the template's :class:`server.tools.formats.ToolFormat`.
        max_calls: calls read at most (1 for ``parallel_tool_calls: false``); text after the
            last of them is dropped, and :attr:`done` says the answer is over.
        calls_only: the answer holds calls and nothing else
            (:attr:`server.tools.spec.ToolRequest.calls_only`: its grammar says so), so no text
            is content, not even the start of a call that ``max_tokens`` cut before its name.
        json_answer: the request's JSON format holds the answers that are not calls, so an
            answer is read as JSON text (the generic envelope's ``response`` kept as written).
    """

    def __init__(self, fmt, max_calls: int | None = None, calls_only: bool = False, json_answer: bool = False):
        self.fmt, self.max_calls, self.calls_only, self.json_answer = fmt, max_calls, calls_only, json_answer
        self.text = ""
        self._content_sent = 0
        self._calls: list[list] = []  # [id, arguments sent]
        self.done = False

    @property
    def n_calls(self) -> int:
        return len(self._calls)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """Append ``text`` (``final``: it is the last); returns the new content text and the
        new pieces of calls."""
        if self.done:
            return "", []
        self.text += text
        content, calls = self.fmt.parse(self.text, final, self.json_answer)
        if self.calls_only:
            content = ""
        if self.max_calls is not None:
            calls = calls[:self.max_calls]
            if len(calls) == self.max_calls and calls[-1].complete:
                self.done = True
        # A format's content only grows (it holds back what it cannot decide yet).
        new_text = content[self._content_sent:]
        self._content_sent = max(self._content_sent, len(content))
        deltas: list[ToolCallDelta] = []
        for k, view in enumerate(calls):
            if view.name is None:
                break
            if k == len(self._calls):
                self._calls.append([self.fmt.new_id(), 0])
                deltas.append(ToolCallDelta(k, self._calls[k][0], view.name))
            fragment = view.arguments[self._calls[k][1]:]
            if fragment:
                self._calls[k][1] = len(view.arguments)
                if deltas and deltas[-1].index == k:
                    deltas[-1].arguments += fragment
                else:
                    deltas.append(ToolCallDelta(k, arguments=fragment))
        return new_text, deltas
