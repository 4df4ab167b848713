"""The Falcon WSGI app, built with injected dependencies (no globals, no monkey-patching)."""
from __future__ import annotations

import falcon

from engine.client import EngineClient
from server import errors
from server.chat_template import ChatTemplate
from server.completions import ChatCompletions, Completions
from server.config import ServerConfig
from server.infer import Infer
from server.status import Health, Models
from server.tokenizer import Tokenizer


def create_app(config: ServerConfig, engine: EngineClient, tokenizer: Tokenizer,
               template: ChatTemplate) -> falcon.App:
    """Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``,
    ``/v1/models/{model}``, ``/health``, ``/infer``. Errors follow :mod:`server.errors`."""
    app = falcon.App()
    errors.install(app)
    deps = (config, engine, tokenizer, template)
    app.add_route("/v1/chat/completions", ChatCompletions(*deps))
    app.add_route("/v1/completions", Completions(*deps))
    models = Models(config)
    app.add_route("/v1/models", models)
    app.add_route("/v1/models/{model}", models, suffix="one")
    app.add_route("/health", Health(engine))
    app.add_route("/infer", Infer(*deps))
    return app
