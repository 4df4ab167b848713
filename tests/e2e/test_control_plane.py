"""The control plane on two real replicas sharing a real Redis (``server/control/``): projects and
keys made through one replica serve on the other within 2 s, a revoked key is refused on both
within 2 s, a rotated key works through its grace period and not after; 32 concurrent requests
against a spend limit that allows 10 admit at most 10, the month's spend stays within the limit
and survives a restart of both replicas; the usage API sums, token for token, to the ``usage``
the clients were given over chat, completions, Responses, gRPC and streams, several keys and
both replicas; model permissions set, read and reset across the replicas; admin authentication
(no key 401, a tenant's key 403) and no key value in any log.
Skipped, saying why, without a redis-server."""
from __future__ import annotations

import concurrent.futures
import json
import subprocess
import time

import grpc
import pytest

from proto import inference_pb2 as pb
from proto import inference_pb2_grpc
from tests.support.http import CHAT, COMPLETIONS, MODEL, RESPONSES, get, post, request
from tests.support.servers import needs_redis, redis_server, running_server, started_together

pytestmark = needs_redis

ADMIN = "admin-test-key-0123456789abcdef"
ORG = "/v1/organization"
DOCS_ADMIN = "admin-key-0123456789abcdef"  # docs/tenants.md's session


def admin(server, method: str, path: str, body=None, key: str = ADMIN):
    reply = request(server, method, ORG + path, None if body is None else json.dumps(body).encode(),
                    {"Content-Type": "application/json"} if body is not None else {}, key=key)
    return reply.status, reply.json()


