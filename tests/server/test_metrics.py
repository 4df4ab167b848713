"""Observability: the /metrics scrape of a real server (gunicorn workers, gRPC sidecar, engine)
counts exactly what was served, survives dead workers and restarts, and parses; request logs
carry ids and no secrets; the Grafana and Prometheus files name what is exported."""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import time

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proto import inference_pb2 as pb
from proto import inference_pb2_grpc
from tests.support.http import CHAT, COMPLETIONS, chat_body, get, open_stream, post, stream_chunks
from tests.support.servers import running_server

ROOT = pathlib.Path(__file__).resolve().parents[2]
ORIGINAL_SIX = ("inference_kv_slot_utilization", "inference_latency_seconds", "inference_queue_wait_seconds",
                "inference_batch_size", "inference_requests_deadline_exceeded_total",
                "inference_requests_rate_limited_total")
TENANTS = [{"id": "team-a", "api_keys": ["key-a"]}, {"id": "team-b", "api_keys": ["key-b"]},
           {"id": "limited", "api_keys": ["key-c"], "requests_per_second": {"rate": 0.001, "burst": 1}}]


def scrape_text(target) -> str:
    """The /metrics text of ``target`` (a server, or the base URL of its ``--metrics-port``)."""
    r = get(target, "/metrics", timeout=10)
    assert r.status == 200 and r.headers["content-type"].startswith("text/plain")
    return r.body.decode()


