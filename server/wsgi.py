"""WSGI entry for gunicorn workers: ``server.wsgi:app``.

Imported in each worker after fork: its settings from the environment the gunicorn master
prepared (``server.gunicorn_conf``), its tenant file (:data:`tenants`, reloaded on SIGHUP), and
its app (:func:`server.http.worker_app.build`: its own tokenizer, engine attachment and response
store).

A worker that cannot build its app (llama.cpp refuses a model file whose metadata the master
read: its tensors cut short, an architecture this llama.cpp does not know) says why in one line
and the master stops (``server.gunicorn_conf.worker_cannot_start``), where gunicorn would print
the worker's traceback.
"""
from __future__ import annotations

from engine.config import one_line
from server.config import ServerConfig
from server.gunicorn_conf import accepted_tenants, worker_cannot_start
from server.http.worker_app import build
from server.tenancy.tenants import TenantRegistry

try:
    config = ServerConfig.from_env()
    tenants = TenantRegistry(accepted_tenants())
    app = build(config, tenants)
except Exception as e:  # noqa: BLE001 - a start-up error is one line, not a worker traceback
    worker_cannot_start(f"inference-server: a worker cannot start: {one_line(e)}")
