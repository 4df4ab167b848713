"""JSON text as RFC 8259 defines it, for every JSON a request carries: its body, and the JSON
text inside it (a tool call's ``arguments``, a schema sent as text over HTTP or gRPC).

ujson reads ``NaN``, ``Infinity`` and ``-Infinity``, which JSON does not have, and a number such
as ``1e999`` as infinity; such a value would reach a chat template (``{"a": NaN}`` in a prompt),
a schema or a bound check as a float no JSON can hold. They are refused instead, as a JSON
parser that follows the RFC refuses them; and so is an escape of half a UTF-16 surrogate pair
(``"\\ud800"``), which decodes to a string no UTF-8 text can hold (RFC 8259, section 8.2).

ujson reads arrays and objects 1,023 levels deep; a value that deep breaks the recursive code
that takes it on (``json.dumps`` of a tool's schema, a chat template's ``tojson``), past Python's
recursion limit. Values are bounded at :data:`MAX_DEPTH` levels instead, as RFC 8259 (section 9)
lets a parser bound nesting.
"""
from __future__ import annotations

import math
import re

import numpy as np
import ujson

#: A ``\\uD800``-``\\uDFFF`` escape: half of a UTF-16 pair, which a lone one decodes to a
#: string no UTF-8 text can hold (the tokenizer, a log, a JSON answer would fail on it).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")

#: Levels of arrays and objects a JSON text may nest (the text's own value is level 1): far
#: beyond any schema (OpenAI's structured outputs allow 10 levels of properties) or message, and
#: far within Python's recursion limit for everything that walks the value afterwards.
MAX_DEPTH = 128

#: What may yield a non-finite float: the two names, an exponent of three digits or more, or a
#: run of 309 digits (10^308 is a double's limit).
_SUSPECT = re.compile(r"NaN|Infinity|[eE][+-]?\d{3}|\d{309}")


def _has_non_finite(value) -> bool:
    """Whether a float in ``value`` (parsed JSON) is NaN or infinite; iterative, since a body
    may nest as deep as ujson reads (1,023 levels), beyond Python's recursion limit."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float):
            if not math.isfinite(v):
                return True
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


class TooDeep(ValueError):
    """JSON text whose arrays and objects nest more than :data:`MAX_DEPTH` levels: JSON, but
    more than this server reads."""


#: A JSON string literal (the text was parsed already, so every one is well formed).
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
#: Each byte's change of nesting level: ``[`` and ``{`` open one, ``]`` and ``}`` close one.
_LEVEL_STEP = np.zeros(256, np.int8)
_LEVEL_STEP[[ord("["), ord("{")]] = 1
_LEVEL_STEP[[ord("]"), ord("}")]] = -1


def _depth(text: str) -> int:
    """Levels of arrays and objects JSON ``text`` nests: the highest running count of opening
    brackets less closing ones, strings left out. Computed over the text with NumPy: a walk of
    the parsed value took 0.3 s on a 1 MB body of small arrays, this 7 ms (brackets are ASCII,
    so no byte of another UTF-8 character is mistaken for one)."""
    levels = _LEVEL_STEP[np.frombuffer(_STRING.sub("", text).encode(), np.uint8)]
    return int(np.cumsum(levels, dtype=np.int32).max(initial=0))


def loads(text: str):
    """The value of JSON ``text`` (ujson's parse); its floats are looked at only when ``text``
    holds something that could be a non-finite one, and its nesting only when it holds more than
    :data:`MAX_DEPTH` brackets, so most bodies cost nothing more.

    Raises:
        ValueError: ``text`` is not JSON, holds ``NaN``, ``Infinity``, a number beyond a
            double's range or an unpaired surrogate escape; :class:`TooDeep` when it nests
            more than :data:`MAX_DEPTH` levels.
    """
    try:
        value = ujson.loads(text)
    except OverflowError as e:
        raise ValueError(str(e)) from None
    if _SUSPECT.search(text) and _has_non_finite(value):
        raise ValueError("NaN, Infinity and numbers beyond a double's range are not JSON")
    if text.count("[") + text.count("{") > MAX_DEPTH and _depth(text) > MAX_DEPTH:
        raise TooDeep(f"arrays and objects nest more than {MAX_DEPTH} levels")
    if _SURROGATE_ESCAPE.search(text):
        try:  # a pair decodes to one character; a lone half cannot be written as UTF-8
            ujson.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("an unpaired UTF-16 surrogate escape (\\ud800-\\udfff) is no character") from None
    return value
