"""WSGI entry for gunicorn workers: ``server.wsgi:app``.

Imported in each worker after fork: its settings from the environment the gunicorn master
prepared (``server.gunicorn_conf``), its tenant file (:data:`tenants`, reloaded on SIGHUP), and
its app (:func:`server.http.worker_app.build`: its own tokenizer, engine attachment and response
store).

A worker that cannot build its app (llama.cpp refuses the model file the master could read the
metadata of, a chat template that fails to render) says why in one line and exits with
gunicorn's "app failed to load" status, on which the master stops (any other status would have
it boot workers again, each printing a traceback, for ever).
"""
from __future__ import annotations

import sys

from server.config import ServerConfig, one_line
from server.gunicorn_conf import accepted_tenants
from server.http.worker_app import build
from server.tenancy.tenants import TenantRegistry

#: gunicorn's ``Arbiter.APP_LOAD_ERROR``: a worker exiting with it halts the master.
APP_LOAD_ERROR = 4

try:
    config = ServerConfig.from_env()
    tenants = TenantRegistry(accepted_tenants())
    app = build(config, tenants)
except Exception as e:  # noqa: BLE001 - a start-up error is one line, not a worker traceback
    print(f"inference-server: a worker cannot start: {one_line(e)}", file=sys.stderr, flush=True)
    sys.exit(APP_LOAD_ERROR)
