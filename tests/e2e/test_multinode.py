"""The multi-node path on one machine: a real Redis, three real replicas on 127.0.0.2, .3 and .4
sharing it, and nginx started from the shipped ``docker/nginx/nginx.conf.template`` in front of
them (``tests/support/nginx.py``; least connections). Streams pass through unbuffered with their
keep-alive comments; 48 requests at once reach every replica; one tenant's quota holds across
the three; gRPC goes through the same proxy; a replica SIGKILLed under load ends its own streams
with an error event while no new request fails and none is sent to it again; a replica drained
with SIGTERM finishes its streams while new requests go to the others. Skipped, saying why,
without nginx (``.ci/run`` installs Debian's) or without a redis-server."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time
import types

import grpc
import pytest

from engine.supervisor import pid_alive
from proto import inference_pb2 as pb
from proto import inference_pb2_grpc
from shm.segment import remove_orphans
from tests.support.http import CHAT, STREAM_CUT, chat_body, get, open_stream, post
from tests.support.servers import needs_redis, redis_server, running_replicas
from tests.support.nginx import AFFINITY, FAIL_TIMEOUT_S, LEAST_CONN, TEMPLATE, Nginx, needs_nginx, nginx_variables
from tests.support.tenants import write_tenants

pytestmark = [needs_nginx, needs_redis]

HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
KEY = "alpha-key"
TENANTS = [{"id": "alpha", "api_keys": [KEY]},
           {"id": "metered", "api_keys": ["metered-key"], "requests_per_second": {"rate": 0.001, "burst": 6}}]
#: small replicas (three engines share this machine's CPUs): 2 slots, one compute thread each
FLAGS = ("--max-slots", "2", "--max-queued", "22", "--max-seq-len", "256", "--workers", "1", "--engine-threads", "1",
         "--sse-keepalive-s", "0.2", "--max-body-bytes", "65536", "--no-metrics")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """``(proxy, replicas)``: nginx (least_conn) in front of three replicas sharing one Redis."""
    tenants = write_tenants(tmp_path_factory.mktemp("multinode") / "tenants.json", TENANTS)
    with redis_server() as (url, _), \
            running_replicas(HOSTS, *FLAGS, "--tenants", tenants, "--redis-url", url, grpc=True) as replicas:
        # a first decode pays once for the memory it touches first: not in any test's figures
        assert [ask(r, "Hi", 2, "warm-up")[0] for r in replicas] == [200] * 3
        proxy = Nginx(replicas, LEAST_CONN, max_body_bytes=65536)
        try:
            yield proxy, replicas
        finally:
            proxy.stop()


class SSE:
    """One streaming chat completion through ``target`` (the proxy or a replica), read in a
    thread; ``lines`` holds ``(seconds since the request, line)``, comments included."""

    def __init__(self, target, content: str, max_tokens: int, tag: str = "-"):
        self.lines: list[tuple[float, bytes]] = []
        self.first_content = threading.Event()
        body = chat_body(content, max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True)
        self.thread = threading.Thread(target=self._read, args=(target, body, tag))
        self.thread.start()

    def _read(self, target, body, tag) -> None:
        t0 = time.perf_counter()
        with open_stream(target, CHAT, body, headers=tagged(tag), key=KEY) as response:
            try:
                for line in response:
                    self.lines.append((time.perf_counter() - t0, line.rstrip(b"\n")))
                    if self.text():
                        self.first_content.set()
                    if line.strip() == b"data: [DONE]":
                        break
            except STREAM_CUT:
                pass  # cut: finish() reports what came
            finally:
                self.first_content.set()

    @staticmethod
    def content(line: bytes) -> str:
        """The generated text a line carries ("" for comments, the role chunk, the end)."""
        if not line.startswith(b"data: {"):
            return ""
        return "".join((c.get("delta") or {}).get("content") or "" for c in json.loads(line[6:]).get("choices", []))

    def chunks(self) -> list[dict]:
        return [json.loads(line[6:]) for _, line in self.lines if line.startswith(b"data: {")]

    def text(self) -> str:
        return "".join(self.content(line) for _, line in self.lines)

    def first_token(self) -> int:
        """The index in ``lines`` of the first line with generated text."""
        return next(i for i, (_, line) in enumerate(self.lines) if self.content(line))

    def ttft(self) -> float:
        return self.lines[self.first_token()][0]

    def finish(self) -> list[dict]:
        """Wait for the end; the data chunks. Asserts the stream ended with ``data: [DONE]``."""
        self.thread.join(120)
        assert self.lines and self.lines[-1][1] == b"data: [DONE]", self.lines[-3:]
        return self.chunks()


def tagged(tag: str) -> dict:
    """A request's header ``tag`` (X-Conversation-ID, which the access log records): it finds
    the request's log entry."""
    return {"X-Conversation-ID": tag}


