"""The gRPC sidecar: a real server (gunicorn master, engine, sidecar process), the real model and a
grpcio client. Every status code comes from a real cause."""
from __future__ import annotations

import contextlib
import filecmp
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from proto import inference_pb2 as pb
from proto import inference_pb2_grpc
from tests.support.grpc_channel import SERVICE, health_status, open_channel, wait_serving
from tests.support.http import CHAT, chat_body, get, post, stream_chunks
from tests.support.servers import running_server, wait_steps

ROOT = pathlib.Path(__file__).resolve().parents[2]
TENANTS = [{"id": "alpha", "api_keys": ["alpha-key"]},
           {"id": "beta", "api_keys": ["beta-key"]},
           {"id": "metered", "api_keys": ["metered-key"], "requests_per_second": {"rate": 0.001, "burst": 1}}]
ALPHA = (("authorization", "Bearer alpha-key"),)


def _chat(content: str, max_tokens: int = 12, **kw) -> pb.ChatRequest:
    return pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=content)], max_tokens=max_tokens,
                          **{"temperature": 0, **kw})


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory):
    """4 slots and a tenant file, with the sidecar; yields ``(server, stub, channel)``."""
    path = tmp_path_factory.mktemp("grpc") / "tenants.json"
    path.write_text(json.dumps({"tenants": TENANTS}))
    with running_server("--max-slots", "4", "--max-seq-len", "512", "--max-queued", "40", "--workers", "2",
                        "--threads", "24", "--tenants", str(path), grpc=True) as server:
        channel = open_channel(server.grpc_port)
        wait_serving(channel)
        yield server, inference_pb2_grpc.InferenceServiceStub(channel), channel
        channel.close()


@pytest.fixture(scope="module")
def small_server():
    """One slot and no queue: a second request finds the server saturated."""
    with running_server("--max-slots", "1", "--max-queued", "0", "--max-seq-len", "256", "--workers", "1",
                        grpc=True) as server:
        channel = open_channel(server.grpc_port)
        wait_serving(channel)
        yield server, inference_pb2_grpc.InferenceServiceStub(channel), channel
        channel.close()


def test_stubs_are_generated_from_the_proto(tmp_path):
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", str(ROOT / "proto/inference.proto")],
                   check=True)
    for name in ("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py"):
        assert filecmp.cmp(tmp_path / "proto" / name, ROOT / "proto" / name, shallow=False), \
            f"proto/{name} is stale: regenerate it (see proto/inference.proto)"


def test_logit_bias_over_grpc(tenant_server, tokenizer):
    """ChatRequest.logit_bias is OpenAI's logit_bias: -100 bans the greedy token, +100 forces one,
    an id outside the vocabulary is INVALID_ARGUMENT naming the field."""
    _, stub, _ = tenant_server
    greedy = stub.ChatComplete(_chat("Write a haiku about rain.", 1), metadata=ALPHA).choices[0].token_ids[0]
    banned = stub.ChatComplete(_chat("Write a haiku about rain.", 1, logit_bias={greedy: -100}), metadata=ALPHA)
    assert banned.choices[0].token_ids[0] != greedy
    forced = stub.ChatComplete(_chat("Write a haiku about rain.", 3, logit_bias={42: 100}), metadata=ALPHA)
    assert list(forced.choices[0].token_ids) == [42, 42, 42]
    with pytest.raises(grpc.RpcError) as e:
        stub.ChatComplete(_chat("Hi", 1, logit_bias={tokenizer.n_vocab: 1}), metadata=ALPHA)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in e.value.details()


