"""``GET /openapi.json``: this server's own OpenAPI 3.1 document.

The document is ``server/http/openapi.json`` (package data), written by hand and kept true by
``tests/spec/test_openapi.py``: its routes are the app's, its request fields are those
``server/api/requests.py`` and ``server/api/infer.py`` take, with their bounds, and schemathesis runs it
against a real server. It is served as it is, except for routes this app does not serve on its
port (``/metrics`` with ``--no-metrics`` or ``--metrics-port``; the Admin API and ``/admin``
without admin keys), so it describes what a client can reach here.
"""
from __future__ import annotations

import importlib.resources
import json

import falcon


def load() -> dict:
    """The document as shipped (every route)."""
    return json.loads(importlib.resources.files("server.http").joinpath("openapi.json").read_text(encoding="utf-8"))


class OpenAPIDocument:
    """The document, serialised once; needs no API key (a client reads it before it has one).

    Args:
        absent: paths of the document this app does not serve, left out.
    """

    public = True

    def __init__(self, absent: tuple[str, ...] = ()):
        doc = load()
        for path in absent:
            doc["paths"].pop(path, None)
        self.body = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = falcon.MEDIA_JSON
        resp.data = self.body

    on_head = on_get


def admin_paths(doc: dict | None = None) -> tuple[str, ...]:
    """The document's paths of the Admin API and the admin page (tag ``Admin``)."""
    doc = doc or load()
    return tuple(p for p, item in doc["paths"].items() if any("Admin" in op.get("tags", ()) for op in item.values()))
