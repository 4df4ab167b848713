"""The Responses store (``server/responses/store.py``): its bounds under 10,000 stored responses
(entries, bytes, idle time, least recently used first, per tenant), in SQLite and in a real
Redis; and two real replicas sharing one Redis: a response stored through one is read and
continued through the other, and while Redis is down answers still come, say they were not
stored, and a continuation is a clear 424. And the refusals of a Responses body made before the
store is asked (``server/responses/request.py``), without a server (the parser's own tests:
``tests/server/test_responses_request.py``)."""
from __future__ import annotations

import multiprocessing
import os
import sqlite3
import time

import pytest
import redis

from server.responses.store import (LocalStore, RedisStore, ResponseNotFound, StoreLimits, StoreUnavailable,
                                    create_database)
from tests.support.http import error, request
from tests.support.responses import KEY, create
from tests.support.servers import free_port, needs_redis, redis_server, running_server

LIMITS = StoreLimits(max_entries=500, max_bytes=400_000, ttl_s=3600)  # the entry bound bites first
#: the entry bound (500 of ~700 bytes) or the byte bound (300,000: ~430 entries) bites first
BOUNDS = [pytest.param(LIMITS, id="entries"), pytest.param(StoreLimits(500, 300_000, 3600), id="bytes")]


def doc(i: int, size: int = 600) -> dict:
    return {"response": {"id": f"resp_{i}"}, "input_items": [], "conversation": [{"role": "user",
                                                                                  "content": "x" * size}]}


def fill_and_check(store, n: int = 10_000) -> None:
    """``n`` responses of about 700 bytes for tenant a, one for tenant b; every so often
    response 0 is read, so it is never the least recently used."""
    limits = store.limits
    store.put("b", "resp_b", doc(-1))
    store.put("a", "resp_0", doc(0))
    for i in range(1, n):
        store.put("a", f"resp_{i}", doc(i, 600 + i % 7 * 10))
        if i % 100 == 0:
            store.get("a", "resp_0")
    entries, size = store.usage("a")
    assert entries <= limits.max_entries and size <= limits.max_bytes
    assert entries == limits.max_entries or size > limits.max_bytes - 800  # full, not emptied
    store.get("a", "resp_0")  # recently used: kept
    store.get("a", f"resp_{n - 1}")  # the newest: kept
    with pytest.raises(ResponseNotFound):
        store.get("a", f"resp_{n - entries - 10}")  # least recently used: gone
    assert store.get("b", "resp_b") == doc(-1)  # another tenant's entries are its own
    with pytest.raises(ResponseNotFound):
        store.get("b", "resp_0")


@pytest.mark.parametrize("limits", BOUNDS)
def test_local_store_bounds_under_10000_responses(tmp_path, limits):
    path = str(tmp_path / "responses.db")
    create_database(path)
    store = LocalStore(path, limits)
    started = time.perf_counter()
    fill_and_check(store)
    print(f"\nSQLite: 10,000 puts in {time.perf_counter() - started:.1f} s; tenant a holds {store.usage('a')} "
          f"(entries, bytes); file {os.path.getsize(path) + os.path.getsize(path + '-wal')} bytes with its WAL")
    # another process's view of the same file (another worker of the node)
    assert LocalStore(path, limits).get("a", "resp_0") == doc(0)


def _boot_and_write(path: str, barrier, worker: int) -> None:
    barrier.wait()  # every "worker" opens the file at once, as gunicorn's do after the fork
    store = LocalStore(path, LIMITS)
    for i in range(20):
        store.put("a", f"resp_{worker}_{i}", doc(i, 100))
        assert store.get("a", f"resp_{worker}_{i}") == doc(i, 100)


def test_workers_booting_together_all_open_the_masters_file(tmp_path):
    """CI once saw a worker fail to boot with "database is locked": each worker switched the
    new file to WAL, which needs the file to itself. The master makes the file, WAL included;
    eight workers that open and write it at once all succeed, and the file stays WAL."""
    path = str(tmp_path / "responses.db")
    create_database(path)
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(8)
    workers = [context.Process(target=_boot_and_write, args=(path, barrier, w)) for w in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert [w.exitcode for w in workers] == [0] * 8
    assert LocalStore(path, LIMITS).usage("a")[0] == 160
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_a_missing_store_file_is_an_error_not_a_new_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="create_database"):
        LocalStore(str(tmp_path / "none.db"), LIMITS)
    assert not os.path.exists(tmp_path / "none.db")


def test_local_store_forgets_what_was_not_used_for_ttl():
    clock = [1000.0]
    store = LocalStore(":memory:", StoreLimits(10, 10_000, ttl_s=60), clock=lambda: clock[0])
    store.put("a", "old", doc(1, 10))
    store.put("a", "used", doc(2, 10))
    clock[0] += 50
    store.get("a", "used")  # a read renews it
    clock[0] += 20
    with pytest.raises(ResponseNotFound):
        store.get("a", "old")
    assert store.get("a", "used") == doc(2, 10)
    store.put("a", "new", doc(3, 10))  # a write evicts the expired
    assert store.usage("a")[0] == 2
    store.delete("a", "used")
    with pytest.raises(ResponseNotFound):
        store.delete("a", "used")


