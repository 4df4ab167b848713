"""Token delivery: time from the engine publishing a token to its reader waking.

Run with ``make bench`` (pytest-benchmark). A separate "engine" process, on each request,
stamps ``time.perf_counter()`` (CLOCK_MONOTONIC, the same clock in every process), writes a
token and the counter into mailbox 0 and rings its FIFO, exactly as ``EngineCore`` publishes.
The benchmark process waits on that FIFO the way ``engine.client.Stream`` does; the one-way
latency of every round is kept and its percentiles go to ``extra_info``.
"""
from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

from shm import Layout, Transport
from shm.wakeup import Doorbells


def fake_engine(name: str) -> None:
    t = Transport.attach(name)
    box = t.mailboxes[0]
    k = 0
    while True:
        t.bells.wait(Doorbells.ENGINE, timeout=None)
        t.bells.drain(Doorbells.ENGINE)
        if int(box["cancel"]):
            break
        t.tokens[0, k % t.layout.max_seq_len] = k
        box["t_first_token"] = time.perf_counter()
        box["n_tokens"] = k + 1
        t.bells.ring(0)
        k += 1
    t.close()


@pytest.fixture
def pair():
    t = Transport.create(Layout(1, 1, 64))
    proc = mp.get_context("spawn").Process(target=fake_engine, args=(t.name,))
    proc.start()
    yield t
    t.mailboxes["cancel"][0] = 1
    t.bells.ring(Doorbells.ENGINE)
    proc.join(10)
    t.close()


def test_token_delivery_latency(benchmark, pair):
    t = pair
    box = t.mailboxes[0]
    latencies = []

    def one_token():
        seen = int(box["n_tokens"])
        t.bells.ring(Doorbells.ENGINE)
        while True:
            t.bells.wait(0, timeout=5.0)
            woke = time.perf_counter()
            t.bells.drain(0)
            if int(box["n_tokens"]) > seen:
                latencies.append(woke - float(box["t_first_token"]))
                return

    one_token()  # warm-up: the engine process has opened its FIFOs
    latencies.clear()
    benchmark.pedantic(one_token, rounds=3000, iterations=1)
    ms = np.array(latencies) * 1000
    benchmark.extra_info.update({"p50_ms": float(np.percentile(ms, 50)),
                                 "p99_ms": float(np.percentile(ms, 99)),
                                 "max_ms": float(ms.max()), "samples": len(ms)})
    print(f"\ntoken delivery one-way: p50 {benchmark.extra_info['p50_ms']:.3f} ms, "
          f"p99 {benchmark.extra_info['p99_ms']:.3f} ms over {len(ms)} tokens")
    assert len(ms) >= 1
