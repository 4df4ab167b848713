"""WSGI entry for gunicorn workers: ``server.wsgi:app``.

Built in each worker after fork from the environment the gunicorn master prepared
(``server.gunicorn_conf``): the configuration variables and ``INFERENCE_SHM``, the name of the
shared-memory transport. Each worker loads its own tokenizer (``vocab_only``).
"""
from __future__ import annotations

import os

from engine.client import EngineClient
from server.app import create_app
from server.chat_template import ChatTemplate
from server.config import ServerConfig
from server.generation import Generator
from server.tokenizer import Tokenizer


def build():
    config = ServerConfig.from_env()
    tokenizer = Tokenizer(config.resolved_model_path())
    engine = EngineClient.attach(os.environ["INFERENCE_SHM"])
    return create_app(config, Generator(engine, tokenizer, ChatTemplate(tokenizer)))


app = build()