def ask(target, content: str, max_tokens: int, tag: str, key: str = KEY) -> tuple[int, dict, dict]:
    """A greedy chat completion through ``target`` (the proxy or a replica), tagged ``tag``;
    ``(status, headers, the JSON body)``."""
    return post(target, CHAT, chat_body(content, max_tokens=max_tokens, temperature=0), headers=tagged(tag),
                key=key).parsed()


def streaming(proxy: Nginx, n: int, max_tokens: int) -> list[SSE]:
    """``n`` long streams through ``proxy``, each past its first token."""
    streams = [SSE(proxy, f"Tell a long story, number {i}.", max_tokens) for i in range(n)]
    for s in streams:
        assert s.first_content.wait(60)
    return streams


def attempts(log: list[dict]) -> list[list[tuple[str, str]]]:
    """Each logged request's ``(replica, status)`` attempts (nginx logs a refused connection as 502)."""
    return [list(zip(r["upstreams"], r["upstream_statuses"])) for r in log]


def address(replica) -> str:
    return f"{replica.host}:{replica.port}"


def in_flight(replica) -> int:
    """Requests the replica holds (queued, running, or being sent): its leased mailboxes."""
    return replica.engine.mailboxes_in_use()


def wait_gone(pids: list[int], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        assert time.monotonic() < end, [p for p in pids if pid_alive(p)]
        time.sleep(0.05)


def test_the_shipped_configuration_passes_nginx_t_and_with_no_replica_answers_503():
    class Absent:  # nothing listens there
        host, port, grpc_port = "127.0.0.2", 1, 2
    for balance in (LEAST_CONN, AFFINITY):
        proxy = Nginx([Absent] * 3, balance)  # raises with nginx's message if -t refuses it
        try:
            status, _, body = ask(proxy, "Hi", 1, "absent")
        finally:
            proxy.stop()
        # every replica refused: the replicas' own overload answer, not nginx's HTML 502
        assert status == 503 and body["error"]["code"] == "no_replica_available"


def test_the_recipe_renders_any_number_of_replicas_and_keeps_nginx_variables():
    """docs/operations.md's recipe for replicas without Docker: docker/nginx/render.sh (which the
    Nginx helper runs) for five replicas; `nginx -t` accepts the file, nginx's own $variables
    are all still there, and /metrics is not passed to any replica."""
    absent = [types.SimpleNamespace(host="127.0.0.2", port=port, grpc_port=0) for port in range(1, 6)]  # no one there
    proxy = Nginx(absent)
    try:
        text = open(proxy.conf).read()
        servers = [line.split()[1] for line in text.splitlines() if line.strip().startswith("server 127.")]
        assert servers[:5] == [f"127.0.0.2:{p}" for p in range(1, 6)] and len(servers) == 10  # and 5 gRPC
        assert nginx_variables(text) == nginx_variables(TEMPLATE.read_text())
        assert "binary_remote_addr" in nginx_variables(text)
        check = proxy.run("-t")
        assert check.returncode == 0 and "test is successful" in check.stderr, check.stderr
        # answered by nginx itself (no replica listens: a proxied request would get a 503)
        status, _, body = get(proxy, "/metrics").parsed()
        assert status == 404 and body["error"]["message"] == "no route for GET /metrics"
        assert ask(proxy, "Hi", 1, "absent")[0] == 503
    finally:
        proxy.stop()


def test_streams_pass_through_unbuffered_with_their_keepalive_comments(cluster):
    proxy, replicas = cluster
    # The first token comes through while its sequence is still being decoded (a buffering
    # proxy would hold the events back), and the text equals the replica's own answer.
    direct = SSE(replicas[0], "Tell a story about a fox.", 24)
    direct.finish()
    through = SSE(proxy, "Tell a story about a fox.", 24)
    assert through.first_content.wait(60)
    assert sum(in_flight(r) for r in replicas) == 1, "the first token came after the replica sent the end"
    through.finish()
    assert through.text() == direct.text()
    print(f"\nTTFT: direct {direct.ttft() * 1000:.1f} ms, through nginx {through.ttft() * 1000:.1f} ms "
          "(one of each: bench.multinode compares them)")
    # Six long streams fill the six slots; a seventh waits in a queue, and its keep-alive
    # comments reach the client through the proxy before its first token.
    running = streaming(proxy, 6, 32)
    queued = SSE(proxy, "Say hello.", 4)
    queued.finish()
    waited = [line for _, line in queued.lines[:queued.first_token()]]
    assert b": keep-alive" in waited, waited
    for s in running:
        assert s.finish()[-1]["choices"][0]["finish_reason"] == "length"


def test_48_concurrent_requests_reach_every_replica(cluster):
    proxy, replicas = cluster
    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        statuses = list(pool.map(lambda i: ask(proxy, f"What is {i} plus {i}?", 1, f"many-{i}")[0], range(48)))
    assert statuses == [200] * 48
    served = [r["upstreams"][-1] for r in proxy.logged("many-", 48)]
    assert set(served) == {address(r) for r in replicas}
    print("\nrequests per replica:", {a: served.count(a) for a in sorted(set(served))})


def test_one_tenants_quota_holds_across_the_three(cluster):
    proxy, replicas = cluster
    statuses = [ask(proxy, "Hi", 1, f"quota-{i}", key="metered-key")[0] for i in range(9)]
    # burst 6 in one Redis bucket; each replica alone would have let all 9 through
    assert statuses == [200] * 6 + [429] * 3
    log = proxy.logged("quota-", 9)
    assert {r["upstreams"][-1] for r in log if r["status"] == 200} == {address(r) for r in replicas}
    assert all(len(r["upstreams"]) == 1 for r in log)  # a 429 is not retried


def test_grpc_goes_through_the_same_proxy(cluster):
    proxy, replicas = cluster
    metadata = (("authorization", f"Bearer {KEY}"), ("x-conversation-id", "grpc"))
    request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Name a colour.")], max_tokens=8,
                             temperature=0)
    with grpc.insecure_channel(f"127.0.0.1:{proxy.grpc_port}") as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        answers = [stub.ChatComplete(request, metadata=metadata, timeout=60).choices[0].text for _ in range(3)]
        streamed = "".join(c.text for c in stub.ChatCompleteStream(request, metadata=metadata, timeout=60))
    with grpc.insecure_channel(f"{replicas[0].host}:{replicas[0].grpc_port}") as channel:
        direct = inference_pb2_grpc.InferenceServiceStub(channel).ChatComplete(request, metadata=metadata, timeout=60)
    assert answers == [direct.choices[0].text] * 3 and streamed == direct.choices[0].text
    calls = [r for r in proxy.logged("grpc", 4) if "InferenceService/ChatComplete " in r["request"]]
    assert {r["upstreams"][-1] for r in calls} == {f"{r.host}:{r.grpc_port}" for r in replicas}


