"""JSON as the HTTP front end sends it: :func:`dumps` (UTF-8 text as it is, ``/`` unescaped),
:func:`sse`, one server-sent event of a JSON object, :func:`sse_headers`, the head of every
event stream, and :func:`obfuscated`, the padding of OpenAI's stream obfuscation."""
from __future__ import annotations

import random
import string

import ujson

#: With stream obfuscation, a padded event's JSON is a whole number of blocks of this many bytes,
#: so its size tells an observer of the (encrypted) stream little of the text in it.
OBFUSCATION_BLOCK = 32
_PAD = string.ascii_letters + string.digits


def dumps(obj) -> str:
    """``obj`` as compact JSON, non-ASCII and ``/`` written as they are."""
    return ujson.dumps(obj, ensure_ascii=False, escape_forward_slashes=False)


def obfuscated(text: str) -> str:
    """``text``, the JSON of a non-empty object, with an ``obfuscation`` member of random letters
    and digits last that brings its UTF-8 length to a multiple of :data:`OBFUSCATION_BLOCK`
    (OpenAI API reference: ``stream_options.include_obfuscation``, "random characters to an
    ``obfuscation`` field on streaming delta events to normalize payload sizes")."""
    head = text[:-1] + ',"obfuscation":"'
    pad = -(len(head.encode("utf-8")) + 2) % OBFUSCATION_BLOCK  # 2: the closing '"}'
    return head + "".join(random.choices(_PAD, k=pad)) + '"}'


def sse_headers(resp) -> None:
    """Make the Falcon response ``resp`` an event stream: its content type, no caching, and no
    buffering by a proxy in front (nginx's ``X-Accel-Buffering``), so each event leaves at once."""
    resp.content_type = "text/event-stream; charset=utf-8"
    resp.set_header("Cache-Control", "no-cache")
    resp.set_header("X-Accel-Buffering", "no")


def sse(obj, obfuscate: bool = False) -> bytes:
    """One SSE event, ``data: <json>`` and a blank line, as UTF-8 bytes; padded by
    :func:`obfuscated` when ``obfuscate``."""
    text = dumps(obj)
    return f"data: {obfuscated(text) if obfuscate else text}\n\n".encode("utf-8")
