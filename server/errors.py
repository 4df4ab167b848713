"""The HTTP error contract (DESIGN.md section 7): every error body is OpenAI-shaped,
``{"error": {"message", "type", "param", "code"}}`` (OpenAI API reference, "Error codes")."""
from __future__ import annotations

import logging

import falcon
import ujson

from engine.client import ClientDisconnected

log = logging.getLogger("server")
CLIENT_CLOSED = "499 Client Closed Request"  # nginx's status for it; never seen by the client

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          429: "rate_limit_error", 503: "server_error", 500: "server_error"}


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI-shaped body.

    Args:
        status: HTTP status (int). param: the request field at fault, if any.
        code: machine-readable code (e.g. ``model_not_found``). headers: extra response headers.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict | None = None, type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.type = type_ or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _write(resp: falcon.Response, status: int, body: dict, headers: dict | None = None) -> None:
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    resp.text = ujson.dumps(body, ensure_ascii=False, escape_forward_slashes=False)
    for k, v in (headers or {}).items():
        resp.set_header(k, v)


def handle_api_error(req, resp, ex: APIError, params) -> None:
    _write(resp, ex.status, ex.body(), ex.headers)


def handle_http_error(req, resp, ex: falcon.HTTPError, params) -> None:
    """Falcon's own errors (unknown route, wrong method...) in the OpenAI shape."""
    status = ex.status_code
    message = ex.description or ex.title or "error"
    if status == 404:
        message = f"no route for {req.method} {req.path}"
    elif status == 405:
        message = f"method {req.method} is not allowed on {req.path}"
    headers = dict(ex.headers or {})
    _write(resp, status, error_body(message, _TYPES.get(status, "invalid_request_error")), headers)


def handle_unexpected(req, resp, ex: Exception, params) -> None:
    """Anything else is a bug in this server: log it, answer 500 without internals."""
    if isinstance(ex, falcon.HTTPError):
        return handle_http_error(req, resp, ex, params)
    log.exception("unhandled error on %s %s", req.method, req.path)
    _write(resp, 500, error_body("internal server error", "server_error"))


def handle_client_gone(req, resp, ex: Exception, params) -> None:
    """The client closed its connection: its sequences are cancelled; nobody reads an answer."""
    resp.status = CLIENT_CLOSED
    resp.text = ""


def install(app: falcon.App) -> None:
    app.add_error_handler(Exception, handle_unexpected)
    app.add_error_handler(falcon.HTTPError, handle_http_error)
    app.add_error_handler(APIError, handle_api_error)
    app.add_error_handler(ClientDisconnected, handle_client_gone)
