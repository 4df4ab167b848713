"""``GET /health`` (Kubernetes probes) and ``GET /v1/models`` (OpenAI API reference: Models)."""
from __future__ import annotations

import time

import falcon

from engine.client import EngineClient
from engine.errors import EngineUnavailable, ModelNotFound
from server.config import ServerConfig


class Health:
    """200 ``{"status": "ok"}`` when the engine is ready; 503 while loading or unavailable.
    Needs no API key."""

    public = True

    def __init__(self, engine: EngineClient):
        self.engine = engine

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not self.engine.ready():
            raise EngineUnavailable("engine is loading or unavailable")
        resp.media = {"status": "ok"}

    def on_head(self, req: falcon.Request, resp: falcon.Response) -> None:
        self.on_get(req, resp)  # some probes and load balancers use HEAD


class Models:
    """The served model under each of its names, with ``context_length``: the real per-sequence
    token limit. Every GET answers HEAD too (HTTP requires it)."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.created = int(time.time())

    def card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created,
                "owned_by": "local", "context_length": self.config.max_seq_len}

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = {"object": "list", "data": [self.card(name) for name in self.config.model_ids]}

    def on_get_one(self, req: falcon.Request, resp: falcon.Response, model: str) -> None:
        if not model:  # "/v1/models/": no model named, so no such route
            raise falcon.HTTPNotFound()
        if model not in self.config.model_ids:
            raise ModelNotFound(f"The model {model!r} does not exist", "model")
        resp.media = self.card(model)

    on_head = on_get
    on_head_one = on_get_one
