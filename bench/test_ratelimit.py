"""Rate-limit admission latency: one ``RateLimiter.admit`` (requests and tokens buckets) against a
real ``redis-server`` on loopback, and against this node's shared-memory buckets (the fallback).

Run with ``make bench`` (pytest-benchmark); p50/p99 go to ``extra_info``.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from server.tenancy.ratelimit import RateLimiter
from server.tenancy.tenants import Rate, Tenant
from shm import Layout, Transport
from tests.support.servers import needs_redis, redis_server

ROUNDS = 5000
TENANT = Tenant("bench", 42, requests_per_second=Rate(1e9, 1e9), tokens_per_second=Rate(1e12, 1e12))


def measure(benchmark, limiter: RateLimiter, label: str) -> None:
    latencies = []

    def admit():
        t0 = time.perf_counter()
        limiter.admit(TENANT, 32)
        latencies.append(time.perf_counter() - t0)

    for _ in range(100):  # warm-up: connection, script cached by Redis
        admit()
    latencies.clear()
    benchmark.pedantic(admit, rounds=ROUNDS, iterations=1)
    us = np.array(latencies) * 1e6
    benchmark.extra_info.update({"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99))})
    print(f"\nrate-limit check, {label}: p50 {np.percentile(us, 50):.1f} us, p99 {np.percentile(us, 99):.1f} us")


@pytest.fixture
def shared_buckets():
    t = Transport.create(Layout(1, 1, 8, 4))
    yield t.buckets
    t.close()


def test_local_fallback_latency(benchmark, shared_buckets):
    limiter = RateLimiter(shared_buckets)
    measure(benchmark, limiter, "node's shared buckets")
    decision = limiter.admit(TENANT, 32)  # the path measured: the node's buckets, both limits reported
    assert not limiter.using_redis and decision.allowed and decision.retry_after_s == 0.0
    assert {kind: bucket[0] for kind, bucket in decision.buckets.items()} == {"requests": 1e9, "tokens": 1e12}


@needs_redis
def test_redis_latency(benchmark, shared_buckets):
    with redis_server() as (url, _):
        limiter = RateLimiter(shared_buckets, url)
        measure(benchmark, limiter, "Redis on loopback")
        assert limiter.using_redis