def test_a_replica_killed_under_load_ends_its_streams_with_an_error_and_fails_no_new_request(cluster):
    proxy, replicas = cluster
    victim = replicas[2]
    streams = streaming(proxy, 6, 64)
    on_victim = in_flight(victim)
    assert on_victim >= 1
    processes = [victim.proc.pid, *victim.children()]
    # The master and the engine, at once: no supervisor is left to fail the engine's sequences,
    # and the worker, which outlives its master for a moment, ends its streams itself.
    for pid in (victim.proc.pid, victim.engine.t.control.engine_pid):
        os.kill(pid, signal.SIGKILL)
    started = []
    for i in range(6):  # new requests while the other streams run
        started.append(time.monotonic())
        assert ask(proxy, f"Quick question {i}?", 2, f"after-kill-{i}")[0] == 200
    errors = []
    for s in streams:
        chunks = s.finish()  # every stream ends with [DONE]: the victim's too, after its error event
        if "error" in chunks[-1]:
            errors.append(chunks[-1]["error"])
        else:
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(errors) == on_victim and {e["code"] for e in errors} == {"engine_unavailable"}, errors
    # The proxy tried the victim for one new request at most (then retried it elsewhere) and
    # sent it nothing more while its failure mark lasted (fail_timeout).
    log = proxy.logged("after-kill-", 6)
    print("\nafter the kill, each request's attempts:", attempts(log))
    tried = [i for i, r in enumerate(log) if address(victim) in r["upstreams"]]
    assert all(r["upstreams"][-1] != address(victim) for r in log)
    assert [i for i in tried if started[i] - started[tried[0]] < FAIL_TIMEOUT_S] == tried[:1], log
    wait_gone(processes)  # its workers left once their streams ended
    remove_orphans()  # what a new start on this node does with the killed server's segment
    assert not os.path.exists(f"/dev/shm/{victim.shm}")


def test_a_replica_drained_with_sigterm_finishes_its_streams_and_refuses_nothing(cluster):
    proxy, replicas = cluster
    drained = replicas[1]
    streams = streaming(proxy, 4, 64)
    assert in_flight(drained) >= 1
    drained.proc.send_signal(signal.SIGTERM)
    # Until its master has seen the signal a request it gets is served (not new to a drain):
    # the new ones are sent once it refuses.
    deadline = time.monotonic() + 5
    while get(drained, "/health/ready", timeout=5).status != 503:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for i in range(6):
        assert ask(proxy, f"Another question {i}?", 2, f"after-term-{i}")[0] == 200
    for s in streams:  # the drained replica's included
        assert s.finish()[-1]["choices"][0]["finish_reason"] == "length"
    assert drained.proc.wait(60) == 0
    log = proxy.logged("after-term-", 6)
    print("\nafter the SIGTERM, each request's attempts:", attempts(log))
    assert all(r["upstreams"][-1] == address(replicas[0]) for r in log)
