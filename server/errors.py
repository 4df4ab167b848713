"""The error contract: every HTTP error body is OpenAI-shaped,
``{"error": {"message", "type", "param", "code"}}`` (OpenAI API reference, "Error codes"), and
every gRPC error a status code with the same message.

The domain errors of :mod:`engine.errors` and :mod:`server.api.errors` are mapped to HTTP here and nowhere else
(:func:`http_error`), both for Falcon's error handlers and for the error event of a stream that
has already started; :func:`grpc_error` derives the gRPC status from that mapping, so both
front ends refuse the same requests. :class:`APIError` is for what only HTTP has (413, 415).
"""
from __future__ import annotations

import logging

import falcon
import ujson

import math

from engine.errors import (ClientDisconnected, ConstraintFailed, DeadlineExceeded, EngineUnavailable, RateLimited,
                           RequestError, Saturated, ShuttingDown)
from server.api.errors import Conflict, ModelNotFound, NotFound, PermissionDenied, Unauthenticated
from server.control.accounting import QuotaExceeded
from server.control.store import ControlUnavailable
from server.responses.store import ResponseNotFound, StoreUnavailable

log = logging.getLogger("server")
CLIENT_CLOSED_STATUS = 499  # nginx's status for a client that left; never seen by the client
CLIENT_CLOSED = f"{CLIENT_CLOSED_STATUS} Client Closed Request"

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error",
          405: "invalid_request_error", 408: "invalid_request_error", 409: "invalid_request_error",
          424: "server_error", 413: "invalid_request_error",
          415: "invalid_request_error",
          429: "rate_limit_error", 503: "server_error", 500: "server_error"}


class APIError(Exception):
    """An HTTP-only error answered with ``status`` and an OpenAI-shaped body.

    Args:
        status: HTTP status (int). param: the request field at fault, if any.
        code: machine-readable code. headers: extra response headers.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def http_status(ex: BaseException) -> int:
    """The HTTP status :func:`http_error` answers ``ex`` with; 499 for a client that left
    (``ClientDisconnected``, or ``GeneratorExit``: the server stopped reading a stream)."""
    if isinstance(ex, (ClientDisconnected, GeneratorExit)):
        return CLIENT_CLOSED_STATUS
    if isinstance(ex, APIError):
        return ex.status
    if isinstance(ex, RateLimited):
        return 429
    if isinstance(ex, ConstraintFailed):  # the client's grammar cannot be followed: the client's to fix
        return 400
    if isinstance(ex, RequestError):
        return next((status for kind, status in _STATUS.items() if isinstance(ex, kind)), 400)
    if isinstance(ex, (Saturated, EngineUnavailable)):
        return 503
    return 500


def http_error(ex: Exception) -> tuple[int, dict, dict]:
    """``(status, body, headers)`` for a domain or HTTP error; anything unknown is a 500 (a bug
    in this server), logged, answered without internals."""
    status, param, code, headers = http_status(ex), None, None, {}
    if isinstance(ex, APIError):
        message, param, code, headers = ex.message, ex.param, ex.code, ex.headers
    elif isinstance(ex, QuotaExceeded):  # OpenAI's type and code; Retry-After: the month's end
        return status, error_body(ex.message, ex.code, None, ex.code), rate_limit_headers(ex)
    elif isinstance(ex, RateLimited):
        message, headers = ex.message, rate_limit_headers(ex)
        code = "concurrency_limit_exceeded" if ex.kind == "concurrency" else ex.code
    elif isinstance(ex, RequestError):
        message, param, code = ex.message, ex.param, ex.code
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
    elif isinstance(ex, ConstraintFailed):
        message, param, code = ex.message, ex.param, ex.code
    elif isinstance(ex, (Saturated, EngineUnavailable)):
        message = str(ex) or "engine unavailable"
        code = ("server_overloaded" if isinstance(ex, Saturated) else
                "server_shutting_down" if isinstance(ex, ShuttingDown) else
                "control_plane_unavailable" if isinstance(ex, ControlUnavailable) else "engine_unavailable")
        headers = {"Retry-After": str(ex.retry_after)}
    else:
        log.error("unhandled error: %r", ex, exc_info=ex)
        status, message = 500, "internal server error"
    return status, error_body(message, _TYPES.get(status, "invalid_request_error"), param, code), headers


_STATUS = {ModelNotFound: 404, Unauthenticated: 401, PermissionDenied: 403, ResponseNotFound: 404,
           NotFound: 404, Conflict: 409,
           StoreUnavailable: 424}  # 424 Failed Dependency: the store (Redis) could not be reached

#: gRPC status names (``grpc.StatusCode``) of the HTTP statuses :func:`http_error` gives.
_GRPC = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
         409: "ABORTED", 424: "UNAVAILABLE", 413: "INVALID_ARGUMENT", 415: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED",
         503: "UNAVAILABLE", 500: "INTERNAL"}


def grpc_error(ex: Exception) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    """``(grpc.StatusCode name, message, trailing metadata)`` for a domain error: the status of
    :func:`http_error`'s answer (bad field -> ``INVALID_ARGUMENT``, unknown key ->
    ``UNAUTHENTICATED``, another tenant's id -> ``PERMISSION_DENIED``, over quota ->
    ``RESOURCE_EXHAUSTED`` with ``retry-after-ms``, saturated or no engine -> ``UNAVAILABLE``),
    and ``DEADLINE_EXCEEDED`` for a deadline that passed before any token. The metadata holds
    the field at fault (``param``) and the OpenAI error ``code`` when there is one."""
    if isinstance(ex, DeadlineExceeded):
        return "DEADLINE_EXCEEDED", str(ex), ()
    status, body, headers = http_error(ex)
    err = body["error"]
    trailer = [(k, str(err[k])) for k in ("param", "code") if err[k] is not None]
    if "retry-after-ms" in headers:
        trailer.append(("retry-after-ms", headers["retry-after-ms"]))
    elif status == 503:
        trailer.append(("retry-after-ms", str(int(headers["Retry-After"]) * 1000)))
    return _GRPC.get(status, "INTERNAL"), err["message"], tuple(trailer)


def _duration(seconds: float) -> str:
    """OpenAI's reset format: ``1s``, ``250ms``, ``6m0s``."""
    seconds = min(seconds, 10**9)
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


