"""The control plane's store (``server/control/store.py``), both backends against the same rules:
a reservation is all-or-nothing against the limits, concurrent reservations never pass a limit
together, settling gives the reservation back and adds what was used, an expired reservation is
given back, and usage adds up in every bucket width. Redis: a real redis-server."""
from __future__ import annotations

import concurrent.futures
import time

import pytest

from server.control import store as store_module
from server.control.store import RedisControl, Settlement, SqliteControl, UsageRecord
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
    for i, r in enumerate(records):
        store.finish(Settlement("p", "2026-12", f"u{i}", 0, 0), r)
        store.finish(Settlement("p", "2026-12", f"u{i}", 0, 0), r)  # a retry counts nothing
    minute = store_module.bucket_start(t, "1m")
    assert store.usage("1m", [minute])[minute] == {("p", "k1", "m"): [11, 6, 2, 2]}
    day = store_module.bucket_start(t, "1d")
    assert store.usage("1d", [day])[day] == {("p", "k1", "m"): [11, 6, 2, 2], ("p", "k2", "m"): [7, 0, 7, 1]}
    # an embedding model's requests count under the embeddings API, apart from the completions'
    store.finish(Settlement("p", "2026-12", "e0", 0, 0), UsageRecord("p", "k1", "e", t, 40, 0, 0, api="embeddings"))
    assert store.usage("1d", [day], "embeddings")[day] == {("p", "k1", "e"): [40, 0, 0, 1]}
    assert ("p", "k1", "e") not in store.usage("1d", [day])[day]


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


def test_write_behind_keeps_what_redis_misses_and_writes_it_when_back():
    """Redis hung: a request's spend and usage wait in memory (no call waits on the outage), and
    are written by the control plane's poll once Redis answers again, with no further request;
    the one whose call timed out after Redis took it (it runs when Redis wakes) is not counted
    twice."""
    import subprocess

    from server.control.state import ControlPlane
    from server.tenancy.tenants import Tenants

    with redis_server() as (url, proc):
        store = RedisControl(url)
        control = ControlPlane(store, Tenants.load(None), "m").start()
        writes = control.writes
        month = time.strftime("%Y-%m", time.gmtime())
        record = UsageRecord("p", "k", "m", time.time(), 10, 5, 0)
        writes.add(Settlement("p", month, "r0", 100, 15), record)
        proc.send_signal(subprocess.signal.SIGSTOP)  # Redis hangs: a call would time out
        try:
            start = time.monotonic()
            for i in range(1, 51):
                writes.add(Settlement("p", month, f"r{i}", 100, 15), record)
            assert time.monotonic() - start < 1.0 and store.breaker.open  # one timeout, then none
            assert len(writes.pending) == 50  # the first was sent before the outage was known: it may be applied
        finally:
            proc.send_signal(subprocess.signal.SIGCONT)
        deadline = time.monotonic() + 5
        while writes.pending:  # the poll writes them (every POLL_S, once the breaker lets it try)
            assert time.monotonic() < deadline, len(writes.pending)
            time.sleep(0.05)
        writes.add(Settlement("p", month, "r51", 100, 15), record)
        assert writes.pending == []
        assert store.spend("p", month).spent == 52 * 100
        minute = store_module.bucket_start(record.at, "1m")
        assert store.usage("1m", [minute])[minute][("p", "k", "m")] == [520, 260, 0, 52]


def test_model_permissions_stored_and_in_force(store, tmp_path):
    """The Admin API's model permissions (OpenAI's shapes) on either backend: stored with the
    project, in force on its tenant (``Tenant.may_use``) and its keys at once, refused with a
    400 naming the field for an id not served, read-only (409) for a tenant-file project, whose
    ``models`` they show; gone with the project."""
    from engine.errors import InvalidRequest
    from server.api.errors import Conflict
    from server.control.accounting import Price
    from server.control.admin import Admin
    from server.control.state import ControlPlane
    from server.tenancy.tenants import Tenants
    from tests.support.tenants import write_tenants

    file = Tenants.load(write_tenants(tmp_path / "t.json", [{"id": "filed", "api_keys": ["file-key-0"],
                                                             "models": ["embed"]}]))
    names = ("SmolLM2-135M-Instruct", "local-model", "Gemma-3-270m", "embed")
    model_a, model_b = names[:2], names[2:3]
    admin = Admin(ControlPlane(store, file, "SmolLM2-135M-Instruct"), Price(), names)
    project = admin.create_project({"name": "p"})[0]["id"]
    value = admin.create_account(project, {"name": "bot"})[0]["api_key"]["value"]
    every = {"object": "project.model_permissions", "mode": "deny_list", "model_ids": []}
    assert admin.get_model_permissions(project) == every  # none set: every model

    out, audit = admin.update_model_permissions(project, {"mode": "allow_list",
                                                          "model_ids": ["local-model", "local-model"]})
    assert out == {"object": "project.model_permissions", "mode": "allow_list", "model_ids": ["local-model"]}
    assert audit == ("model_permissions.update", project)
    tenant = admin.state.authenticate(value)  # what a request with the project's key runs as
    assert tenant.may_use(model_a) and not tenant.may_use(model_b)
    assert admin.state.tenants[project].may_use(model_a)
    admin.update_model_permissions(project, {"mode": "deny_list", "model_ids": ["SmolLM2-135M-Instruct"]})
    tenant = admin.state.authenticate(value)
    assert not tenant.may_use(model_a) and tenant.may_use(model_b)  # denied under either of its names
    assert store.documents()[1][f"model_permissions/{project}"]["model_ids"] == ["SmolLM2-135M-Instruct"]

    for body, param in (({"mode": "allow_list", "model_ids": ["local-model", "gpt-4o"]}, "model_ids[1]"),
                        ({"mode": "allow_list", "model_ids": [7]}, "model_ids[0]"),
                        ({"mode": "allow_list", "model_ids": []}, "model_ids"),
                        ({"mode": "deny_list"}, "model_ids"), ({"mode": "allow", "model_ids": []}, "mode"),
                        ({"mode": "deny_list", "model_ids": [], "extra": 1}, "extra")):
        with pytest.raises(InvalidRequest) as e:
            admin.update_model_permissions(project, body)
        assert e.value.param == param, (body, e.value)
    assert admin.get_model_permissions(project)["model_ids"] == ["SmolLM2-135M-Instruct"]  # unchanged

    assert admin.delete_model_permissions(project) == (
        {"object": "project.model_permissions.deleted", "deleted": True}, ("model_permissions.delete", project))
    assert admin.get_model_permissions(project) == every and admin.state.authenticate(value).may_use(model_a)
    assert admin.delete_model_permissions(project)[0]["deleted"]  # a reset, again

    # a tenant-file project: the file's models, read-only here
    assert admin.get_model_permissions("filed") == {"object": "project.model_permissions", "mode": "allow_list",
                                                    "model_ids": ["embed"]}
    for change in (lambda: admin.update_model_permissions("filed", {"mode": "deny_list", "model_ids": []}),
                   lambda: admin.delete_model_permissions("filed")):
        with pytest.raises(Conflict):
            change()
    # gone with its project
    admin.update_model_permissions(project, {"mode": "allow_list", "model_ids": ["embed"]})
    admin.archive_project(project)
    admin.delete_project(project)
    assert not [n for n in store.documents()[1] if n.startswith("model_permissions/")]