def test_unary_and_streaming_calls_agree(tenant_server):
    _, stub, _ = tenant_server
    infer = stub.Infer(pb.InferRequest(payload="Tell a story about a red fox.", max_new_tokens=16), metadata=ALPHA)
    assert infer.tenant_id == "alpha" and infer.tokens == 16 and infer.finish_reason == "length"
    chunks = list(stub.InferStream(pb.InferRequest(payload="Tell a story about a red fox.", max_new_tokens=16),
                                   metadata=ALPHA))
    assert "".join(c.text for c in chunks) == infer.text
    assert sum(len(c.token_ids) for c in chunks) == 16
    last = chunks[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == 16
    assert all(not c.HasField("usage") and not c.finish_reason for c in chunks[:-1])

    chat = stub.ChatComplete(_chat("Write a haiku about rain.", 20), metadata=ALPHA)
    streamed = list(stub.ChatCompleteStream(_chat("Write a haiku about rain.", 20), metadata=ALPHA))
    assert "".join(c.text for c in streamed) == chat.choices[0].text
    assert [t for c in streamed for t in c.token_ids] == list(chat.choices[0].token_ids)
    assert streamed[-1].usage.completion_tokens == chat.usage.completion_tokens == len(chat.choices[0].token_ids)
    assert streamed[-1].usage.prompt_tokens == chat.usage.prompt_tokens > 0

    # The same answer as HTTP gives for the same body.
    reply = post(tenant_server[0], CHAT, chat_body("Write a haiku about rain.", max_tokens=20, temperature=0),
                 key="alpha-key", timeout=60)
    assert reply.json()["choices"][0]["message"]["content"] == chat.choices[0].text


@pytest.mark.parametrize("request_, metadata, code, param", [
    (_chat("Hi", temperature=-1), ALPHA, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (pb.ChatRequest(messages=[pb.ChatMessage(role="tool", content="x")]), ALPHA, grpc.StatusCode.INVALID_ARGUMENT,
     "messages[0].tool_call_id"),
    (pb.ChatRequest(messages=[pb.ChatMessage(role="function", content="x")]), ALPHA, grpc.StatusCode.INVALID_ARGUMENT,
     "messages[0].role"),
    (_chat("Hi", top_logprobs=3), ALPHA, grpc.StatusCode.INVALID_ARGUMENT, "top_logprobs"),
    (pb.ChatRequest(model="gpt-17", messages=[pb.ChatMessage(role="user", content="x")]), ALPHA,
     grpc.StatusCode.NOT_FOUND, "model"),
    (_chat("Hi"), (), grpc.StatusCode.UNAUTHENTICATED, None),
    (_chat("Hi"), (("x-tenant-id", "nope"),), grpc.StatusCode.UNAUTHENTICATED, None),
    (pb.InferRequest(payload="Hi", tenant_id="beta"), ALPHA, grpc.StatusCode.PERMISSION_DENIED, "tenant_id"),
    (pb.InferRequest(payload="Hi", max_new_tokens=0), ALPHA, grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
    (pb.InferRequest(payload="Hi", priority=7), ALPHA, grpc.StatusCode.INVALID_ARGUMENT, "priority"),
    (_chat("Hi", priority=-1), ALPHA, grpc.StatusCode.INVALID_ARGUMENT, "priority"),
    # A key sent twice is refused, as HTTP refuses two Authorization headers.
    (_chat("Hi"), (("authorization", "Bearer nope"), ("authorization", "Bearer alpha-key")),
     grpc.StatusCode.UNAUTHENTICATED, None),
])
def test_refusals_match_http(tenant_server, request_, metadata, code, param):
    _, stub, _ = tenant_server
    method = stub.Infer if isinstance(request_, pb.InferRequest) else stub.ChatComplete
    with pytest.raises(grpc.RpcError) as e:
        method(request_, metadata=metadata, timeout=30)
    assert e.value.code() == code, e.value.details()
    assert dict(e.value.trailing_metadata() or ()).get("param") == param
    assert "alpha-key" not in e.value.details()


def test_empty_strings_are_accepted_as_over_http(tenant_server):
    _, stub, _ = tenant_server
    assert stub.Infer(pb.InferRequest(payload="", max_new_tokens=2), metadata=ALPHA).tokens == 2
    chat = stub.ChatComplete(pb.ChatRequest(messages=[pb.ChatMessage(role="system", content=""),
                                                      pb.ChatMessage(role="user", content="Hi")],
                                            max_tokens=2, ignore_eos=True), metadata=ALPHA)
    assert chat.usage.completion_tokens == 2


def test_over_quota_is_resource_exhausted_with_retry_after(tenant_server):
    _, stub, _ = tenant_server
    metered = (("authorization", "Bearer metered-key"),)
    stub.Infer(pb.InferRequest(payload="Hi", max_new_tokens=1), metadata=metered)
    with pytest.raises(grpc.RpcError) as e:
        stub.Infer(pb.InferRequest(payload="Hi", max_new_tokens=1), metadata=metered)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(e.value.trailing_metadata())["retry-after-ms"]) > 1000


def _blockers(stub, n: int, metadata=ALPHA):
    """``n`` long streams that hold slots; each returns its first chunk before this returns."""
    calls = [stub.ChatCompleteStream(_chat(f"Tell a long story number {i}.", 200, ignore_eos=True),
                                     metadata=metadata) for i in range(n)]
    for call in calls:
        next(call)
    return calls


@pytest.mark.parametrize("deadline", ["call", "request"])
def test_deadline_against_a_busy_server_is_deadline_exceeded_and_its_sequence_is_gone(tenant_server, deadline):
    """The call's gRPC deadline (50 ms), or the request's ``deadline_ms``, passes while every
    slot is busy: DEADLINE_EXCEEDED, and nothing of the request stays in the engine."""
    server, stub, _ = tenant_server
    calls = _blockers(stub, 4)
    try:
        with pytest.raises(grpc.RpcError) as e:
            if deadline == "call":
                stub.ChatComplete(_chat("Are you there?"), metadata=ALPHA, timeout=0.05)
            else:
                stub.Infer(pb.InferRequest(payload="Hi", deadline_ms=100), metadata=ALPHA, timeout=30)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_steps(server.engine, 3)
        assert server.engine.mailboxes_in_use() == 4  # the blockers only
    finally:
        for call in calls:
            call.cancel()
    server.wait_idle()


def test_client_cancel_frees_the_slot_within_one_engine_step(tenant_server):
    server, stub, _ = tenant_server
    (call,) = _blockers(stub, 1)
    assert server.engine.mailboxes_in_use() == 1
    step = server.engine.step()
    call.cancel()
    end = time.monotonic() + 10
    while server.engine.mailboxes_in_use():
        assert time.monotonic() < end
        time.sleep(0.005)
    # Noticed at the step after the cancel at the latest: retired there, released right after.
    assert server.engine.step() - step <= 3
    server.wait_idle()


def test_saturated_is_unavailable(small_server):
    server, stub, _ = small_server
    (call,) = _blockers(stub, 1, metadata=())
    try:
        with pytest.raises(grpc.RpcError) as e:
            stub.ChatComplete(_chat("Hi"), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert int(dict(e.value.trailing_metadata())["retry-after-ms"]) >= 1000
    finally:
        call.cancel()
    server.wait_idle()


def test_overload_is_unavailable_and_health_still_answers(small_server):
    """Far more calls than handler threads (1 + 8 here) against a full server: every one is
    UNAVAILABLE with retry-after-ms (never gRPC's own RESOURCE_EXHAUSTED), and health probes
    keep answering meanwhile."""
    server, stub, channel = small_server
    (call,) = _blockers(stub, 1, metadata=())
    futures = [stub.ChatComplete.future(_chat("Hi"), timeout=60) for _ in range(40)]
    try:
        for _ in range(10):
            assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
        codes = [f.exception().code() if f.exception() else grpc.StatusCode.OK for f in futures]
        assert set(codes) == {grpc.StatusCode.UNAVAILABLE}, codes
        assert all(int(dict(f.exception().trailing_metadata())["retry-after-ms"]) >= 1000 for f in futures)
    finally:
        call.cancel()
    server.wait_idle()


def test_reflection_lists_the_services(small_server):
    _, _, channel = small_server
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    (answer,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in answer.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_health_follows_an_engine_restart(small_server):
    server, stub, channel = small_server
    assert health_status(channel) == health_pb2.HealthCheckResponse.SERVING
    os.kill(server.engine.t.control.engine_pid, signal.SIGKILL)
    seen, end = set(), time.monotonic() + 60
    while not (health_pb2.HealthCheckResponse.NOT_SERVING in seen and
               health_status(channel) == health_pb2.HealthCheckResponse.SERVING):
        seen.add(health_status(channel))
        assert time.monotonic() < end, seen
        time.sleep(0.01)
    assert stub.ChatComplete(_chat("Hi", 2)).usage.completion_tokens == 2
    server.wait_idle()


def test_sidecar_killed_mid_stream_restarts_and_leaks_nothing(small_server):
    server, _, _ = small_server
    channel = open_channel(server.grpc_port)
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    (call,) = _blockers(stub, 1, metadata=())
    old = server.sidecar_pid()
    os.kill(old, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    server.wait_idle(timeout=30)  # its mailbox reclaimed, its sequence cancelled
    end = time.monotonic() + 60
    while server.sidecar_pid() in (None, old):
        assert time.monotonic() < end, "the sidecar was not restarted"
        time.sleep(0.05)
    # Tenant reloads (the master's SIGHUP, which it passes on) while the new sidecar starts:
    # carried out once it can, not its death.
    restarted = server.sidecar_pid()
    for _ in range(6):
        server.proc.send_signal(signal.SIGHUP)
        time.sleep(0.05)
    channel = open_channel(server.grpc_port)
    wait_serving(channel)
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    assert stub.ChatComplete(_chat("Hi", 3)).usage.completion_tokens == 3
    assert server.sidecar_pid() == restarted, open(server.log).read()[-3000:]
    server.wait_idle()


def test_a_sidecar_outlives_no_master():
    """A master killed just after it forked a sidecar (a restart's first instants, before the
    sidecar's own start-up code runs): the sidecar ends with it, and the gRPC port is free for the
    next server."""
    from engine.supervisor import pid_alive
    from shm import segment
    from tests.support.servers import is_sidecar

    with running_server("--max-slots", "1", "--max-seq-len", "128", grpc=True) as server:
        old = server.sidecar_pid()
        os.kill(old, signal.SIGKILL)
        end = time.monotonic() + 30
        while not (new := [p for p in server.children() if p != old and is_sidecar(p)]):
            assert time.monotonic() < end, "no sidecar was started again"
            time.sleep(0.002)
        children = server.children()
        os.kill(server.proc.pid, signal.SIGKILL)  # the new sidecar is still importing gRPC
        server.proc.wait()
        end = time.monotonic() + 30
        while [p for p in children if pid_alive(p)]:  # the workers and the engine too
            assert time.monotonic() < end, ("left running:", [p for p in children if pid_alive(p)], new)
            time.sleep(0.05)
        with socket.socket() as s:
            s.bind(("127.0.0.1", server.grpc_port))  # nothing holds it
        segment.remove_orphans(segment.SHM_DIR)  # what the next start would do


def test_16_grpc_and_16_http_streams_together(tenant_server):
    server, stub, _ = tenant_server
    results, errors = {}, []

    def grpc_client(i):
        try:
            chunks = list(stub.ChatCompleteStream(_chat(f"Count to ten, try {i}.", 16, ignore_eos=True),
                                                  metadata=ALPHA, timeout=300))
            results[("grpc", i)] = (sum(len(c.token_ids) for c in chunks), chunks[-1].usage.completion_tokens)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def http_client(i):
        try:
            reply = post(server, CHAT, chat_body(f"Count to ten, try {i}.", max_tokens=16, temperature=0,
                                                 ignore_eos=True, stream=True, stream_options={"include_usage": True}),
                         key="alpha-key", timeout=300)
            events = stream_chunks(reply.events(comments=True))
            pieces = sum(1 for ev in events for c in ev["choices"] if c["delta"].get("content"))
            results[("http", i)] = (pieces, events[-1]["usage"]["completion_tokens"])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=f, args=(i,)) for i in range(16) for f in (grpc_client, http_client)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 32
    assert all(usage == 16 for _, usage in results.values())
    assert all(n == 16 for (kind, _), (n, _) in results.items() if kind == "grpc")
    server.wait_idle()


def test_health_is_not_serving_until_the_engine_is_ready(model_path):
    """The sidecar's own server over a real transport whose engine state this test sets (as an
    engine process would): NOT_SERVING from before the server starts, SERVING once ready, and
    NOT_SERVING again when the engine dies, then for good after the stop."""
    from server.config import ServerConfig
    from server.model_router import ModelRouter
    from server.grpc.server import build, follow_engine
    from server.tenancy.tenants import TenantRegistry, Tenants
    from shm import EngineState, Transport
    from tests.support.servers import free_port

    config = ServerConfig(model_path=model_path, max_slots=1, max_seq_len=256, grpc_port=free_port())
    transport = Transport.create(config.engine_config().layout())
    models = ModelRouter.attach(config, [transport.name], None)
    engine = models.default.engine
    server, health = build(config, models, TenantRegistry(Tenants.load(None)))
    server.start()
    stop = threading.Event()
    follower = threading.Thread(target=follow_engine, args=([engine], health, stop))
    follower.start()
    try:
        channel = open_channel(config.grpc_port)
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        assert health_status(channel) == not_serving and health_status(channel, "") == not_serving
        transport.control.set_state(EngineState.READY, pid=os.getpid())
        wait_serving(channel, timeout=5)
        transport.control.set_state(EngineState.DEAD)
        end = time.monotonic() + 5
        while health_status(channel) != not_serving:
            assert time.monotonic() < end
            time.sleep(0.02)
    finally:
        stop.set()
        follower.join()
        server.stop(0).wait()
        engine.close()
        transport.close()


@contextlib.contextmanager
def _listener_sharing_its_port():
    """A socket listening on a free loopback port with ``SO_REUSEPORT``, as gRPC's default server
    binds: yields its port."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_used_grpc_port_stops_the_start_and_leaves_nothing(tmp_path):
    """Another process listening on ``--grpc-port`` (with ``SO_REUSEPORT``, as another server's
    sidecar did) stops the start at once with one line naming the flag; before, both servers
    bound the port and the kernel spread the calls over them."""
    import secrets

    name = f"infer-test-{secrets.token_hex(4)}"
    with _listener_sharing_its_port() as port:
        r = subprocess.run([sys.executable, "-m", "server.cli", "--port", "0", "--grpc-port", str(port),
                            "--workers", "1", "--max-slots", "1", "--max-seq-len", "128"],
                           env={**os.environ, "INFERENCE_SHM": name}, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert f"inference-server: --grpc-port {port} is in use" in r.stderr, r.stderr[-3000:]
    assert "engine starting" not in r.stderr
    assert not os.path.exists(f"/dev/shm/{name}") and not os.path.exists(f"/dev/shm/{name}.d")


def test_a_grpc_port_taken_before_the_sidecar_binds_stops_the_server():
    """The port taken between the master's check and the sidecar's bind (two servers started at
    once with one ``--grpc-port``; here another process takes it while the sidecar restarts):
    the server stops with exit status 1 and a line naming the flag, leaving nothing behind.
    Before, the sidecar was restarted every 0.5 s for good while the health check said ready."""
    with running_server("--max-slots", "1", "--max-seq-len", "128", "--workers", "1", grpc=True) as s:
        children = s.children()
        sidecar = s.sidecar_pid()
        os.kill(sidecar, signal.SIGKILL)
        while _running(sidecar):
            time.sleep(0.01)
        with socket.socket() as taker:  # before the restart (RESTART_S) binds it again
            taker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            end = time.monotonic() + 0.3
            while True:  # the dead sidecar's listening socket may take a moment to go
                try:
                    taker.bind(("127.0.0.1", s.grpc_port))
                    break
                except OSError:
                    assert time.monotonic() < end, "the sidecar's port stayed bound"
                    time.sleep(0.01)
            taker.listen()
            assert s.proc.wait(60) == 1
        log = open(s.log).read()
        assert f"inference-server: --grpc-port {s.grpc_port} was taken by another process" in log, log[-3000:]
        assert log.count("cannot serve gRPC") == 1, log[-3000:]  # stopped, not restarted again
    # The master's children end on their own once it is gone (the engine on its parent-death
    # signal, after its shutdown): within seconds, not at once (one was still running in a run).
    end = time.monotonic() + 20
    while [pid for pid in children if _running(pid)] and time.monotonic() < end:
        time.sleep(0.1)
    assert not [pid for pid in children if _running(pid)]


def test_the_grpc_port_check_leaves_other_faults_to_the_binds():
    """The same port for HTTP and gRPC is a configuration error (the check runs before the HTTP
    bind, so it would not see it); a host that does not resolve is left to the HTTP bind."""
    from engine.config import ConfigError
    from server.config import ServerConfig
    from server.grpc.keeper import check_port

    with pytest.raises(ConfigError, match="--grpc-port must differ from --port"):
        ServerConfig(port=18080, grpc_port=18080)
    check_port("no-such-host.invalid", 50051)


def _ipv6_loopback() -> bool:
    import socket
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_an_ipv6_host_serves_http_and_grpc_and_its_grpc_port_is_checked():
    """``--host ::1`` (or ``[::1]``, as a URL writes it): gunicorn and gRPC bind ``[::1]:port``
    (``ServerConfig.address``; ``::1:8080`` was a gunicorn error), and a used gRPC port on that
    address stops the start (the check did not resolve ``[::1]``, so it let it through)."""
    from engine.config import ConfigError
    from server.config import ServerConfig
    from server.grpc.keeper import check_port

    config = ServerConfig(host="[::1]", port=8080, grpc_port=50051)
    assert (config.host, config.address(8080)) == ("::1", "[::1]:8080")
    assert ServerConfig(host="127.0.0.1").address(9) == "127.0.0.1:9"
    for host in ("[::1", " ", "1::2::3", "gggg::1", "127.0.0.1:8080", "not a host", "-x.example"):
        with pytest.raises(ConfigError, match="--host"):  # gunicorn retried each 5 s, or bound every address
            ServerConfig(host=host)
    with running_server("--max-slots", "1", "--max-seq-len", "128", "--workers", "1", grpc=True,
                        host="::1") as server:
        assert get(server, "/health", timeout=10).status == 200
        channel = open_channel(server.grpc_port, "::1")
        wait_serving(channel)
        channel.close()
        with pytest.raises(ConfigError, match=f"--grpc-port {server.grpc_port} is in use on ::1"):
            check_port(ServerConfig(host="[::1]").host, server.grpc_port)  # as the master passes it


def test_the_sidecar_does_not_share_its_port(model_path):
    """The sidecar's own server, built on a port another socket holds with ``SO_REUSEPORT``, fails
    to bind (:func:`server.grpc.server.options` turns gRPC's default ``SO_REUSEPORT`` off): a port
    taken after the master's check is a restart in the log, never calls answered elsewhere."""
    from server.config import ServerConfig
    from server.model_router import ModelRouter
    from server.grpc.server import build
    from server.tenancy.tenants import TenantRegistry, Tenants
    from shm import Transport

    with _listener_sharing_its_port() as port:
        config = ServerConfig(model_path=model_path, max_slots=1, max_seq_len=256, grpc_port=port)
        transport = Transport.create(config.engine_config().layout())
        models = ModelRouter.attach(config, [transport.name], None)
        try:
            with pytest.raises(RuntimeError):
                build(config, models, TenantRegistry(Tenants.load(None)))
        finally:
            models.close()
            transport.close()


def test_readme_python_client_example(small_server):
    """The Python client example of docs/grpc.md (once the README's) runs."""
    from tests.support.docs import blocks

    (code,) = [b.code for b in blocks(ROOT / "docs/grpc.md")
               if b.lang == "python" and "InferenceServiceStub" in b.code]
    server, _, _ = small_server
    out = subprocess.run([sys.executable, "-c", code.replace("127.0.0.1:50051", f"127.0.0.1:{server.grpc_port}")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    server.wait_idle()


def test_stopping_the_server_stops_the_sidecar():
    server = running_server("--max-slots", "1", "--max-seq-len", "256", "--workers", "1", grpc=True)
    with server as s:
        pid = s.sidecar_pid()
        assert pid is not None
        wait_serving(open_channel(s.grpc_port))
    end = time.monotonic() + 10
    while _running(pid):
        assert time.monotonic() < end, "the sidecar outlived the server"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
