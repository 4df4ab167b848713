"""The Falcon WSGI app, built with injected dependencies (no globals, no monkey-patching)."""
from __future__ import annotations

import falcon

from server import errors
from server.auth import Authenticate
from server.completions import ChatCompletions, Completions
from server.config import ServerConfig
from server.generation import Generator
from server.infer import Infer
from server.status import Health, Models
from server.tenants import TenantRegistry, Tenants


class VaryOrigin:
    """With a list of allowed origins the answer depends on ``Origin``: say so to caches."""

    def process_response(self, req, resp, resource, req_succeeded) -> None:
        resp.append_header("Vary", "Origin")


def create_app(config: ServerConfig, generator: Generator, tenants: TenantRegistry | None = None) -> falcon.App:
    """Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
    ``/v1/models/{model}``, ``/health``, ``/infer``. Errors follow :mod:`server.errors`.

    Args:
        config: validated settings. generator: the request path over an engine client (a real
            engine process under gunicorn; an in-process engine in contract tests).
        tenants: API keys and limits (None: no tenant file, everyone is the default tenant).
    """
    tenants = tenants or TenantRegistry(Tenants([]))
    middleware = [Authenticate(tenants)]
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
    app.add_route("/health", Health(generator.engine))
    app.add_route("/infer", Infer(config, generator, tenants))
    return app
