"""The Admin API's routes (OpenAI's, under ``/v1/organization``; the operations are
``server/control/admin.py``'s, the usage page ``server/control/usage.py``'s), ``GET
/v1/organization/engine`` (ours: the engine now, for the admin page) and the admin page
(``/admin``, static files in ``server/http/admin_page/``).

Every route here needs an admin key (:class:`server.http.middleware.Authenticate`: no key 401,
a tenant's key 403). Every change is one log line on the ``admin`` logger: a JSON object with
``event``, ``admin`` (the admin key's id, never its value), ``action``, ``target`` and ``at``
(ISO 8601, UTC).
"""
from __future__ import annotations

import json
import logging
import mimetypes
import os
import time

import falcon

from engine.client import EngineClient
from engine.errors import InvalidRequest
from server.api.errors import NotFound
from server.api.fields import shown
from server.config import ServerConfig
from server.control.admin import Admin
from server.control.usage import usage_page
from server.http.body import read_json

log = logging.getLogger("admin")
PAGE_DIR = os.path.join(os.path.dirname(__file__), "admin_page")


def _paging(req: falcon.Request, *others: str) -> tuple[str | None, int]:
    """``after`` and ``limit`` (1 to 100, default 20) of a list route; ``others``: the other
    query parameters it takes. OpenAI's ``before`` is refused: lists here page forward only."""
    for name in req.params:
        if name not in ("after", "limit", *others):
            raise InvalidRequest(f"query parameter {shown(name)} is not supported here", name)
    limit = req.params.get("limit", "20")
    if not isinstance(limit, str) or not (limit.isascii() and limit.isdigit()) or not 1 <= int(limit) <= 100:
        raise InvalidRequest(f"limit must be an integer in [1, 100], got {shown(limit)}", "limit")
    after = req.params.get("after")
    if after is not None and not isinstance(after, str):
        raise InvalidRequest("after must be given once", "after")
    return after, int(limit)


