"""The control plane's store (``server/control/store.py``), both backends against the same rules:
a reservation is all-or-nothing against the limits, concurrent reservations never pass a limit
together, settling gives the reservation back and adds what was used, an expired reservation is
given back, and usage adds up in every bucket width. Redis: a real redis-server."""
from __future__ import annotations

import concurrent.futures
import time

import pytest

from server.control import store as store_module
from server.control.store import RedisControl, SqliteControl, UsageRecord
from tests.support.servers import redis_server, redis_server_executable


@pytest.fixture(params=["sqlite", "redis"])
def store(request, tmp_path):
    if request.param == "sqlite":
        yield SqliteControl(str(tmp_path / "control.db"))
        return
    if redis_server_executable() is None:
        pytest.skip("no redis-server")
    with redis_server() as (url, _):
        yield RedisControl(url)


def test_documents_and_version(store):
    assert store.documents() == (0, {})
    store.write({"project/p1": {"id": "p1"}})
    store.write({"project/p2": {"id": "p2"}}, ("project/p1",))
    assert store.documents() == (2, {"project/p2": {"id": "p2"}}) and store.version() == 2


def test_concurrent_reservations_never_pass_the_limit(store):
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: store.reserve("p", "2026-12", f"r{i}", 100, 10, 1000, None)[0], range(32)))
    assert sum(results) == 10
    assert store.spend("p", "2026-12").reserved == 1000
    for i in range(32):
        store.settle("p", "2026-12", f"r{i}", 30 if results[i] else 0, 3 if results[i] else 0)
    spend = store.spend("p", "2026-12")
    assert (spend.spent, spend.reserved, spend.tokens, spend.tokens_reserved) == (300, 0, 30, 0)
    # the token quota too; no limit at all
    assert store.reserve("p", "2026-12", "t1", 0, 71, None, 100)[0] is False
    assert store.reserve("p", "2026-12", "t2", 0, 70, None, 100)[0] is True
    assert store.reserve("q", "2026-12", "u", 10 ** 12, 10 ** 9, None, None)[0] is True


def test_expired_reservation_is_given_back(store, monkeypatch):
    monkeypatch.setattr(store_module, "RESERVATION_TTL_S", 0)
    assert store.reserve("p", "2026-12", "dead", 600, 0, 1000, None)[0]  # its process died
    ok, spend = store.reserve("p", "2026-12", "next", 600, 0, 1000, None)
    assert ok and spend.reserved == 600


def test_usage_buckets(store):
    t = store_module.bucket_start(time.time(), "1h") + 60  # a minute into this hour: kept by every width
    records = [UsageRecord("p", "k1", "m", t, 10, 5, 2), UsageRecord("p", "k1", "m", t + 30, 1, 1, 0),
               UsageRecord("p", "k2", "m", t + 120, 7, 0, 7)]
    for r in records:
        store.add_usage([r])
    minute = store_module.bucket_start(t, "1m")
    assert store.usage("1m", [minute])[minute] == {("p", "k1", "m"): [11, 6, 2, 2]}
    day = store_module.bucket_start(t, "1d")
    assert store.usage("1d", [day])[day] == {("p", "k1", "m"): [11, 6, 2, 2], ("p", "k2", "m"): [7, 0, 7, 1]}


def test_prices_by_any_served_name(tmp_path):
    """A price is found under any name the model is served under; a name not served stops start-up."""
    from engine.config import ConfigError
    from server.control.accounting import Price, Prices

    path = tmp_path / "prices.json"
    path.write_text('{"local-model": {"input": 0.15, "output": 0.6}}')
    prices = Prices.load(str(path))
    assert prices.of(("SmolLM2", "local-model")) == Price(150.0, 150.0, 600.0)
    assert prices.of(("other",)) == Price()
    prices.check(("SmolLM2", "local-model"), str(path))
    with pytest.raises(ConfigError, match="'local-model' is not served here"):
        prices.check(("SmolLM2",), str(path))
