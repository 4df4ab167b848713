"""CPU time to refuse the worst request bodies (about 1 MB each) a client can construct.

Run with ``make bench`` (pytest-benchmark). The app from ``create_app`` runs in this process
over a real transport with no engine behind it (a refusal never reaches one), driven by
``falcon.testing``; each body is refused with a 400, and the CPU time of the refusal
(``time.process_time``) goes to ``extra_info``. Target: at most 0.3 s for any of them.
"""
from __future__ import annotations

import gc
import json
import time

import falcon.testing
import pytest

from engine.client import EngineClient
from engine.config import EngineConfig
from server.config import ServerConfig
from server.generation.pipeline import Generator
from server.http.app import create_app
from shm import Transport

MB = 1 << 20
BODIES = {
    "31,000 one-character messages": {"messages": [{"role": "user", "content": "x"}] * 31_000},
    "512 messages of 2 KB": {"messages": [{"role": "user", "content": "word " * 400}] * 512},
    "one 1 MB message": {"messages": [{"role": "user", "content": "x" * (MB - 100)}]},
    "1 MB completion prompt": {"prompt": "x " * (MB // 2 - 50)},
    "100,000 one-word prompts": {"prompt": ["hi"] * 100_000},
    "300,000 token ids": {"prompt": [1] * 300_000},
    "200,000 one-token prompts": {"prompt": [[1]] * 200_000},
    # Written out: Python's json module cannot nest this deep; ujson, which the server uses, can.
    "metadata nested 1,000 deep, 480 times": ('{"messages": [{"role": "user", "content": "Hi"}], "metadata": {"k": ['
                                              + ",".join(["[" * 1000 + "]" * 1000] * 480) + "]}}").encode(),
    # Just under the character bound (2048 tokens x 81 bytes): tokenized in full, then refused.
    "160 KB message, tokenized": {"messages": [{"role": "user", "content": "ab " * 54_000}]},
    "40,000 text parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": "x "}] * 40_000}]},
}


@pytest.fixture(scope="module")
def client(model_path, tokenizer, chat):
    config = ServerConfig(model_path=model_path, max_body_bytes=2 * MB)
    transport = Transport.create(EngineConfig(model_path=model_path).layout())
    app = create_app(config, Generator(EngineClient(transport), tokenizer, chat))
    gc.freeze()  # as a gunicorn worker does once its app is loaded (server/gunicorn_conf.py)
    yield falcon.testing.TestClient(app)
    gc.unfreeze()
    transport.close()


@pytest.mark.parametrize("name", list(BODIES))
def test_refusal_cpu_time(benchmark, client, name):
    body = BODIES[name] if isinstance(BODIES[name], bytes) else json.dumps(BODIES[name]).encode()
    path = "/v1/completions" if b'"prompt"' in body[:20] else "/v1/chat/completions"
    seconds, reasons = [], []

    def refuse():
        t0 = time.process_time()
        r = client.simulate_post(path, body=body, headers={"Content-Type": "application/json"})
        seconds.append(time.process_time() - t0)
        assert r.status_code == 400, r.text[:200]
        reasons.append(r.json["error"]["message"][:70])

    benchmark.pedantic(refuse, rounds=5, iterations=1)
    benchmark.extra_info.update({"body_bytes": len(body), "cpu_s_max": max(seconds)})
    print(f"\n{name} ({len(body) / MB:.2f} MB): refused in {max(seconds) * 1000:.0f} ms of CPU ({reasons[-1]})")
