"""The app a gunicorn worker serves (``server.wsgi:app``), built in the worker after fork from the
environment the master prepared (``server.gunicorn_conf``): the configuration variables,
``INFERENCE_SHM`` (the name of the shared-memory transport) and ``INFERENCE_RESPONSES_DB`` (the
node's response store).

The master imports this module, without calling :func:`build`, while its engine loads: each
worker, and each replacement of one, then forks with what an app needs already imported
(llama_cpp, falcon, jinja2, llguidance...: 0.3 CPU-s a worker on this project's 2-core machine,
measured with ``python -X importtime``). What :func:`build` makes stays each worker's own.
"""
from __future__ import annotations

import os

import falcon

from engine.client import EngineClient
from engine.llama.tokenizer import Tokenizer
from server.config import ServerConfig
from server.control.accounting import Accounting, Prices
from server.control.state import ControlPlane
from server.generation.pipeline import Generator
from server.http.app import create_app, response_store
from server.responses.store import RESPONSES_DB_ENV
from server.tenancy.ratelimit import RateLimiter
from server.tenancy.tenants import TenantRegistry
from server.text.chat_template import ChatTemplate


def build(config: ServerConfig, tenants: TenantRegistry) -> falcon.App:
    """A worker's app: its own tokenizer (the GGUF loaded ``vocab_only``), its attachment to the
    engine's shared memory, its rate limiter (and Redis client), its copy of the control plane
    (``tenants.control``, polled) with the accounting of spend and usage, and the node's
    response store.

    Raises:
        KeyError: ``INFERENCE_SHM`` is not set (the worker was not started by the master).
    """
    tokenizer = Tokenizer(config.resolved_model_path())
    _ = config.model_ids  # the GGUF's name read now (the master's read, forked), not by a first request
    engine = EngineClient.attach(os.environ["INFERENCE_SHM"])
    limiter = RateLimiter(engine.buckets, config.redis_url)
    tenants.control = ControlPlane.of(config, tenants.current).start()
    accounting = Accounting(tenants.control, Prices.load(config.prices_file), config.model_ids)
    generator = Generator(engine, tokenizer, ChatTemplate.of(tokenizer, config.chat_template_source()), limiter,
                          accounting)
    # the node's response store, which the master created for its workers (server/gunicorn_conf.py)
    store = response_store(config, os.environ.get(RESPONSES_DB_ENV) or ":memory:")
    return create_app(config, generator, tenants, store=store)