@needs_redis
def test_redis_store_bounds_under_10000_responses_in_the_tenants_hash_tag():
    limits = BOUNDS[1].values[0]  # both bounds are one loop of the script: the byte bound bites first
    with redis_server() as (url, _):
        r = redis.Redis.from_url(url)
        before = r.info("memory")["used_memory"]
        store = RedisStore(url, limits)
        started = time.perf_counter()
        fill_and_check(store)
        print(f"\nRedis: 10,000 puts in {time.perf_counter() - started:.1f} s; tenant a holds {store.usage('a')} "
              f"(entries, bytes); used_memory grew by {r.info('memory')['used_memory'] - before} bytes")
        keys = {k.decode() for k in r.scan_iter("responses:*")}
        assert all(k.startswith(("responses:{a}:", "responses:{b}:")) for k in keys)
        assert len([k for k in keys if k.startswith("responses:{a}:r:")]) == store.usage("a")[0]
        assert all(0 < r.pttl(k) <= 3600_000 for k in keys)  # everything expires
        store.delete("a", "resp_0")
        with pytest.raises(ResponseNotFound):
            store.get("a", "resp_0")
        # deleting what a tenant with nothing stored never had made a key with no expiry
        with pytest.raises(ResponseNotFound):
            store.delete("c", "resp_missing")
        assert all(0 < r.pttl(k) <= 3600_000 for k in r.scan_iter("responses:*"))


@needs_redis
def test_redis_store_down_is_unavailable_at_once():
    store = RedisStore(f"redis://127.0.0.1:{free_port()}/0", LIMITS)
    started = time.perf_counter()
    for op in (lambda: store.put("a", "x", doc(1)), lambda: store.get("a", "x"), lambda: store.delete("a", "x")):
        with pytest.raises(StoreUnavailable):
            op()
    assert not store.available and time.perf_counter() - started < 1.0  # a safety net, not a benchmark


@needs_redis
def test_two_replicas_share_the_store_and_redis_down_is_never_a_5xx(tmp_path):
    from tests.support.tenants import write_tenants
    path = write_tenants(tmp_path / "t.json", [{"id": "a", "api_keys": ["key-a"]}, {"id": "b", "api_keys": ["key-b"]}])
    flags = ["--tenants", path, "--max-slots", "2", "--max-seq-len", "512", "--workers", "1", "--threads", "8",
             "--engine-threads", "1"]
    port = free_port()
    with redis_server(port) as (url, proc), running_server(*flags, "--redis-url", url) as s1, \
            running_server(*flags, "--redis-url", url) as s2:
        first = create(s1, {"input": "Hello", "max_output_tokens": 4, "temperature": 0})
        assert request(s2, "GET", f"/v1/responses/{first['id']}", key=KEY)[0] == 200
        second = create(s2, {"input": "Again", "previous_response_id": first["id"], "max_output_tokens": 4})
        assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
        error(request(s2, "GET", f"/v1/responses/{first['id']}", key="key-b"), 404, "response_id")
        proc.kill()
        proc.wait()
        status, headers, _ = request(s1, "POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 2}, key=KEY)
        assert status == 200 and headers["x-response-stored"] == "false"
        err = error(request(s1, "POST", "/v1/responses", {"input": "Hi", "previous_response_id": first["id"]}, key=KEY),
                    424, "previous_response_id")
        assert "unavailable" in err["message"]
        error(request(s2, "GET", f"/v1/responses/{first['id']}", key=KEY), 424, None)
        with redis_server(port):  # back: the breaker's probe closes it within PROBE_S
            end = time.monotonic() + 10
            while request(s1, "POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 1}, key=KEY)[1][
                    "x-response-stored"] != "true":
                assert time.monotonic() < end
                time.sleep(0.2)


# -- refused before the store is asked (no server) -----------------------------------------------------
@pytest.mark.parametrize("body,param", [
    # input_items pages by item id, so a repeated id made the SDK's
    # pager loop forever (every page "after" the first of them); OpenAI refuses a duplicate too.
    ({"input": [{"id": "dup", "type": "message", "role": "user", "content": "a"},
                {"type": "message", "role": "user", "content": "b"},
                {"id": "dup", "type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}, "input[2].id"),
    # stream_options without a stream, refused as chat's and legacy's routes refuse it
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"input": "x", "tool_choice": {"type": "function"}}, "tool_choice"),  # its message quoted chat's shape
])
def test_a_responses_body_refused_before_the_store_is_asked(body, param):
    from engine.errors import InvalidRequest
    from server.responses.request import parse

    with pytest.raises(InvalidRequest) as e:
        parse(body, lambda rid: pytest.fail("the store was asked"), 64)
    assert e.value.param == param and '"function": {' not in e.value.message, e.value
