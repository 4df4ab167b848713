"""JSON text as RFC 8259 defines it, for every JSON a request carries: its body, and the JSON
text inside it (a tool call's ``arguments``, a schema sent as text over HTTP or gRPC).

ujson reads ``NaN``, ``Infinity`` and ``-Infinity``, which JSON does not have, and a number such
as ``1e999`` as infinity; such a value would reach a chat template (``{"a": NaN}`` in a prompt),
a schema or a bound check as a float no JSON can hold. They are refused instead, as a JSON
parser that follows the RFC refuses them.
"""
from __future__ import annotations

import math
import re

import ujson

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


def loads(text: str):
    """The value of JSON ``text`` (ujson's parse); its floats are looked at only when ``text``
    holds something that could be a non-finite one, so most bodies cost nothing more.

    Raises:
        ValueError: ``text`` is not JSON, or holds ``NaN``, ``Infinity`` or a number beyond a
            double's range.
    """
    try:
        value = ujson.loads(text)
    except OverflowError as e:
        raise ValueError(str(e)) from None
    if _SUSPECT.search(text) and _has_non_finite(value):
        raise ValueError("NaN, Infinity and numbers beyond a double's range are not JSON")
    return value
