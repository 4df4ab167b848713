"""The Falcon WSGI app, built with injected dependencies (no globals, no monkey-patching)."""
from __future__ import annotations

import falcon

from engine.client import EngineClient
from engine.errors import Saturated
from server import errors
from server.auth import Authenticate
from server.completions import ChatCompletions, Completions
from server.config import ServerConfig
from server.generation import Generator
from server.infer import Infer
from server.openapi import OpenAPIDocument
from server.status import Health, Models
from server.telemetry import Telemetry
from server.tenants import TenantRegistry, Tenants


class VaryOrigin:
    """With a list of allowed origins the answer depends on ``Origin``: say so to caches."""

    def process_response(self, req, resp, resource, req_succeeded) -> None:
        resp.append_header("Vary", "Origin")


class Observe:
    """Falcon middleware: every response carries ``X-Request-ID`` (the client's, or a new one);
    every POST to a generation route (a resource with ``observed = True``) is finished in
    :class:`Telemetry` once its answer is complete: at once, or when a stream's body closes."""

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
    """Falcon middleware: a POST to a generation route while every mailbox is leased gets its 503
    (``Saturated``, ``Retry-After``) before its body is read, parsed or tokenized. Under
    overload most requests are refused, and refusing must stay cheap so that the refusals come
    at once and leave the CPUs to the requests being served. The engine client's own check at
    submission remains the one that decides."""

    def __init__(self, engine: EngineClient):
        self.engine = engine

    def process_resource(self, req: falcon.Request, resp: falcon.Response, resource, params) -> None:
        if getattr(resource, "observed", False) and req.method == "POST" and self.engine.saturated():
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


def create_app(config: ServerConfig, generator: Generator, tenants: TenantRegistry | None = None,
               telemetry: Telemetry | None = None) -> falcon.App:
    """Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
    ``/v1/models/{model}``, ``/health`` (= ``/health/ready``), ``/health/live``, ``/infer``, and
    ``/metrics`` with metrics on (on its own port with ``--metrics-port``), and ``/openapi.json``
    (:mod:`server.openapi`). Errors follow :mod:`server.errors`.

    Args:
        config: validated settings. generator: the request path over an engine client (a real
            engine process under gunicorn; an in-process engine in contract tests).
        tenants: API keys and limits (None: no tenant file, everyone is the default tenant).
        telemetry: request metrics and logs (None: as ``config`` says).
    """
    tenants = tenants or TenantRegistry(Tenants([]))
    telemetry = telemetry or Telemetry(config.metrics, config.log_prompts)
    middleware = [Observe(telemetry), Authenticate(tenants), Admission(generator.engine)]
    if config.metrics_port:
        middleware.insert(0, MetricsPort(config.metrics_port))
    if config.cors_origins:
        # Falcon's own CORS: preflight OPTIONS answered with Access-Control-Allow-Methods and
        # -Headers (it echoes the requested headers, Authorization included), and the
        # Access-Control-Allow-Origin header added to every response, errors and streams too.
        middleware.insert(0, falcon.CORSMiddleware(allow_origins=config.cors_origins, expose_headers="*"))
        if config.cors_origins != "*":
            middleware.insert(0, VaryOrigin())
    app = falcon.App(middleware=middleware)
    errors.install(app)
    app.add_route("/v1/chat/completions", ChatCompletions(config, generator))
    app.add_route("/v1/completions", Completions(config, generator))
    models = Models(config)
    app.add_route("/v1/models", models)
    app.add_route("/v1/models/{model:path}", models, suffix="one")  # names may hold "/"
    health = Health(generator.engine)
    app.add_route("/health", health)
    app.add_route("/health/ready", health)
    app.add_route("/health/live", health, suffix="live")
    app.add_route("/infer", Infer(config, generator, tenants))
    if telemetry.metrics is not None:
        from server.metrics import Scrape
        app.add_route("/metrics", Scrape(generator.engine))
    metrics_here = telemetry.metrics is not None and not config.metrics_port
    app.add_route("/openapi.json", OpenAPIDocument(() if metrics_here else ("/metrics",)))
    return app