def test_rate_limits_are_per_model(store):
    """A project has one rate limit per model (``rl-<id>``, also named by any alias): each in
    force for requests to that model only (``Tenant.for_model``), in buckets of its own, so a
    project at its limit on one model still reaches another."""
    from engine.errors import RateLimited
    from server.control.accounting import Price
    from server.control.admin import Admin
    from server.control.state import ControlPlane
    from server.tenancy.ratelimit import RateLimiter
    from server.tenancy.tenants import Tenants
    from shm import Transport
    from shm.layout import Layout

    names = ("chat", "local-model", "embed")
    admin = Admin(ControlPlane(store, Tenants([]), "chat"), Price(), names,
                  {"chat": "chat", "local-model": "chat", "embed": "embed"})
    project = admin.create_project({"name": "p"})[0]["id"]
    value = admin.create_account(project, {"name": "bot"})[0]["api_key"]["value"]
    listed = admin.list_rate_limits(project, None, 20)["data"]
    assert [(r["id"], r["model"], r["max_requests_per_1_minute"]) for r in listed] == [("rl-chat", "chat", 0),
                                                                                      ("rl-embed", "embed", 0)]
    out, _ = admin.update_rate_limit(project, "rl-local-model", {"max_requests_per_1_minute": 2})  # an alias
    assert out["id"] == "rl-chat" and out["max_requests_per_1_minute"] == 2
    tenant = admin.state.authenticate(value)
    chat, embed = tenant.for_model("chat"), tenant.for_model("embed")
    assert chat.requests_per_second.burst == 2 and embed.requests_per_second is None and chat.scope == "chat"
    admin.update_rate_limit(project, "rl-embed", {"max_requests_per_1_minute": 1})
    chat, embed = (admin.state.authenticate(value).for_model(m) for m in ("chat", "embed"))
    transport = Transport.create(Layout(1, 1, 8, 4))
    try:
        limiter = RateLimiter(transport.buckets)
        limiter.admit(embed, 1)
        with pytest.raises(RateLimited):
            limiter.admit(embed, 1)  # embed's one request a minute is spent
        limiter.admit(chat, 1)
        limiter.admit(chat, 1)  # chat's own buckets: two more
        with pytest.raises(RateLimited):
            limiter.admit(chat, 1)
    finally:
        transport.close()


def test_permissions_and_limits_of_models_no_longer_served_are_named_at_start(store):
    """A model renamed (or dropped) since a project's model permissions or rate limit named it:
    the start-up log says so, one line each, since a deny list or a limit of that name now
    holds nothing back."""
    from server.control.accounting import Price
    from server.control.admin import Admin
    from server.control.state import ControlPlane
    from server.tenancy.tenants import Tenants

    control = ControlPlane(store, Tenants([]), "gemma")
    admin = Admin(control, Price(), ("gemma",))
    project = admin.create_project({"name": "p"})[0]["id"]
    admin.update_model_permissions(project, {"mode": "deny_list", "model_ids": ["gemma"]})
    admin.update_rate_limit(project, "rl-gemma", {"max_requests_per_1_minute": 1})
    assert control.unserved_models(("gemma",)) == []
    lines = ControlPlane(store, Tenants([]), "gemma3").unserved_models(("gemma3",))
    assert lines == [f"project {project}: its model permissions (deny_list) name gemma, which no model is served as now",
                     f"project {project}: its rate limit rl-gemma is of a model not served now, and holds nothing back"]