def rate_limit_headers(ex: RateLimited) -> dict:
    """``Retry-After`` (whole seconds, rounded up), ``retry-after-ms`` (which OpenAI's SDK reads
    first) and the buckets' :func:`bucket_headers`."""
    retry = min(ex.retry_after_s, 10**9)  # finite whatever the bucket's parameters
    return {"Retry-After": str(max(1, math.ceil(retry))), "retry-after-ms": str(max(1, math.ceil(retry * 1000))),
            **bucket_headers(ex.buckets)}


def bucket_headers(buckets: dict) -> dict:
    """Per limited bucket (``{"requests" | "tokens": (limit, remaining, reset seconds)}``),
    ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``, as OpenAI sends them on every
    answer (on a 429, and on an admitted request with the buckets as it found them)."""
    headers = {}
    for kind, (limit, remaining, reset) in buckets.items():
        headers[f"x-ratelimit-limit-{kind}"] = str(int(limit))
        headers[f"x-ratelimit-remaining-{kind}"] = str(int(remaining))
        headers[f"x-ratelimit-reset-{kind}"] = _duration(reset)
    return headers


def _write(resp: falcon.Response, status: int, body: dict, headers: dict | None = None) -> None:
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    resp.text = ujson.dumps(body, ensure_ascii=False, escape_forward_slashes=False)
    for k, v in (headers or {}).items():
        resp.set_header(k, v)


def handle_error(req, resp, ex: Exception, params) -> None:
    """Falcon error handler for every error but Falcon's own and a client's hang-up. The error
    stays in ``req.context.error`` for telemetry (``server/observability/telemetry.py``)."""
    req.context.error = ex
    if isinstance(ex, falcon.HTTPError):
        return handle_http_error(req, resp, ex, params)
    _write(resp, *http_error(ex))


def handle_http_error(req, resp, ex: falcon.HTTPError, params) -> None:
    """Falcon's own errors (unknown route, wrong method...) in the OpenAI shape."""
    status = ex.status_code
    message = ex.description or ex.title or "error"
    if status == 404:
        message = f"no route for {req.method} {req.path}"
    elif status == 405:
        message = f"method {req.method} is not allowed on {req.path}"
    _write(resp, status, error_body(message, _TYPES.get(status, "invalid_request_error")), dict(ex.headers or {}))


def handle_client_gone(req, resp, ex: Exception, params) -> None:
    """The client closed its connection: its sequences are cancelled; nobody reads an answer."""
    req.context.error = ex
    resp.status = CLIENT_CLOSED
    resp.text = ""


def install(app: falcon.App) -> None:
    app.add_error_handler(Exception, handle_error)
    app.add_error_handler(falcon.HTTPError, handle_http_error)
    app.add_error_handler(ClientDisconnected, handle_client_gone)

