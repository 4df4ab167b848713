"""``GET /health``, ``/health/ready`` and ``/health/live``: the Kubernetes probes."""
from __future__ import annotations

import os

import falcon

from engine.client import EngineClient
from engine.errors import EngineUnavailable, ShuttingDown


class Health:
    """Probes; none needs an API key (docs/operations.md "Stopping and draining", k8s/README.md).

    - ``GET /health/ready`` (and ``/health``, kept for compatibility): 200 ``{"status": "ok"}``
      when every model's engine would serve a request; 503 while a model loads, while an engine
      restarts (the others serve meanwhile, but a replica short of a model takes no new traffic
      for those seconds) and from the first moment of a drain. For readiness and startup probes.
    - ``GET /health/live``: 200 ``{"status": "alive"}`` while this worker answers and its
      master lives, also while the engine restarts (the server heals that itself). For
      liveness probes: a pod restart would not help anything this probe passes.
    """

    public = True

    def __init__(self, engines: list[EngineClient]):
        self.engines = engines
        self.master = os.getppid()

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        if any(engine.draining() for engine in self.engines):
            raise ShuttingDown("the server is shutting down")
        if not all(engine.ready() for engine in self.engines):
            raise EngineUnavailable("an engine is loading or unavailable")
        resp.media = {"status": "ok"}

    def on_get_live(self, req: falcon.Request, resp: falcon.Response) -> None:
        if os.getppid() != self.master:  # orphaned: the master died and took the engine with it
            raise EngineUnavailable("the server's master process is gone")
        resp.media = {"status": "alive"}

    # some probes and load balancers use HEAD
    on_head = on_get
    on_head_live = on_get_live
