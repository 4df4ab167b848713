"""Token delivery: time from the engine publishing a token to its reader waking.

Run with ``make bench`` (pytest-benchmark). A separate "engine" process, on each wake-up,
publishes one token into mailbox 0 with the real verb (``Mailboxes.publish``: data, counter,
wake-up); the token id is the publishing time, ``time.perf_counter()`` (CLOCK_MONOTONIC, the
same clock in every process) in microseconds since the benchmark started. The benchmark process
waits with the real reader verbs (``Mailboxes.wait`` and ``read_new``), as
``engine.stream.follow`` does; the one-way latency of every round is kept and its percentiles
go to ``extra_info``.
"""
from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

from shm import Finish, Layout, Published, Transport
from shm.wakeup import Wakeups


ROUNDS = 3000


def fake_engine(name: str, base: float) -> None:
    """Publish one token per wake-up until the reader cancels."""
    t = Transport.attach(name)
    boxes = t.mailboxes
    t.wakeups.wait([Wakeups.ENGINE], None)
    (rec,) = t.ring.pop_all()  # the one submitted request; each later wake-up asks for a token
    k = 0
    while True:
        t.wakeups.drain(Wakeups.ENGINE)
        if boxes.cancelled(rec.mailbox, rec.lease):
            break
        stamp = time.perf_counter()
        boxes.publish([Published(rec.mailbox, k, int((stamp - base) * 1e6), None)], stamp)
        k += 1
        t.wakeups.wait([Wakeups.ENGINE], None)
    boxes.finish(rec.mailbox, rec.lease, Finish.CANCELLED)
    t.close()


@pytest.fixture
def pair():
    t = Transport.create(Layout(1, 1, ROUNDS + 8, 4))
    base = time.perf_counter()
    proc = mp.get_context("spawn").Process(target=fake_engine, args=(t.name, base))
    proc.start()
    lease = t.mailboxes.lease()
    t.mailboxes.submit(lease, 1, lambda payload: None)  # wakes the engine: the first token
    yield t, lease, base
    t.mailboxes.cancel(lease)
    proc.join(10)
    t.mailboxes.release(lease)
    t.close()


def test_token_delivery_latency(benchmark, pair):
    t, lease, base = pair
    boxes = t.mailboxes
    latencies = []

    def one_token(seen: int | None = None):
        if seen is None:
            seen = boxes.read_new(lease)[0]
            t.wakeups.wake(Wakeups.ENGINE)
        while True:
            boxes.wait([lease], 5.0)
            woke = time.perf_counter()
            n, _ = boxes.read_new(lease)
            if n > seen:
                latencies.append(woke - (base + boxes.token(lease, n - 1, None)[0] / 1e6))
                return

    one_token(seen=0)  # the submitted request's token: the engine process has opened its FIFOs
    latencies.clear()
    benchmark.pedantic(one_token, rounds=ROUNDS, iterations=1)
    ms = np.array(latencies) * 1000
    benchmark.extra_info.update({"p50_ms": float(np.percentile(ms, 50)),
                                 "p99_ms": float(np.percentile(ms, 99)),
                                 "max_ms": float(ms.max()), "samples": len(ms)})
    print(f"\ntoken delivery one-way: p50 {benchmark.extra_info['p50_ms']:.3f} ms, "
          f"p99 {benchmark.extra_info['p99_ms']:.3f} ms over {len(ms)} tokens")
    # Each wake-up delivered exactly the one token published for it (none lost, none twice),
    # read after it was stamped.
    assert len(ms) >= 1 and boxes.read_new(lease)[0] == 1 + len(ms)
    assert (ms >= 0).all(), ms.min()
