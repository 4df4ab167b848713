"""SIGTERM drains: readiness turns 503 at once, new requests are refused with 503, running
streams finish (or, past ``--drain-timeout`` or at a second SIGTERM, end with an error event and
``[DONE]``), and the server exits 0 leaving nothing in /dev/shm. A real server, real streams."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.http import COMPLETIONS, get, open_stream, post
from tests.support.servers import running_server


def stream(server, max_tokens: int, out: list, started: threading.Event | None = None) -> None:
    """One streaming completion; appends ``(events, done)``: the parsed data events and whether
    ``[DONE]`` came last."""
    events, done = [], False
    with open_stream(server, COMPLETIONS, {"prompt": "Tell a story", "max_tokens": max_tokens, "ignore_eos": True,
                                           "stream": True}) as response:
        for line in response:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                done = True
                break
            events.append(json.loads(line[6:]))
            if started is not None and len(events) == 1:
                started.set()
    out.append((events, done))


def health(server, path: str = "/health") -> int:
    return get(server, path, timeout=10).status


def start_streams(server, n: int, max_tokens: int) -> tuple[list, list[threading.Thread]]:
    results, threads, started = [], [], []
    for _ in range(n):
        ev = threading.Event()
        t = threading.Thread(target=stream, args=(server, max_tokens, results, ev))
        t.start()
        threads.append(t)
        started.append(ev)
    for ev in started:
        assert ev.wait(120), "a stream did not start"
    return results, threads


def leftovers(server) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith(server.shm)]


def test_sigterm_drains_running_streams_to_their_end():
    with running_server("--max-slots", "8", "--max-seq-len", "256", "--threads", "16", "--drain-timeout", "120",
                        grpc=True) as server:
        results, threads = start_streams(server, 8, 120)
        server.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        while health(server, "/health/ready") != 503:
            assert time.monotonic() - t0 < 5
        readiness_s = time.monotonic() - t0
        status, headers, body = post(server, COMPLETIONS, {"prompt": "new", "max_tokens": 2}).parsed()
        assert status == 503 and body["error"]["code"] == "server_shutting_down" and headers["retry-after"]
        assert health(server) == 503
        assert health(server, "/health/live") == 200
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            deadline = time.monotonic() + 5
            not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
            while check(health_pb2.HealthCheckRequest(), timeout=5).status != not_serving:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        for t in threads:
            t.join(120)
        assert server.proc.wait(60) == 0
        assert len(results) == 8
        for events, done in results:
            assert done and events[-1]["choices"][0]["finish_reason"] == "length"
            assert sum(1 for e in events if e["choices"] and e["choices"][0]["text"]) > 80
        assert not leftovers(server)
    assert readiness_s < 0.1, readiness_s  # measured once: the master handles SIGTERM at once


def test_drain_timeout_ends_what_still_runs_with_an_error_and_done():
    with running_server("--max-slots", "4", "--max-seq-len", "512", "--drain-timeout", "1") as server:
        results, threads = start_streams(server, 3, 450)
        plain: list = []
        waiter = threading.Thread(target=lambda: plain.append(
            post(server, COMPLETIONS, {"prompt": "Go", "max_tokens": 450, "ignore_eos": True}).parsed()))
        waiter.start()
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        for t in (*threads, waiter):
            t.join(60)
        assert server.proc.wait(60) == 0
        for events, done in results:
            assert done, "no [DONE] after the error event"
            assert events[-1]["error"]["code"] == "server_shutting_down"
            assert events[-1]["error"]["type"] == "server_error"
        (status, _, body), = plain
        assert status == 503 and body["error"]["code"] == "server_shutting_down"
        assert not leftovers(server)


def test_a_second_sigterm_ends_the_drain_now_and_a_third_stops_at_once():
    """The second SIGTERM ends what still streams as the drain's timeout would (an error event,
    then ``[DONE]``), not cut; a third halts at once, whatever still runs."""
    with running_server("--max-slots", "2", "--max-seq-len", "512", "--drain-timeout", "600") as server:
        results, threads = start_streams(server, 2, 480)
        server.proc.send_signal(signal.SIGTERM)
        while health(server, "/health/ready") != 503:
            time.sleep(0.01)
        assert server.proc.poll() is None  # draining: the streams still run
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0  # END_WRITES_S at most, not 600
        for t in threads:
            t.join(30)
        assert len(results) == 2
        for events, done in results:
            assert done and events[-1]["error"]["code"] == "server_shutting_down", events[-1:]
        assert not leftovers(server)
    with running_server("--max-slots", "2", "--max-seq-len", "512", "--drain-timeout", "600") as server:
        results, threads = start_streams(server, 1, 480)
        for _ in range(3):
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
        server.proc.wait(30)  # gunicorn's own stop: workers get graceful_timeout (5 s), not 600
        threads[0].join(30)
        assert not leftovers(server)


def test_a_sidecar_that_got_the_sigterm_too_is_not_restarted_during_the_drain():
    """A signal to the whole process group (systemd's ``KillMode=control-group``) reaches the gRPC
    sidecar with the master's: it drains its own calls and exits while the master still drains
    HTTP streams. The master does not start it again for a drain that refuses new calls anyway,
    and says so without an error."""
    with running_server("--max-slots", "2", "--max-seq-len", "256", "--drain-timeout", "120", grpc=True) as server:
        results, threads = start_streams(server, 1, 200)
        os.kill(server.sidecar_pid(), signal.SIGTERM)
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert server.proc.wait(60) == 0
        (events, done), = results
        assert done and events[-1]["choices"][0]["finish_reason"] == "length"
        log = open(server.log).read()
        assert "while the server drains; not restarted" in log, log[-3000:]
        assert "restarted after" not in log, log[-3000:]
        assert not leftovers(server)


def test_no_worker_is_booted_during_the_drain():
    """Workers that got the SIGTERM with the master (a signal to the process group) exit, the
    idle at once, the busy after gunicorn's ``graceful_timeout``; none is replaced while the
    master drains, and the master stops with 0."""
    with running_server("--max-slots", "2", "--max-seq-len", "512", "--drain-timeout", "120") as server:
        _, threads = start_streams(server, 1, 120)
        workers = server.worker_pids()
        server.proc.send_signal(signal.SIGTERM)
        while health(server, "/health/ready") != 503:
            time.sleep(0.01)
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
        assert server.proc.wait(60) == 0
        for t in threads:
            t.join(60)
        booted = open(server.log).read().count("Booting worker")
        assert booted == len(workers) == 2, open(server.log).read()[-3000:]
        assert not leftovers(server)
