"""WSGI entry for gunicorn workers: ``server.wsgi:app``.

Imported in each worker after fork: its settings from the environment the gunicorn master
prepared (``server.gunicorn_conf``), its tenant file (:data:`tenants`, reloaded on SIGHUP), and
its app (:func:`server.http.worker_app.build`: its own tokenizer, engine attachment and response
store).
"""
from __future__ import annotations

from server.config import ServerConfig
from server.gunicorn_conf import accepted_tenants
from server.http.worker_app import build
from server.tenancy.tenants import TenantRegistry

config = ServerConfig.from_env()
tenants = TenantRegistry(accepted_tenants())
app = build(config, tenants)