def scrape(target) -> dict:
    """``{(sample name, frozenset(labels)): value}`` as prometheus-client's parser reads it."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(scrape_text(target)) for s in fam.samples}


def total(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def delta(before: dict, after: dict, name: str, **labels) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def sse_usage(reply) -> dict:
    return next(e["usage"] for e in stream_chunks(reply.events()) if e.get("usage"))


def infer_usage(chat, payload: str, out: dict) -> dict:
    """The ``usage`` of an ``/infer`` answer (which has no prompt count: the template's)."""
    return {"prompt_tokens": len(chat.encode([{"role": "user", "content": payload}])),
            "completion_tokens": out["tokens"], "prompt_tokens_details": {"cached_tokens": out["cached_tokens"]}}


@pytest.fixture(scope="module")
def metered(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.json"
    path.write_text(json.dumps({"tenants": TENANTS}))
    with running_server("--max-slots", "4", "--max-seq-len", "512", "--workers", "2", "--threads", "8",
                        "--tenants", str(path), grpc=True) as s:
        yield s


def test_counters_and_histograms_equal_what_was_served(metered, chat):
    url = metered.url
    before = scrape(url)
    usage = {"team-a": [0, 0, 0], "team-b": [0, 0, 0]}  # prompt, cached, completion

    def add(tenant, u):
        usage[tenant][0] += u["prompt_tokens"]
        usage[tenant][1] += u["prompt_tokens_details"]["cached_tokens"]
        usage[tenant][2] += u["completion_tokens"]

    for i in range(3):
        status, _, body = post(url, COMPLETIONS, {"prompt": f"Count {i}:", "max_tokens": 5}, key="key-a").parsed()
        assert status == 200
        add("team-a", body["usage"])
    for _ in range(2):
        reply = post(url, CHAT, chat_body("Name a color.", max_tokens=6, stream=True,
                                          stream_options={"include_usage": True}), key="key-a")
        assert reply.status == 200
        add("team-a", sse_usage(reply))
    payload = "Say hi."
    status, _, out = post(url, "/infer", {"payload": payload, "max_new_tokens": 4}, key="key-b").parsed()
    assert status == 200
    add("team-b", infer_usage(chat, payload, out))
    with grpc.insecure_channel(f"127.0.0.1:{metered.grpc_port}") as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        r = stub.ChatComplete(pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Hello")], max_tokens=5),
                              metadata=[("authorization", "Bearer key-b")], timeout=60)
        add("team-b", {"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                       "prompt_tokens_details": {"cached_tokens": r.usage.cached_tokens}})
    served = 7  # every request above generated tokens
    assert post(url, COMPLETIONS, {"prompt": "x", "max_tokens": 2}, key="key-c").status == 200
    assert post(url, COMPLETIONS, {"prompt": "x", "max_tokens": 2}, key="key-c").status == 429
    assert post(url, COMPLETIONS, {"prompt": "x", "max_tokens": 2}).status == 401
    story = "Write a long story about the sea. " * 8
    status, _, out = post(url, "/infer", {"payload": story, "max_new_tokens": 200, "deadline_ms": 1},
                          key="key-a").parsed()
    assert status == 200 and out["finish_reason"] == "deadline"
    add("team-a", infer_usage(chat, story, out))
    after = scrape(url)

    requests = 7 + 4  # + the limited tenant's two, the keyless one, the deadline one
    assert delta(before, after, "inference_requests_total") == requests
    assert delta(before, after, "inference_latency_seconds_count") == requests
    assert delta(before, after, "inference_requests_total", tenant="team-a", route="/v1/completions", status="200",
                 finish_reason="length") == 3
    assert delta(before, after, "inference_requests_total", tenant="team-b",
                 route="/inference.v1.InferenceService/ChatComplete", status="OK") == 1
    assert delta(before, after, "inference_requests_total", tenant="default", status="401") == 1
    assert delta(before, after, "inference_requests_rate_limited_total", tenant="limited", kind="requests") == 1
    assert delta(before, after, "inference_requests_rate_limited_total") == 1
    assert delta(before, after, "inference_requests_deadline_exceeded_total", tenant="team-a") == 1
    assert delta(before, after, "inference_requests_deadline_exceeded_total") == 1
    for tenant, (prompt, cached, completion) in usage.items():
        assert delta(before, after, "inference_prompt_tokens_total", tenant=tenant) == prompt
        assert delta(before, after, "inference_cached_prompt_tokens_total", tenant=tenant) == cached
        assert delta(before, after, "inference_generated_tokens_total", tenant=tenant) == completion
    # The limited tenant's one served request generated its 2 tokens.
    assert delta(before, after, "inference_generated_tokens_total", tenant="limited") == 2
    generated = sum(u[2] for u in usage.values()) + 2
    first_tokens = served + 1 + (out["tokens"] > 0)  # the deadline may have passed before any token
    assert delta(before, after, "inference_time_to_first_token_seconds_count") == first_tokens
    # One gap between consecutive tokens of each request's (single) choice.
    assert delta(before, after, "inference_inter_token_latency_seconds_count") == generated - first_tokens
    assert first_tokens <= delta(before, after, "inference_queue_wait_seconds_count") <= first_tokens + 1
    steps = delta(before, after, "inference_batch_size_count")
    assert steps == delta(before, after, "inference_batch_tokens_count") > 0
    for name in ORIGINAL_SIX:
        assert any(n.startswith(name) for n, _ in after), name


def test_batch_histograms_count_every_decoded_token(metered):
    """Tokens per llama_decode add up to the prefill (prompt - cached) plus every token fed
    back (each generated token but the last) of the requests served."""
    metered.wait_idle()
    before = scrape(metered)
    expected = 0
    for i in range(4):
        u = post(metered, COMPLETIONS, {"prompt": f"Fruit number {i} is", "max_tokens": 7, "ignore_eos": True},
                 key="key-a").json()["usage"]
        expected += u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] + u["completion_tokens"] - 1
    metered.wait_idle()
    after = scrape(metered)
    assert delta(before, after, "inference_batch_tokens_sum") == expected
    assert delta(before, after, "inference_batch_size_sum") >= delta(before, after, "inference_batch_size_count")


def test_gauges_read_the_engine_at_scrape_time(metered):
    metered.wait_idle()
    samples = scrape(metered)
    assert total(samples, "inference_engine_up") == 1
    assert total(samples, "inference_kv_slot_utilization") == 0 and total(samples, "inference_queue_depth") == 0
    with open_stream(metered, COMPLETIONS, {"prompt": "Once", "max_tokens": 400, "stream": True, "ignore_eos": True},
                     key="key-a", timeout=60) as stream:
        assert stream.status == 200
        stream.readline()
        # The first token can reach the client before the engine publishes the step's control
        # block (end of step): wait for that, do not race it.
        end = time.monotonic() + 10
        while (utilization := total(scrape(metered), "inference_kv_slot_utilization")) != 0.25 \
                and time.monotonic() < end:
            time.sleep(0.02)
        assert utilization == 0.25  # 1 of 4 slots


def test_scrape_passes_promtool(metered):
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (.ci/run installs Debian's prometheus package)")
    text = scrape_text(metered)
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_request_log_lines_carry_the_id_and_no_secrets(metered):
    secret = "The secret prompt text 4711"
    status, headers, _ = post(metered, CHAT, chat_body(secret, max_tokens=3), key="key-a",
                              headers={"X-Request-ID": "trace-abc-123"})
    assert status == 200 and headers["x-request-id"] == "trace-abc-123"
    status, headers, _ = post(metered, COMPLETIONS, {"prompt": "x", "max_tokens": 1}, key="key-a",
                              headers={"X-Request-ID": "bad id with spaces"})
    generated = headers["x-request-id"]
    assert status == 200 and re.fullmatch(r"[0-9a-f]{32}", generated)
    health = get(metered, "/health")
    assert health.status == 200
    assert re.fullmatch(r"[0-9a-f]{32}", health.headers["x-request-id"])
    deadline = time.monotonic() + 10
    while True:
        lines = [json.loads(line) for line in open(metered.log) if line.startswith("{")]
        mine = {line["request_id"]: line for line in lines}
        if "trace-abc-123" in mine and generated in mine or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    line = mine["trace-abc-123"]
    assert line["tenant"] == "team-a" and line["route"] == "/v1/chat/completions" and line["status"] == "200"
    assert line["completion_tokens"] == 3 and line["prompt_tokens"] > 0 and line["finish_reason"] == "length"
    assert line["latency_s"] >= line["time_to_first_token_s"] >= line["queue_wait_s"] >= 0
    assert set(line) == {"request_id", "tenant", "route", "status", "finish_reason", "prompt_tokens", "cached_tokens",
                         "completion_tokens", "tool_calls", "queue_wait_s", "time_to_first_token_s", "latency_s"}
    assert mine[generated]["route"] == "/v1/completions"
    log = open(metered.log).read()
    assert secret not in log and "key-a" not in log


def test_grpc_calls_get_a_request_id(metered):
    with grpc.insecure_channel(f"127.0.0.1:{metered.grpc_port}") as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        _, call = stub.Infer.with_call(pb.InferRequest(payload="hi", max_new_tokens=2),
                                       metadata=[("authorization", "Bearer key-a"), ("x-request-id", "grpc-trace-1")],
                                       timeout=60)
        assert dict(call.initial_metadata())["x-request-id"] == "grpc-trace-1"


def test_killing_a_worker_neither_breaks_the_scrape_nor_double_counts(metered):
    for _ in range(4):  # both workers are likely to have served some
        assert post(metered, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2}, key="key-b").status == 200
    # The engine records a step's batch size after publishing its tokens: a client can have its
    # answer a moment before. Idle (the slot table published after the last step), it has.
    metered.wait_idle()
    before = scrape(metered)
    workers = metered.worker_pids()
    victim = workers[0]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while victim in metered.worker_pids() or len(metered.worker_pids()) < len(workers):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    after = scrape(metered)
    metrics_dir = next(line.split()[-1] for line in open(metered.log) if "multiprocess directory" in line)
    left = set(os.listdir(metrics_dir))
    assert not {f"counter_{victim}.db", f"histogram_{victim}.db"} & left and "counter_retired.db" in left
    for name in ("inference_requests_total", "inference_latency_seconds_count", "inference_generated_tokens_total",
                 "inference_prompt_tokens_total", "inference_time_to_first_token_seconds_count",
                 "inference_inter_token_latency_seconds_bucket", "inference_batch_size_count"):
        assert total(after, name) == total(before, name), name
    assert post(metered, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2}, key="key-b").status == 200
    assert delta(after, scrape(metered), "inference_requests_total") == 1


def test_engine_restart_is_counted_and_up_returns(metered):
    before = scrape(metered)
    os.kill(metered.engine.t.control.engine_pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        assert get(metered, "/health/live").status == 200  # live throughout
        ready = get(metered, "/health/ready").status
        if ready != 200:
            assert ready == 503
            break  # not ready while the engine restarts, yet alive
        assert time.monotonic() < deadline, "readiness never saw the engine down"
    deadline = time.monotonic() + 120
    while True:
        samples = scrape(metered)
        if delta(before, samples, "inference_engine_restarts_total") == 1 and total(samples, "inference_engine_up"):
            break
        assert time.monotonic() < deadline, "restart not counted"
        time.sleep(0.2)
    # The dead engine's step histograms still count.
    assert total(samples, "inference_batch_size_count") >= total(before, "inference_batch_size_count")


def test_restart_over_old_files_starts_from_zero_and_metrics_port(tmp_path):
    """An operator's PROMETHEUS_MULTIPROC_DIR with files of an earlier run: emptied at start.
    Also: ``--metrics-port`` serves /metrics there only, and ``--log-prompts`` logs prompts."""
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    with running_server("--max-slots", "2", "--max-seq-len", "256", "--workers", "1", env=env) as s:
        for _ in range(3):
            assert post(s, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2}).status == 200
        assert total(scrape(s), "inference_requests_total") == 3
    assert any(f.endswith(".db") for f in os.listdir(tmp_path))  # the operator's directory is kept
    from tests.support.servers import free_port
    port = free_port()
    with running_server("--max-slots", "2", "--max-seq-len", "256", "--workers", "1", "--metrics-port", str(port),
                        "--log-prompts", env=env) as s:
        metrics_url = f"http://127.0.0.1:{port}"
        samples = scrape(metrics_url)
        assert total(samples, "inference_requests_total") == 0
        assert total(samples, "inference_batch_size_count") == 0 and total(samples, "inference_engine_up") == 1
        assert get(s, "/metrics").status == 404
        assert get(metrics_url, "/health").status == 404
        assert post(s, COMPLETIONS, {"prompt": "Logged prompt 99", "max_tokens": 2}).status == 200
        assert total(scrape(metrics_url), "inference_requests_total") == 1
        deadline = time.monotonic() + 10
        while not any('"prompt":"Logged prompt 99"' in line for line in open(s.log)):
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_no_metrics_serves_no_metrics(app):
    import dataclasses

    from tests.support.servers import AppServer
    off = AppServer(dataclasses.replace(app.config, metrics=False), app.generator)
    assert off.request("GET", "/metrics")[0] == 404
    assert app.request("GET", "/metrics")[0] == 200


def test_dashboard_queries_name_exported_metrics(metered):
    assert post(metered, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2}, key="key-a").status == 200
    exported = {name for name, _ in scrape(metered)}
    dashboard = json.loads((ROOT / "docker/grafana/dashboards/inference.json").read_text())
    panels = dashboard["panels"]
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("slot utilization", "queue depth", "batch size", "tokens per second", "time to first token",
                  "inter-token latency", "latency", "hit ratio", "rate-limited", "deadline-exceeded"):
        assert topic in titles, topic
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = re.findall(r"\binference_[a-z_]+", target["expr"])
            assert names, target
            for name in names:
                assert name in exported, (panel["title"], name)


def test_prometheus_config_passes_promtool():
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (.ci/run installs Debian's prometheus package)")
    check = subprocess.run(["promtool", "check", "config", str(ROOT / "docker/prometheus/prometheus.yml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
