"""API keys: every route but ``/health`` runs as the tenant its key names (``server/tenants.py``)."""
from __future__ import annotations

import falcon

from engine.errors import Unauthenticated
from server.tenants import TenantRegistry, key_of


class Authenticate:
    """Falcon middleware: sets ``req.context.tenant`` from ``Authorization: Bearer <key>`` or
    ``X-Tenant-ID: <key>``.

    Raises:
        Unauthenticated: a tenant file is loaded and the key is missing or unknown (401). The
        message never repeats the key.
    """

    def __init__(self, tenants: TenantRegistry):
        self.tenants = tenants

    def process_resource(self, req: falcon.Request, resp: falcon.Response, resource, params) -> None:
        if resource is None or getattr(resource, "public", False) or req.method == "OPTIONS":
            return  # a CORS preflight carries no credentials
        key = key_of(req.get_header("Authorization"), req.get_header("X-Tenant-ID"))
        tenant = self.tenants.authenticate(key)
        if tenant is None:
            raise Unauthenticated("missing API key: send Authorization: Bearer <key>" if key is None
                                  else "unknown API key")
        req.context.tenant = tenant
