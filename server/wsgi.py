"""WSGI entry for gunicorn workers: ``server.wsgi:app``.

Built in each worker after fork from the environment the gunicorn master prepared
(``server.gunicorn_conf``): the configuration variables and ``INFERENCE_SHM``, the name of the
shared-memory transport, and ``INFERENCE_RESPONSES_DB``, the node's response store. Each worker loads its own tokenizer (``vocab_only``) and tenant file
(:data:`tenants`, reloaded on SIGHUP).
"""
from __future__ import annotations

import os

from engine.client import EngineClient
from server.config import ServerConfig
from server.generation.pipeline import Generator
from server.gunicorn_conf import RESPONSES_DB_ENV, accepted_tenants
from server.http.app import create_app, response_store
from server.tenancy.ratelimit import RateLimiter
from server.tenancy.tenants import TenantRegistry
from server.text.chat_template import ChatTemplate
from engine.llama.tokenizer import Tokenizer

config = ServerConfig.from_env()
tenants = TenantRegistry(accepted_tenants())


def build():
    tokenizer = Tokenizer(config.resolved_model_path())
    engine = EngineClient.attach(os.environ["INFERENCE_SHM"])
    limiter = RateLimiter(engine.buckets, config.redis_url)
    generator = Generator(engine, tokenizer, ChatTemplate(tokenizer, config.chat_template_source()), limiter)
    # the node's response store, which the master created for its workers (server/gunicorn_conf.py)
    store = response_store(config, os.environ.get(RESPONSES_DB_ENV) or ":memory:")
    return create_app(config, generator, tenants, store=store)


app = build()
