"""JSON as the HTTP front end sends it: :func:`dumps` (UTF-8 text as it is, ``/`` unescaped) and
:func:`sse`, one server-sent event of a JSON object."""
from __future__ import annotations

import ujson


def dumps(obj) -> str:
    """``obj`` as compact JSON, non-ASCII and ``/`` written as they are."""
    return ujson.dumps(obj, ensure_ascii=False, escape_forward_slashes=False)


def sse(obj) -> bytes:
    """One SSE event, ``data: <json>`` and a blank line, as UTF-8 bytes."""
    return f"data: {dumps(obj)}\n\n".encode("utf-8")
