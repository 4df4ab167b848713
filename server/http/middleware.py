"""The HTTP front end's Falcon middleware, in the order a request meets it: :class:`VaryOrigin`
(with CORS origins) and :class:`MetricsPort` (with ``--metrics-port``), :class:`Observe`
(request ids and telemetry),
:class:`Authenticate` (API keys: every route but the public ones runs as the tenant its key
names, ``server/tenancy/tenants.py``) and :class:`Admission` (a saturated server refuses before
parsing); :class:`ClosingStream` finishes a stream's telemetry when its body closes."""
from __future__ import annotations

import falcon

from engine.client import EngineClient
from engine.errors import Saturated
from server import errors
from server.api.errors import AdminOnly, NotFound, Unauthenticated
from server.control.state import admin_id
from server.observability.telemetry import Telemetry
from server.tenancy.tenants import TenantRegistry, key_of


class VaryOrigin:
    """With a list of allowed origins the answer depends on ``Origin``: say so to caches."""

    def process_response(self, req, resp, resource, req_succeeded) -> None:
        resp.append_header("Vary", "Origin")


class Observe:
    """Falcon middleware: every response carries ``X-Request-ID`` (the client's, or a new one),
    and an admitted generation's answer its tenant's ``x-ratelimit-*`` headers as admission
    found the buckets (``errors.bucket_headers``; a 429 has them from its error); every POST to a
    generation route (a resource with ``observed = True``) is finished in :class:`Telemetry` once
    its answer is complete: at once, or when a stream's body closes."""

    def __init__(self, telemetry: Telemetry):
        self.telemetry = telemetry

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        req.context.record = self.telemetry.start(None, req.get_header("X-Request-ID"))

    def process_resource(self, req: falcon.Request, resp: falcon.Response, resource, params) -> None:
        if getattr(resource, "observed", False) and req.method == "POST":
            req.context.record.route = req.uri_template

    def process_response(self, req: falcon.Request, resp: falcon.Response, resource, req_succeeded) -> None:
        record = req.context.get("record")
        if record is None:
            return
        resp.set_header("X-Request-ID", record.request_id)
        if record.generation is not None:
            resp.set_headers(errors.bucket_headers(record.generation.rate_buckets))
        if record.route is None:
            return
        record.tenant = req.context.get("tenant") or record.tenant
        if resp.stream is None:
            self.telemetry.finish(record, resp.status_code, req.context.get("error"))
            return

        def finish():  # a stream's status is 200 unless its output loop failed (error event)
            error = record.generation.error if record.generation is not None else None
            self.telemetry.finish(record, errors.http_status(error) if error else 200, error)
        resp.stream = ClosingStream(resp.stream, finish)


class Admission:
    """Falcon middleware: a POST to a model route while every mailbox of every engine is leased
    gets its 503 (``Saturated``, ``Retry-After``) before its body is read, parsed or tokenized
    (which model it asks for is in the body: one engine's room cannot refuse it yet). Under
    overload most requests are refused, and refusing must stay cheap so that the refusals come
    at once and leave the CPUs to the requests being served. The engine client's own check at
    submission remains the one that decides."""

    def __init__(self, engines: list[EngineClient]):
        self.engines = engines

    def process_resource(self, req: falcon.Request, resp: falcon.Response, resource, params) -> None:
        if getattr(resource, "observed", False) and req.method == "POST" \
                and all(engine.saturated() for engine in self.engines):
            raise Saturated(retry_after=1)


class ClosingStream:
    """A WSGI response body that calls ``on_close`` after the body's own ``close`` (which the
    server calls when the body is sent or the client left; PEP 3333)."""

    def __init__(self, body, on_close):
        self.body, self.on_close = body, on_close

    def __iter__(self):
        return iter(self.body)

    def close(self) -> None:
        try:
            if hasattr(self.body, "close"):
                self.body.close()
        finally:
            self.on_close()


class MetricsPort:
    """With ``--metrics-port``, that listener serves ``/metrics`` only, and the HTTP port does
    not serve it (gunicorn gives the listener's port as ``SERVER_PORT``)."""

    def __init__(self, port: int):
        self.port = str(port)

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if (req.env.get("SERVER_PORT") == self.port) != (req.path == "/metrics"):
            raise falcon.HTTPNotFound()


class Authenticate:
    """Falcon middleware: sets ``req.context.tenant`` from ``Authorization: Bearer <key>`` or
    ``X-Tenant-ID: <key>``; on an admin route (a resource with ``admin = True``), sets
    ``req.context.admin`` to the admin key's id instead.

    Raises:
        Unauthenticated: keys are required and the key is missing or unknown (401); on an admin
            route, anything but a tenant's key or an admin key. The message never repeats the key.
        AdminOnly: a tenant's key on an admin route (403).
        NotFound: an admin route while no admin key is configured (the Admin API is off).
    """

    def __init__(self, tenants: TenantRegistry):
        self.tenants = tenants

    def process_resource(self, req: falcon.Request, resp: falcon.Response, resource, params) -> None:
        if resource is None or getattr(resource, "public", False) or req.method == "OPTIONS":
            return  # a CORS preflight carries no credentials
        key = key_of(req.get_header("Authorization"), req.get_header("X-Tenant-ID"))
        if getattr(resource, "admin", False):
            self._admin(req, key)
            return
        tenant = self.tenants.authenticate(key)
        if tenant is None:
            raise Unauthenticated.of(key, "Authorization")
        req.context.tenant = tenant

    def _admin(self, req: falcon.Request, key: str | None) -> None:
        control = self.tenants.control
        if control is None or not control.admin_keys:
            raise NotFound("the Admin API is off: start the server with --admin-keys-file or ADMIN_KEYS", "path")
        if control.is_admin(key):
            req.context.admin = admin_id(key)
            return
        if key and self.tenants.authenticate(key) is not None:  # never open here: admin keys exist
            raise AdminOnly("this route needs an admin key; a project's key cannot manage projects")
        raise Unauthenticated.of(key, "Authorization")
