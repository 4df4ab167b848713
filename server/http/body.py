"""Reading an HTTP request's body: Falcon's request -> one JSON object, checked for media type,
encoding, size and text before any field is looked at (the fields are ``server/api``'s)."""
from __future__ import annotations

import falcon

from engine.errors import InvalidRequest
from server.api import json_text
from server.errors import APIError


def read_json(req: falcon.Request, max_body_bytes: int) -> dict:
    """The request body as a JSON object.

    Raises:
        APIError: 415 not ``application/json``; 413 over ``max_body_bytes`` (the connection is
        then closed, the body left unread); 400 not UTF-8, not JSON, or not an object.
    """
    media = (req.content_type or "").split(";")[0].strip().lower()
    if media != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {req.content_type or 'none'}",
                       code="unsupported_media_type")
    encoding = (req.get_header("Content-Encoding") or "identity").strip().lower()
    if encoding != "identity":
        raise APIError(415, f"Content-Encoding {encoding} is not supported; send plain JSON",
                       code="unsupported_media_type")
    too_large = APIError(413, f"request body exceeds {max_body_bytes} bytes", code="request_too_large",
                         headers={"Connection": "close"})
    if req.content_length is not None and req.content_length > max_body_bytes:
        raise too_large
    # Without Content-Length (a chunked body), Falcon's bounded stream reads nothing; gunicorn's
    # own input stream decodes the chunks and ends at the body's end.
    stream = req.bounded_stream if req.content_length is not None else req.stream
    try:
        raw = stream.read(max_body_bytes + 1)
    except Exception as e:  # noqa: BLE001 - gunicorn's malformed-chunk errors have no common base
        raise InvalidRequest(f"request body could not be read: {type(e).__name__}") from None
    if len(raw) > max_body_bytes:
        raise too_large
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json_text.loads(text)
    except json_text.TooDeep as e:
        raise InvalidRequest(f"request body: {e}") from None
    except ValueError as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body