@falcon.before(lambda req, resp, resource, params: resource.admin.sync())
class AdminAPI:
    """Every Admin API route, one ``on_<method>_<suffix>`` responder each; each first takes
    the state's latest version (:meth:`Admin.sync`)."""

    admin = True  # server/http/middleware.py: admin keys only

    def __init__(self, config: ServerConfig, admin: Admin):
        self.config, self.admin = config, admin

    def _body(self, req: falcon.Request) -> dict:
        return read_json(req, self.config.max_body_bytes)

    def _done(self, req: falcon.Request, resp: falcon.Response, result: tuple[dict, tuple[str, str]]) -> None:
        """Answer with the object and write the audit line."""
        obj, (action, target) = result
        log.info(json.dumps({"event": "admin", "admin": req.context.admin, "action": action, "target": target,
                             "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
        resp.media = obj

    # projects
    def on_get_projects(self, req, resp):
        after, limit = _paging(req, "include_archived")
        archived = req.params.get("include_archived", "false")
        if archived not in ("true", "false"):
            raise InvalidRequest(f"include_archived must be true or false, got {shown(archived)}", "include_archived")
        resp.media = self.admin.list_projects(after, limit, archived == "true")

    def on_post_projects(self, req, resp):
        self._done(req, resp, self.admin.create_project(self._body(req)))

    def on_get_project(self, req, resp, project_id):
        resp.media = self.admin.project_object(self.admin.project(project_id))

    def on_post_project(self, req, resp, project_id):
        self._done(req, resp, self.admin.modify_project(project_id, self._body(req)))

    def on_delete_project(self, req, resp, project_id):
        self._done(req, resp, self.admin.delete_project(project_id))

    def on_post_archive(self, req, resp, project_id):
        self._done(req, resp, self.admin.archive_project(project_id))

    # service accounts
    def on_get_accounts(self, req, resp, project_id):
        resp.media = self.admin.list_accounts(project_id, *_paging(req))

    def on_post_accounts(self, req, resp, project_id):
        self._done(req, resp, self.admin.create_account(project_id, self._body(req)))

    def on_get_account(self, req, resp, project_id, service_account_id):
        resp.media = self.admin.get_account(project_id, service_account_id)

    def on_post_account(self, req, resp, project_id, service_account_id):
        self._done(req, resp, self.admin.update_account(project_id, service_account_id, self._body(req)))

    def on_delete_account(self, req, resp, project_id, service_account_id):
        self._done(req, resp, self.admin.delete_account(project_id, service_account_id))

    def on_post_account_keys(self, req, resp, project_id, service_account_id):
        self._done(req, resp, self.admin.create_account_key(project_id, service_account_id, self._body(req)))

    # keys
    def on_get_keys(self, req, resp, project_id):
        access = req.params.get("owner_project_access")
        resp.media = self.admin.list_keys(project_id, *_paging(req, "owner_project_access"),
                                          access if isinstance(access, str) or access is None else "")

    def on_get_key(self, req, resp, project_id, api_key_id):
        resp.media = self.admin.get_key(project_id, api_key_id)

    def on_delete_key(self, req, resp, project_id, api_key_id):
        self._done(req, resp, self.admin.delete_key(project_id, api_key_id))

    def on_post_rotate(self, req, resp, project_id, api_key_id):
        self._done(req, resp, self.admin.rotate_key(project_id, api_key_id, self._body(req)))

    # limits
    def on_get_rate_limits(self, req, resp, project_id):
        resp.media = self.admin.list_rate_limits(project_id, *_paging(req))

    def on_post_rate_limit(self, req, resp, project_id, rate_limit_id):
        self._done(req, resp, self.admin.update_rate_limit(project_id, rate_limit_id, self._body(req)))

    def on_get_spend_limit(self, req, resp, project_id):
        resp.media = self.admin.get_spend_limit(project_id)

    def on_post_spend_limit(self, req, resp, project_id):
        self._done(req, resp, self.admin.update_spend_limit(project_id, self._body(req)))

    def on_delete_spend_limit(self, req, resp, project_id):
        self._done(req, resp, self.admin.delete_spend_limit(project_id))

    def on_get_model_permissions(self, req, resp, project_id):
        resp.media = self.admin.get_model_permissions(project_id)

    def on_post_model_permissions(self, req, resp, project_id):
        self._done(req, resp, self.admin.update_model_permissions(project_id, self._body(req)))

    def on_delete_model_permissions(self, req, resp, project_id):
        self._done(req, resp, self.admin.delete_model_permissions(project_id))

    # usage
    def on_get_usage(self, req, resp):
        resp.media = usage_page(self.admin.control.store, req.params, model_of=self.admin.model_of)

    def on_get_usage_embeddings(self, req, resp):
        resp.media = usage_page(self.admin.control.store, req.params, api="embeddings", model_of=self.admin.model_of)


class EngineNow:
    """``GET /v1/organization/engine`` (ours): per model's engine, its kind (``generate`` or
    ``embed``), slots in use of all, sequences queued, KV cells held of the budget, prefix-cache
    entries and tokens, preemptions so far; as of its last step. The default model's at the top
    level, every model's in ``models``.

    Args:
        engines: model id -> (its engine's client, its ``--kv-cache-tokens``, its kind), the
            default first.
    """

    admin = True

    def __init__(self, engines: dict[str, tuple[EngineClient, int, str]]):
        self.engines = engines

    @staticmethod
    def state(engine: EngineClient, budget: int, kind: str) -> dict:
        snap = engine.snapshot()
        return {"kind": kind, "ready": engine.ready(), "slots_in_use": sum(1 for m in snap.slot_mailbox if m >= 0),
                "slots": len(snap.slot_mailbox), "queued": snap.n_waiting, "kv_cells": snap.kv_cells,
                "kv_cells_budget": budget, "prefix_cache_entries": snap.cache_entries,
                "prefix_cache_tokens": snap.cache_tokens, "preemptions": snap.preemptions}

    def on_get(self, req, resp):
        models = [{"model": model, **self.state(*engine)} for model, engine in self.engines.items()]
        resp.media = {"object": "engine.state", **{k: v for k, v in models[0].items() if k != "model"},
                      "models": models}


class AdminPage:
    """``GET /admin`` and its files. The page itself is public (it holds no data); it asks for an
    admin key and sends it to the Admin API, which checks it."""

    public = True

    def on_get(self, req, resp):
        self._file(resp, "index.html")

    def on_get_file(self, req, resp, name):
        self._file(resp, name or "index.html")  # /admin/ too

    @staticmethod
    def _file(resp, name: str) -> None:
        if name not in os.listdir(PAGE_DIR):  # only the page's own files, never a path
            raise NotFound(f"no such file {shown(name)}", "path")
        with open(os.path.join(PAGE_DIR, name), "rb") as f:
            resp.data = f.read()
        resp.content_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
        resp.set_header("Cache-Control", "no-store")
        resp.set_header("Content-Security-Policy", "default-src 'self'; style-src 'self' 'unsafe-inline'")
        resp.set_header("X-Frame-Options", "DENY")


def add_routes(app: falcon.App, config: ServerConfig, admin: Admin,
               engines: dict[str, tuple[EngineClient, int, str]]) -> None:
    """The Admin API's routes, the engine route and the admin page."""
    api, base = AdminAPI(config, admin), "/v1/organization"
    project = base + "/projects/{project_id}"
    for path, suffix in ((base + "/projects", "projects"), (project, "project"), (project + "/archive", "archive"),
                         (project + "/service_accounts", "accounts"),
                         (project + "/service_accounts/{service_account_id}", "account"),
                         (project + "/service_accounts/{service_account_id}/api_keys", "account_keys"),
                         (project + "/api_keys", "keys"), (project + "/api_keys/{api_key_id}", "key"),
                         (project + "/api_keys/{api_key_id}/rotate", "rotate"),
                         (project + "/rate_limits", "rate_limits"),
                         (project + "/rate_limits/{rate_limit_id:path}", "rate_limit"),  # rl-org/model
                         (project + "/spend_limit", "spend_limit"),
                         (project + "/model_permissions", "model_permissions"),
                         (base + "/usage/completions", "usage"),
                         (base + "/usage/embeddings", "usage_embeddings")):
        app.add_route(path, api, suffix=suffix)
    app.add_route(base + "/engine", EngineNow(engines))
    page = AdminPage()
    app.add_route("/admin", page)
    app.add_route("/admin/{name}", page, suffix="file")
