"""Shared fixtures: a real engine process over a real shared-memory transport."""
from __future__ import annotations

import contextlib
import os
import time

import pytest

from engine.client import EngineClient
from engine.config import EngineConfig, default_model_path
from engine.supervisor import EngineSupervisor
from shm import Layout, Transport


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from server.tokenizer import Tokenizer
    return Tokenizer(model_path)


@pytest.fixture(scope="session")
def chat(tokenizer):
    from server.chat_template import ChatTemplate
    return ChatTemplate(tokenizer)


@contextlib.contextmanager
def running_engine(**overrides):
    """Yield ``(client, supervisor)`` for a fresh engine; everything is torn down after."""
    config = EngineConfig(**{"max_slots": 4, "max_seq_len": 256, "max_queued": 16, **overrides})
    transport = Transport.create(Layout(config.max_slots, config.n_mailboxes, config.max_seq_len))
    supervisor = EngineSupervisor(config, transport)
    try:
        supervisor.start()
        assert supervisor.wait_ready(120), "engine did not start"
        yield EngineClient(transport), supervisor
    finally:
        supervisor.stop()
        transport.close()
    assert not os.path.exists(f"/dev/shm/{transport.name}"), "segment not unlinked"


def wait_steps(client: EngineClient, n: int = 1, timeout: float = 10.0) -> None:
    """Block until the engine completed ``n`` more steps (its control block is then fresh)."""
    target = client.step() + n
    end = time.monotonic() + timeout
    while client.step() < target:
        assert time.monotonic() < end, "engine made no progress"
        time.sleep(0.005)


def assert_idle_and_clean(client: EngineClient) -> None:
    """No mailbox leased, no slot held, no KV cell left in any slot."""
    wait_steps(client, 2)
    assert client.mailboxes_in_use() == 0
    assert client.slot_mailboxes() == [-1] * client.max_slots
    assert client.kv_pos_max() == [-1] * client.max_slots
