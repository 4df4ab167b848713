"""The Falcon WSGI app, built with injected dependencies (no globals, no monkey-patching): its
routes and its middleware (``server/http/middleware.py``)."""
from __future__ import annotations

import falcon

from server import errors
from server.config import ServerConfig
from server.generation.pipeline import Generator
from server.model_router import ModelRouter
from server.control.admin import Admin
from server.http.admin import add_routes as add_admin_routes
from server.http.completions import ChatCompletions, Completions
from server.http.embeddings import Embeddings
from server.http.health import Health
from server.http.infer import Infer
from server.http.middleware import Admission, Authenticate, MetricsPort, Observe, VaryOrigin
from server.http.models import Models
from server.http.openapi import OpenAPIDocument, admin_paths
from server.http.responses import InputItems, Responses, StoredResponse
from server.http.tokenize import Detokenize, Tokenize, TokenizerInfo
from server.observability.telemetry import Telemetry
from server.responses.store import LocalStore, RedisStore, StoreLimits
from server.tenancy.tenants import TenantRegistry, Tenants


def response_store(config: ServerConfig, path: str = ":memory:"):
    """The Responses API's store (``server/responses/store.py``): in Redis with ``--redis-url``,
    else the node's SQLite file ``path`` (``:memory:``: this process only), bounded per tenant
    by the ``--response-store-*`` flags."""
    limits = StoreLimits(config.response_store_max_entries, config.response_store_max_bytes,
                         config.response_store_ttl_s)
    return RedisStore(config.redis_url, limits) if config.redis_url else LocalStore(path, limits)


def create_app(config: ServerConfig, models: ModelRouter | Generator, tenants: TenantRegistry | None = None,
               telemetry: Telemetry | None = None, store=None) -> falcon.App:
    """Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` (and
    ``/v1/responses/{id}``, ``/v1/responses/{id}/input_items``), ``/v1/embeddings``, ``/v1/models``,
    ``/v1/models/{model}``, ``/tokenize``, ``/detokenize``, ``/tokenizer_info``, ``/health``
    (= ``/health/ready``), ``/health/live``, ``/infer``, with a control plane the Admin API
    (``/v1/organization/...``) and ``/admin`` (:mod:`server.http.admin`), and
    ``/metrics`` with metrics on (on its own port with ``--metrics-port``), and ``/openapi.json``
    (:mod:`server.http.openapi`). Errors follow :mod:`server.errors`.

    Args:
        config: validated settings. models: every served model's request path over its engine
            client (real engine processes under gunicorn), or one generator for the default
            model (an in-process engine in contract tests).
        tenants: API keys and limits (None: no tenant file, everyone is the default tenant).
        telemetry: request metrics and logs (None: as ``config`` says).
        store: the Responses store (None: :func:`response_store` of ``config``, in-process).
    """
    if isinstance(models, Generator):
        models = ModelRouter.single(config.models[0], models)
    store = store if store is not None else response_store(config)
    tenants = tenants or TenantRegistry(Tenants([]))
    telemetry = telemetry or Telemetry(config.metrics, config.log_prompts)
    middleware = [Observe(telemetry), Authenticate(tenants), Admission(list(models.engines().values()))]
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
    app.add_route("/v1/chat/completions", ChatCompletions(config, models))
    app.add_route("/v1/completions", Completions(config, models))
    app.add_route("/v1/embeddings", Embeddings(config, models))
    app.add_route("/v1/responses", Responses(config, models, store))
    app.add_route("/v1/responses/{response_id}", StoredResponse(store))
    app.add_route("/v1/responses/{response_id}/input_items", InputItems(store))
    listing = Models(models)
    app.add_route("/v1/models", listing)
    app.add_route("/v1/models/{model:path}", listing, suffix="one")  # names may hold "/"
    app.add_route("/tokenize", Tokenize(config, models))
    app.add_route("/detokenize", Detokenize(config, models))
    app.add_route("/tokenizer_info", TokenizerInfo(config, models))
    health = Health(list(models.engines().values()))
    app.add_route("/health", health)
    app.add_route("/health/ready", health)
    app.add_route("/health/live", health, suffix="live")
    app.add_route("/infer", Infer(config, models, tenants))
    accounting = models.default.accounting
    admin_on = accounting is not None and bool(accounting.control.admin_keys)
    # an embedding engine keeps no KV cells between steps: no budget to show
    budgets = {m.spec.id: 0 if m.embedder is not None else config.engine_config(m.spec).kv_cache_tokens
               for m in models.models}
    kinds = {m.spec.id: m.spec.kind for m in models.models}
    if accounting is not None:  # the Admin API over the control plane the accounting uses
        add_admin_routes(app, config, Admin(accounting.control, accounting.price, config.model_ids,
                                          {name: spec.id for spec in config.models for name in spec.names}),
                         {model: (engine, budgets[model], kinds[model]) for model, engine in models.engines().items()})
    if telemetry.metrics is not None:
        from server.observability.metrics import Scrape
        # with admin keys, metrics on the public port need one (they name the projects)
        guarded = admin_on and not config.metrics_port
        generating = {m.spec.id for m in models.models if m.generator is not None}  # KV cells: generation only
        app.add_route("/metrics", Scrape(models.engines(), tenants.control, admin=guarded,
                                         names={name: m.engine for name, m in models.by_name.items()},
                                         kv_cache_tokens={name: budgets[m.spec.id] for name, m in models.by_name.items()
                                                          if m.spec.id in generating}))
    metrics_here = telemetry.metrics is not None and not config.metrics_port
    app.add_route("/openapi.json", OpenAPIDocument((() if metrics_here else ("/metrics",))
                                                   + (() if admin_on else admin_paths())))
    return app