def until(check, timeout: float = 2.0) -> float:
    """Seconds until ``check()`` is true; fails after ``timeout``."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, f"not within {timeout} s"
        time.sleep(0.05)
    return time.monotonic() - start


def completion(server, key: str, max_tokens: int = 4):
    return post(server, COMPLETIONS, {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens,
                                      "temperature": 0}, key=key)


def served(server, key: str) -> bool:
    return completion(server, key, 1).status == 200


#: What every server here shares: one worker, the model's id, and contexts of 1,024 tokens, whose
#: KV cache llama.cpp clears in a fraction of the default's start-up time (nothing here is long).
SMALL = ("--workers", "1", "--model-id", MODEL, "--max-seq-len", "1024")


@pytest.fixture(scope="module")
def redis_url():
    with redis_server() as (url, _):
        yield url


@pytest.fixture(scope="module")
def prices(tmp_path_factory):
    path = tmp_path_factory.mktemp("prices") / "prices.json"
    # $4,000 a million tokens in and out (4,000,000 nano-dollars, 0.4 cents a token): a request
    # of 24 tokens costs about 10 cents, so a limit in cents allows a precise number of them
    path.write_text(json.dumps({MODEL: {"input": 4000, "output": 4000}}))
    return str(path)


@pytest.fixture(scope="module")
def replicas(redis_url, prices):
    env = {"ADMIN_KEYS": f"{ADMIN},{DOCS_ADMIN}"}
    flags = ("--redis-url", redis_url, "--prices", prices, *SMALL)
    with running_server(*flags, env=env, grpc=True) as a, running_server(*flags, env=env) as b:
        yield a, b


def make_key(server, name: str) -> tuple[str, str, str]:
    """A new project with one key: ``(project id, key id, key value)``."""
    status, project = admin(server, "POST", "/projects", {"name": name})
    assert status == 200, project
    status, account = admin(server, "POST", f"/projects/{project['id']}/service_accounts", {"name": name + "-bot"})
    assert status == 200, account
    return project["id"], account["api_key"]["id"], account["api_key"]["value"]


def test_admin_authentication(replicas):
    a, _ = replicas
    assert admin(a, "GET", "/projects", key=None)[0] == 401
    assert admin(a, "GET", "/projects", key="not-a-key-at-all-0000")[0] == 401
    _, _, value = make_key(a, "auth")
    status, body = admin(a, "GET", "/projects", key=value)
    assert status == 403 and body["error"]["code"] == "admin_key_required"
    assert completion(a, None).status == 401  # admin keys configured: every request needs a key
    assert completion(a, ADMIN).status == 401  # an admin key is not a tenant's key
    assert get(a, "/v1/organization/users", key=ADMIN).status == 404  # what a self-hosted server lacks


def test_keys_across_replicas(replicas):
    a, b = replicas
    project, key_id, value = make_key(a, "team-x")
    assert served(b, value) and served(a, value)  # at once: an unknown key makes B read the state again
    # listed without its value, ever again
    status, keys = admin(b, "GET", f"/projects/{project}/api_keys")
    assert status == 200 and [k["id"] for k in keys["data"]] == [key_id]
    assert value not in json.dumps(keys) and keys["data"][0]["redacted_value"].endswith(value[-4:])
    assert abs(keys["data"][0]["last_used_at"] - time.time()) < 60  # it just served
    # a key that expires: made through A with 2 s to live (its wait overlaps the rotation's below)
    account = admin(a, "GET", f"/projects/{project}/service_accounts")[1]["data"][0]["id"]
    status, short = admin(a, "POST", f"/projects/{project}/service_accounts/{account}/api_keys",
                          {"expires_in_seconds": 2})
    assert status == 200 and short["expires_at"] >= time.time() + 1 and served(b, short["value"])
    # rotation: the old value works through the grace period, then not
    status, new = admin(b, "POST", f"/projects/{project}/api_keys/{key_id}/rotate", {"grace_period_seconds": 3})
    assert status == 200, new
    rotated = time.monotonic()
    until(lambda: served(a, new["value"]))
    assert served(a, value) and served(b, value)
    until(lambda: not served(a, value) and not served(b, value), timeout=5)
    assert time.monotonic() - rotated >= 2.9
    assert not served(a, short["value"]) and not served(b, short["value"])  # expired
    # revocation, through B: refused on both within 2 s
    assert admin(b, "DELETE", f"/projects/{project}/api_keys/{new['id']}")[0] == 200
    until(lambda: not served(a, new["value"]) and not served(b, new["value"]))
    # the rotated key, expired, is dropped with the next key made: rotations leave nothing behind
    assert admin(a, "POST", f"/projects/{project}/service_accounts/{account}/api_keys", {})[0] == 200
    assert key_id not in [k["id"] for k in admin(a, "GET", f"/projects/{project}/api_keys")[1]["data"]]
    # an archived project's keys stop too
    _, _, other = make_key(a, "team-y")
    until(lambda: served(b, other))
    projects = admin(a, "GET", "/projects")[1]["data"]
    y = next(p["id"] for p in projects if p["name"] == "team-y")
    assert admin(a, "POST", f"/projects/{y}/archive")[1]["status"] == "archived"
    until(lambda: not served(b, other))


def test_rate_limit_changed_at_runtime(replicas):
    a, b = replicas
    project, _, value = make_key(a, "limited")
    status, limits = admin(a, "GET", f"/projects/{project}/rate_limits")
    (limit,) = limits["data"]
    assert status == 200 and limit["max_requests_per_1_minute"] == 0  # 0: no limit
    status, limit = admin(a, "POST", f"/projects/{project}/rate_limits/{limit['id']}", {"max_requests_per_1_minute": 2})
    assert status == 200 and limit["max_requests_per_1_minute"] == 2
    time.sleep(1.0)  # in force on B too
    statuses = [completion(s, value, 1).status for s in (a, b, a)]
    assert statuses == [200, 200, 429], statuses
    # a day's requests, and the monthly token quota (an operator who sets no prices)
    project, _, value = make_key(a, "daily")
    status, body = admin(a, "POST", f"/projects/{project}/rate_limits/rl-{MODEL}", {"max_requests_per_1_day": 1})
    assert status == 200 and body["max_requests_per_1_day"] == 1, body
    time.sleep(1.0)
    assert [completion(s, value, 1).status for s in (b, a)] == [200, 429]
    project, _, value = make_key(a, "quota")
    used = completion(a, value, 4).json()["usage"]
    assert admin(a, "POST", f"/projects/{project}", {"monthly_token_quota": used["total_tokens"] + 5})[0] == 200
    time.sleep(1.0)  # in force on B too (within its poll)
    reply = completion(b, value, 4)  # its worst case passes the 5 tokens left
    assert reply.status == 429 and reply.json()["error"]["code"] == "insufficient_quota"
    assert completion(b, value, 1).status == 200  # prompt + 1 fits


def test_spend_limit_holds_under_concurrency(replicas):
    a, b = replicas
    project, _, value = make_key(a, "spender")
    # worst case of one request: its prompt + max_tokens 20, at 4,000,000 nano-dollars a token
    prompt_tokens = completion(a, value, 1).json()["usage"]["prompt_tokens"]
    worst = (prompt_tokens + 20) * 4_000_000
    status, spend = admin(a, "GET", f"/projects/{project}/spend_limit")
    used = round(spend["spent_amount"] * 10_000_000)
    cents = (used + 10 * worst) // 10_000_000 + 1  # room for 10 worst cases (and less than 11)
    room = cents * 10_000_000 - used
    assert 10 * worst <= room < 11 * worst
    assert admin(a, "POST", f"/projects/{project}/spend_limit",
                 {"threshold_amount": cents, "currency": "USD", "interval": "month"})[0] == 200
    time.sleep(1.0)

    def one(i):
        server = (a, b)[i % 2]
        return post(server, COMPLETIONS, {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 20,
                                          "temperature": 0, "ignore_eos": True}, key=value)  # each uses its worst case
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        replies = list(pool.map(one, range(32)))
    admitted = [r for r in replies if r.status == 200]
    refused = [r for r in replies if r.status == 429]
    assert len(admitted) == 10 and len(refused) == 22, [r.status for r in replies]
    assert all(r.json()["error"]["code"] == "insufficient_quota" for r in refused)
    status, spend = admin(b, "GET", f"/projects/{project}/spend_limit")
    assert spend["spent_amount"] <= cents and spend["reserved_amount"] == 0, spend
    assert spend["enforcement"]["status"] == "enforcing"
    assert get(a, "/metrics").status == 401  # with admin keys, on the public port: they name the projects
    metrics = get(a, "/metrics", key=ADMIN).body.decode()
    assert f'inference_project_spend_limit_cents{{project="{project}"}} {float(cents)}' in metrics
    assert f'inference_project_spend_cents{{project="{project}"}} {spend["spent_amount"]}' in metrics
    # the next one: what is left is less than its worst case
    assert completion(a, value, 20).json()["error"]["type"] == "insufficient_quota"
    # a restart of both replicas loses no spend: test_restart_keeps_state_and_the_file_wins


def test_model_permissions(replicas):
    """OpenAI's model permissions: set through one replica, read through the other at once, an
    id not served a 400 naming it, reset by DELETE; each change an audit line."""
    a, b = replicas
    project, _, _ = make_key(a, "models")
    path = f"/projects/{project}/model_permissions"
    every = {"object": "project.model_permissions", "mode": "deny_list", "model_ids": []}
    assert admin(b, "GET", path) == (200, every)
    allowed = {"object": "project.model_permissions", "mode": "allow_list", "model_ids": [MODEL]}
    assert admin(a, "POST", path, {"mode": "allow_list", "model_ids": [MODEL]}) == (200, allowed)
    assert admin(b, "GET", path) == (200, allowed)
    status, body = admin(b, "POST", path, {"mode": "deny_list", "model_ids": [MODEL, "gpt-4o"]})
    assert status == 400 and body["error"]["param"] == "model_ids[1]", body
    assert admin(a, "GET", path) == (200, allowed)
    assert admin(b, "DELETE", path) == (200, {"object": "project.model_permissions.deleted", "deleted": True})
    assert admin(a, "GET", path) == (200, every)
    assert admin(a, "GET", "/projects/proj_none/model_permissions")[0] == 404
    log = open(a.log, encoding="utf-8").read() + open(b.log, encoding="utf-8").read()
    for action in ("model_permissions.update", "model_permissions.delete"):
        assert f'"action": "{action}", "target": "{project}"' in log


def _sum(page: dict) -> dict:
    totals = {}
    for bucket in page["data"]:
        for r in bucket["results"]:
            t = totals.setdefault((r["api_key_id"], r["model"]), [0, 0, 0, 0])
            for i, name in enumerate(("input_tokens", "output_tokens", "input_cached_tokens", "num_model_requests")):
                t[i] += r[name]
    return totals


def test_usage_adds_up(replicas):
    a, b = replicas
    started = int(time.time()) - 60
    _, key1, value1 = make_key(a, "usage-1")
    _, key2, value2 = make_key(a, "usage-2")
    time.sleep(1.5)  # in force everywhere (every process polls each 0.5 s); no probe, which would count
    expected = {key1: [0, 0, 0, 0], key2: [0, 0, 0, 0]}

    def add(key_id, usage: dict):
        cached = (usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
        for i, n in enumerate((usage.get("prompt_tokens", usage.get("input_tokens")),
                               usage.get("completion_tokens", usage.get("output_tokens")), cached, 1)):
            expected[key_id][i] += n

    for key_id, value in ((key1, value1), (key2, value2)):
        for server in (a, b):
            add(key_id, post(server, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                            "max_tokens": 5}, key=value).json()["usage"])
            add(key_id, completion(server, value, 6).json()["usage"])
            add(key_id, post(server, RESPONSES, {"model": MODEL, "input": "hello", "max_output_tokens": 4},
                             key=value).json()["usage"])
            events = post(server, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "tell"}],
                                         "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True}},
                          key=value).events()
            add(key_id, [e for e in events if isinstance(e, dict) and e.get("usage")][-1]["usage"])
        with grpc.insecure_channel(f"127.0.0.1:{a.grpc_port}") as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            chunks = list(stub.InferStream(pb.InferRequest(payload="grpc says", max_new_tokens=3),
                                           metadata=(("authorization", f"Bearer {value}"),)))
            usage = chunks[-1].usage
            add(key_id, {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                         "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}})
    query = f"/usage/completions?start_time={started}&bucket_width=1m&group_by=api_key_id&group_by=model&limit=1440"
    page = admin(b, "GET", query)[1]
    got = {k: v for (k, m), v in _sum(page).items() if k in expected}
    assert got == expected, (got, expected)
    assert {m for (k, m) in _sum(page) if k in expected} == {MODEL}
    # the same by the hour and the day, and for one key only
    for width in ("1h", "1d"):
        q = f"/usage/completions?start_time={started}&bucket_width={width}&group_by=api_key_id&api_key_ids={key1}"
        assert {k: v for (k, _), v in _sum(admin(a, "GET", q)[1]).items()} == {key1: expected[key1]}


def test_no_key_value_in_logs(replicas):
    a, b = replicas
    _, _, value = make_key(a, "secret")
    served(b, value)
    for server in (a, b):
        log = open(server.log, encoding="utf-8", errors="replace").read()
        assert value not in log and ADMIN not in log
        assert '"event": "admin"' in log or server is b


def test_restart_keeps_state_and_the_file_wins(redis_url, prices, tmp_path):
    """Both backends, their servers started together: a restart loses no project, key, spend or
    usage (Redis; SQLite: the node's file). The SQLite one also loads a tenant file: its tenants
    are projects the Admin API lists but does not change (the file wins), and the start-up log
    says where the projects and keys come from."""
    from tests.support.tenants import write_tenants
    tenants = write_tenants(tmp_path / "tenants.json", [{"id": "team-file", "api_keys": ["file-key-0123456789"],
                                                         "models": [MODEL]}])
    common = ("--prices", prices, *SMALL)
    flag_sets = (("--redis-url", redis_url, *common),
                 ("--control-db", str(tmp_path / "control.db"), "--tenants", tenants, *common))
    env = {"ADMIN_KEYS": ADMIN}
    made = []
    with started_together(*[dict(flags=flags, env=env) for flags in flag_sets]) as servers:
        for s in servers:
            project, _, value = make_key(s, "durable")
            usage = completion(s, value, 3).json()["usage"]
            made.append((project, value, usage, admin(s, "GET", f"/projects/{project}/spend_limit")[1]))
            assert admin(s, "POST", f"/projects/{project}/model_permissions",
                         {"mode": "allow_list", "model_ids": [MODEL]})[0] == 200
        file_server = servers[1]
        # the file's models, read-only through the Admin API
        permissions = "/projects/team-file/model_permissions"
        assert admin(file_server, "GET", permissions)[1]["model_ids"] == [MODEL]
        for method, body in (("POST", {"mode": "deny_list", "model_ids": []}), ("DELETE", None)):
            status, reply = admin(file_server, method, permissions, body)
            assert status == 409 and reply["error"]["param"] == "project_id", reply
        projects = admin(file_server, "GET", "/projects")[1]["data"]
        assert next(p for p in projects if p["id"] == "team-file")["source"] == "file"
        keys = admin(file_server, "GET", "/projects/team-file/api_keys")[1]["data"]
        assert len(keys) == 1 and "file-key-0123456789" not in json.dumps(keys)
        status, body = admin(file_server, "POST", "/projects/team-file", {"name": "renamed"})
        assert status == 409 and body["error"]["param"] == "project_id"
        assert served(file_server, "file-key-0123456789")
        log = open(file_server.log).read()
        assert "1 projects with 1 keys from the tenant file" in log and "Admin API on (1 admin keys)" in log
    with started_together(*[dict(flags=flags, env=env) for flags in flag_sets]) as servers:
        for s, (project, value, usage, spend) in zip(servers, made):
            assert served(s, value)
            permissions = admin(s, "GET", f"/projects/{project}/model_permissions")[1]
            assert (permissions["mode"], permissions["model_ids"]) == ("allow_list", [MODEL])
            again = admin(s, "GET", f"/projects/{project}/spend_limit")[1]
            assert again["spent_amount"] > spend["spent_amount"] > 0
            assert spend["tokens_used"] == usage["prompt_tokens"] + usage["completion_tokens"]
            page = admin(s, "GET", f"/usage/completions?start_time={int(time.time()) - 600}&project_ids={project}")[1]
            assert sum(r["num_model_requests"] for b in page["data"] for r in b["results"]) == 2


def test_docs_session(replicas, tmp_path):
    """docs/tenants.md's curl session, run as the page gives it: every step answers."""
    from tests.support.docs import EXAMPLE_URL, ROOT, blocks
    (session,) = [b.code for b in blocks(ROOT / "docs/tenants.md") if b.lang == "sh" and "rotate" in b.code]
    assert DOCS_ADMIN in session
    a, _ = replicas
    script = "set -euo pipefail\n" + session.replace(EXAMPLE_URL, a.url) + \
        '\necho\necho "KEY=$KEY NEW=$NEW"\n'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert '"error"' not in out.stdout, out.stdout
    key, new = out.stdout.strip().splitlines()[-1].replace("KEY=", "").replace("NEW=", "").split()
    assert not served(a, key) and served(a, new)
    assert '"input_tokens"' in out.stdout and '"max_requests_per_1_minute":60' in out.stdout.replace(" ", "")


def test_bounds_and_hostile_input(replicas):
    """What a hostile admin client found: bounded work for any usage range, 400s naming the field
    (never a 5xx), no key made in an archived project, archived projects deletable."""
    a, _ = replicas
    start = time.monotonic()
    status, page = admin(a, "GET", "/usage/completions?start_time=0&end_time=99999999999&bucket_width=1m&limit=1")
    assert status == 200 and len(page["data"]) == 1 and page["has_more"] and time.monotonic() - start < 5
    for query in ("/projects?limit=%C2%B2", "/usage/completions?start_time=1_000", "/projects?before=x"):
        status, body = admin(a, "GET", query)
        assert status == 400 and body["error"]["param"], (query, body)
    status, body = admin(a, "POST", "/projects", {"name": "evil\u202e\u0000\n"})
    assert status == 400 and body["error"]["param"] == "name"
    project, key_id, _ = make_key(a, "to-delete")
    assert admin(a, "DELETE", f"/projects/{project}")[0] == 409  # active
    admin(a, "POST", f"/projects/{project}/archive")
    account = admin(a, "GET", f"/projects/{project}/service_accounts")[1]["data"][0]["id"]
    assert admin(a, "POST", f"/projects/{project}/service_accounts/{account}/api_keys", {})[0] == 409
    assert admin(a, "POST", f"/projects/{project}/api_keys/{key_id}/rotate", {})[0] == 409
    status, body = admin(a, "DELETE", f"/projects/{project}")
    assert status == 200 and body == {"object": "organization.project.deleted", "id": project, "deleted": True}
    assert admin(a, "GET", f"/projects/{project}")[0] == 404
