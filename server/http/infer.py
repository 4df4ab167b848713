"""``POST /infer``, the original endpoint, over HTTP: the Falcon resource around
:func:`server.api.infer.parse_infer` and :func:`server.api.infer.infer_result` (the request and
response are described there)."""
from __future__ import annotations

import falcon

from server.api.infer import infer_result, parse_infer
from server.config import ServerConfig
from server.model_router import GENERATION, ModelRouter
from server.http.body import read_json
from server.http.json import dumps
from server.tenancy.tenants import TenantRegistry


class Infer:
    """The HTTP route (:func:`parse_infer`, :func:`infer_result`)."""

    observed = True  # telemetry (server/http/middleware.py, Observe)

    def __init__(self, config: ServerConfig, models: ModelRouter, tenants: TenantRegistry):
        self.config, self.models, self.tenants = config, models, tenants

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        started = req.context.record.started
        body = read_json(req, self.config.max_body_bytes)
        _, served, tenant = self.models.pick(body, req.context.tenant, GENERATION)
        tenant_id, greq, payload = parse_infer(body, tenant, self.tenants)
        gen = served.generator.infer(payload, greq, tenant=tenant,
                                   watch_socket=req.env.get("gunicorn.socket"))
        req.context.record.attach(gen, body["payload"])
        (choice,) = gen.collect()
        resp.content_type = falcon.MEDIA_JSON
        resp.text = dumps(infer_result(tenant_id, choice, gen, started))
