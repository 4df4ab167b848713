"""``GET /health`` (Kubernetes probes) and ``GET /v1/models`` (OpenAI API reference: Models)."""
from __future__ import annotations

import os
import time

import falcon

from engine.client import EngineClient
from engine.errors import EngineUnavailable, ModelNotFound, ShuttingDown
from server.config import ServerConfig


class Health:
    """Probes; none needs an API key (docs/operations.md "Stopping and draining", k8s/README.md).

    - ``GET /health/ready`` (and ``/health``, kept for compatibility): 200 ``{"status": "ok"}``
      when a request would be served; 503 while the model loads, while the engine restarts and
      from the first moment of a drain. For readiness and startup probes.
    - ``GET /health/live``: 200 ``{"status": "alive"}`` while this worker answers and its
      master lives, also while the engine restarts (the server heals that itself). For
      liveness probes: a pod restart would not help anything this probe passes.
    """

    public = True

    def __init__(self, engine: EngineClient):
        self.engine = engine
        self.master = os.getppid()

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        if self.engine.draining():
            raise ShuttingDown("the server is shutting down")
        if not self.engine.ready():
            raise EngineUnavailable("engine is loading or unavailable")
        resp.media = {"status": "ok"}

    def on_get_live(self, req: falcon.Request, resp: falcon.Response) -> None:
        if os.getppid() != self.master:  # orphaned: the master died and took the engine with it
            raise EngineUnavailable("the server's master process is gone")
        resp.media = {"status": "alive"}

    # some probes and load balancers use HEAD
    on_head = on_get
    on_head_live = on_get_live


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
