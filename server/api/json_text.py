"""JSON text as RFC 8259 defines it, for every JSON a request carries: its body, and the JSON
text inside it (a tool call's ``arguments``, a schema sent as text over HTTP or gRPC).

ujson and Python's ``json`` both read ``NaN``, ``Infinity`` and ``-Infinity``, which JSON does
not have, and a number such as ``1e999`` as infinity; such a value would reach a chat template
(``{"a": NaN}`` in a prompt), a schema or a bound check as a float no JSON can hold. They are
refused instead, as a JSON parser that follows the RFC refuses them.
"""
from __future__ import annotations

import json
import math
import re

import ujson

#: What may yield a non-finite float: the three names, or an exponent of three digits or more.
_SUSPECT = re.compile(r"NaN|Infinity|[eE][+-]?\d{3}")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def loads(text: str):
    """The value of JSON ``text``: ujson's parse, checked again with Python's ``json`` (slower,
    but able to refuse a non-finite number) only when ``text`` holds something that could be one.

    Raises:
        ValueError: ``text`` is not JSON, or holds ``NaN``, ``Infinity`` or a number beyond a
            double's range.
    """
    try:
        value = ujson.loads(text)
    except OverflowError as e:  # an integer beyond 64 bits: Python's json reads it exactly
        raise ValueError(str(e)) from None
    if _SUSPECT.search(text):
        json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    return value
