"""The front end's refusals besides a malformed field (:class:`engine.errors.InvalidRequest`):
who calls (an API key, a tenant's permission) and which model it names. Mapped to HTTP and gRPC
statuses by ``server/errors.py`` (401, 403, 404)."""
from __future__ import annotations

from engine.errors import RequestError


class Unauthenticated(RequestError):
    """A missing or unknown API key while a tenant file is loaded (HTTP 401, gRPC UNAUTHENTICATED).
    The message never repeats the key."""

    code = "invalid_api_key"

    @classmethod
    def of(cls, key: str | None, send: str) -> "Unauthenticated":
        """The refusal of ``key`` (None: none was sent); ``send``: how a key is sent over this
        protocol, as the message tells it (``Authorization``, ``metadata authorization``)."""
        return cls(f"missing API key: send {send}: Bearer <key>" if key is None else "unknown API key")


class PermissionDenied(RequestError):
    """The key is valid but may not do this, e.g. name another tenant (HTTP 403, gRPC
    PERMISSION_DENIED)."""

    code = "permission_denied"


class ModelNotFound(RequestError):
    """The request names a model this server does not serve (HTTP 404, gRPC NOT_FOUND)."""

    code = "model_not_found"


class NotFound(RequestError):
    """The route names an object that does not exist (HTTP 404, gRPC NOT_FOUND)."""

    code = "not_found"


class Conflict(RequestError):
    """The object cannot be changed that way now: a project the tenant file defines, a bound
    reached (HTTP 409)."""

    code = "conflict"


class AdminOnly(PermissionDenied):
    """A tenant's key on an admin route (HTTP 403)."""

    code = "admin_key_required"
