"""The Responses API (``/v1/responses``) as the tests call it: one response created and checked
against OpenAI's document. A support module, not a test module."""
from __future__ import annotations

import json

from tests.support.http import RESPONSES, request
from tests.support.openai_document import conforms

#: The API key of tenant ``a`` in the tenant files of the Responses tests' servers.
KEY = "key-a"


def create(server, body: dict, key: str = KEY) -> dict:
    """POST ``body`` to ``/v1/responses``: a 200 whose ``x-response-stored`` says whether it was
    stored (``store``, default true), a valid ``Response``; returns it."""
    status, headers, raw = request(server, "POST", RESPONSES, body, key=key)
    assert status == 200, raw[:500]
    assert headers["x-response-stored"] == ("false" if body.get("store") is False else "true")
    r = json.loads(raw)
    conforms("Response", r)
    return r
