"""The app a gunicorn worker serves (``server.wsgi:app``), built in the worker after fork from the
environment the master prepared (``server.gunicorn_conf``): the configuration variables,
``INFERENCE_SHM`` (the names of the models' shared-memory transports, comma-separated, in the
models' order) and ``INFERENCE_RESPONSES_DB`` (the
node's response store).

The master imports this module, without calling :func:`build`, while its engine loads: each
worker, and each replacement of one, then forks with what an app needs already imported
(llama_cpp, falcon, jinja2, llguidance...: 0.3 CPU-s a worker on this project's 2-core machine,
measured with ``python -X importtime``). It also loads every model's tokenizer there
(:func:`preload`), whose pages the workers then share. What :func:`build` makes stays each
worker's own.
"""
from __future__ import annotations

import os

import falcon

from server.config import ServerConfig
from server.control.state import ControlPlane
from server.model_router import ModelRouter
from server.http.app import create_app, response_store
from server.responses.store import RESPONSES_DB_ENV
from server.tenancy.tenants import TenantRegistry


def preload(config: ServerConfig) -> None:
    """In the master, before the workers fork: every model's tokenizer, which each worker's
    :func:`build` then finds loaded (``server.model_router.load_tokenizer``)."""
    ModelRouter.preload(config)


def build(config: ServerConfig, tenants: TenantRegistry) -> falcon.App:
    """A worker's app: its models (``ModelRouter.attach``: each model's tokenizer, its
    attachment to the model's engine, its accounting of spend and usage), the rate limiter (and
    Redis client), its copy of the control plane (``tenants.control``, polled), and the node's
    response store.

    Raises:
        KeyError: ``INFERENCE_SHM`` is not set (the worker was not started by the master).
    """
    tenants.control = ControlPlane.of(config, tenants.current).start()
    models = ModelRouter.attach(config, os.environ["INFERENCE_SHM"].split(","), tenants.control)
    # the node's response store, which the master created for its workers (server/gunicorn_conf.py)
    store = response_store(config, os.environ.get(RESPONSES_DB_ENV) or ":memory:")
    return create_app(config, models, tenants, store=store)
