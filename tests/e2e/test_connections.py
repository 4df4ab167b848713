"""Connection-level behaviour under hostile or heavy load (``server.http.worker``, ``server.http.middleware.Admission``,
the front-end thread sizing): every common client reads its 413, slow request heads hold no
thread, and overload is refused at once with 503 + ``Retry-After``, nothing lost."""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time

import pytest

from bench.overload import run as overload
from server.config import ServerConfig
from server.http.body import BODY_GAP_S, read_bounded
from server.http.worker import HEADER_TIMEOUT_S
from tests.support.http import get
from tests.support.servers import running_server

CHAT = "/v1/chat/completions"


def _send_whole_body_then_read(port: int, size: int) -> tuple[int, dict]:
    """What Python's ``http.client`` (and SDK transports built like it) does: write the whole
    body, then read the answer. Raises ConnectionError if the server reset the connection."""
    body = b'{"max_tokens":4,"messages":[{"role":"user","content":"' + b"a" * size + b'"}]}'
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", CHAT, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_a_client_that_writes_a_24_mb_body_first_reads_the_413(server):
    status, body = _send_whole_body_then_read(server.port, 24_000_000)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    status, _ = _send_whole_body_then_read(server.port, 1000)
    assert status == 200
    server.wait_idle()


def test_what_is_discarded_is_bounded():
    """Beyond ``--max-discard-bytes`` the server stops reading and closes: the client may see
    a reset, and the worker is not held."""
    with running_server("--workers", "1", "--max-slots", "2", "--max-queued", "2", "--max-seq-len", "1024",
                        "--max-discard-bytes", str(4 << 20)) as s:
        assert _send_whole_body_then_read(s.port, 3_000_000)[0] == 413  # within the bound
        with pytest.raises(ConnectionError):
            _send_whole_body_then_read(s.port, 24_000_000)
        assert _send_whole_body_then_read(s.port, 1000)[0] == 200


def _open_slow_heads(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: slow\r\nX-Slow: ")
        socks.append(s)
    return socks


def test_incomplete_request_heads_hold_no_thread(server):
    """More slow clients than threads in all workers (2 x 16 here): each sent part of a head
    and waits. Stock gthread gives each a thread until its head completes, so these would deny
    service; here requests still get answers, and a slow head that completes is served."""
    socks = _open_slow_heads(server.port, 3 * 2 * 16)
    try:
        time.sleep(0.5)
        assert get(server, "/health/live").status == 200
        assert get(server, "/v1/models").status == 200
        slow = socks.pop()
        slow.sendall(b"1\r\nContent-Length: 0\r\n")  # the rest of its head, in two writes
        time.sleep(0.2)
        slow.sendall(b"\r\n")
        assert slow.recv(4096).startswith(b"HTTP/1.1 4")  # an answer (its empty body is a 4xx)
        slow.close()
    finally:
        for s in socks:
            s.close()


def test_heads_that_never_complete_are_closed_with_408_and_hold_no_one_up(server):
    """Ten clients send a header byte every 0.5 s (never idle long enough for keepalive's 5 s).
    Each gets 408 once its head is ``HEADER_TIMEOUT_S`` late, and the other connections are
    served meanwhile: gthread's graceful close read from each for 2 s
    on the worker's main thread, and 20 such clients held /health/live for 34 s."""
    socks = _open_slow_heads(server.port, 10)
    answers: dict[int, bytes] = {}
    worst = 0.0
    try:
        end = time.monotonic() + HEADER_TIMEOUT_S + 15
        while len(answers) < len(socks) and time.monotonic() < end:
            for i, s in enumerate(socks):
                if i in answers:
                    continue
                s.settimeout(0.01)
                try:
                    answers[i] = s.recv(4096)
                except socket.timeout:
                    s.sendall(b"x")
            start = time.monotonic()
            assert get(server, "/health/live").status == 200
            worst = max(worst, time.monotonic() - start)
            time.sleep(0.5)
        assert sorted(answers) == list(range(len(socks))) and all(a.startswith(b"HTTP/1.1 408")
                                                                 for a in answers.values()), answers
        assert worst < 1.5, worst
    finally:
        for s in socks:
            s.close()


def test_a_stalled_body_is_answered_408_and_frees_its_thread(server):
    """Clients that send a request head and part of its body, then nothing: each held a worker
    thread for good (a few hundred took every thread, /health/live included). Each is now
    answered 408 ``request_timeout`` and closed once its body stalled ``BODY_GAP_S``, and the
    server answers meanwhile and after."""
    socks = []
    for _ in range(8):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=BODY_GAP_S + 20)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"messages\":")
        socks.append(s)
    try:
        start = time.monotonic()
        assert get(server, "/health/live").status == 200
        for s in socks:
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
                part = s.recv(4096)
                if not part:
                    break
                answer += part
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), answer
            assert json.loads(body)["error"]["code"] == "request_timeout"
            assert s.recv(4096) == b""  # closed
        # all at once: none waited for another's close (gthread's graceful close, 2 s each)
        assert BODY_GAP_S - 1 < time.monotonic() - start < BODY_GAP_S + 5
        assert get(server, "/v1/models").status == 200
    finally:
        for s in socks:
            s.close()
    server.wait_idle()


def test_a_trickled_body_times_out_in_all():
    """A byte every 0.1 s never leaves a 1 s gap, and the reader asked for more keeps reading
    (gunicorn's does: a 46-byte body trickled over 90 s was read whole); the
    bound in all cuts it off from outside. Then the gap bound, and a body that comes."""
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        (a, b), (c, d), (e, f) = pairs

        class Trickle:  # a reader that reads on until it has all it was asked for
            def __init__(self, sock, peer):
                self.sock, self.peer = sock, peer

            def read(self, n):
                got = b""
                while len(got) < n:
                    try:
                        self.peer.sendall(b"x")
                    except BrokenPipeError:  # a socketpair's read side was shut
                        pass
                    time.sleep(0.1)
                    part = self.sock.recv(n - len(got))
                    if not part:
                        break
                    got += part
                return got
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            read_bounded(Trickle(a, b), a, 1000, gap_s=1.0, total_s=0.5)
        assert time.monotonic() - start < 1.5
        assert a.gettimeout() is None  # the socket blocks again
        d.sendall(b"abc")
        assert read_bounded(c.makefile("rb", buffering=0), c, 3, gap_s=1.0, total_s=5.0) == b"abc"
        with pytest.raises(TimeoutError):  # nothing comes: the gap bound
            read_bounded(e.makefile("rb", buffering=0), e, 10, gap_s=0.2, total_s=5.0)
    finally:
        for x, y in pairs:
            x.close()
            y.close()


def test_ten_times_more_requests_than_slots_and_queue():
    """Every request is answered 200 or 503 with ``Retry-After``; the refusals come before any
    served request could finish (none waited for another); no served request waited unseen
    for another to finish; the server is clean and healthy afterwards."""
    flags = ("--workers", "2", "--max-slots", "2", "--max-queued", "4", "--max-seq-len", "256")
    config = ServerConfig(workers=2, max_slots=2, max_queued=4, max_seq_len=256)
    capacity = config.max_slots + config.max_queued
    with running_server(*flags) as s:
        result = overload(s, 10 * capacity, max_tokens=48, ramp_s=0.5, slots=config.max_slots)
        assert get(s, "/health").status == 200
    assert set(result["statuses"]) <= {"200", "503"}, result
    assert result["statuses"]["200"] >= capacity and result["statuses"]["503"] >= 9 * capacity - capacity
    assert result["refused_without_retry_after"] == 0 and not result["errors"]
    assert result["served_logged"] == result["served"]
    assert result["time_to_503_ms"]["max"] / 1000 < result["shortest_200_s"], result
    assert result["unseen_wait_ms"]["max"] / 1000 < result["shortest_200_s"], result
    assert result["mailboxes_in_use_after"] == 0
    # every worker could hold every request the engine admits at once
    assert config.front_end_threads >= capacity
    assert all(w["threads"] <= config.front_end_threads + 4 for w in result["workers_at_peak"])


def test_a_burst_of_connections_is_all_answered(server):
    """A burst from one client: every connection gets a complete answer (no reset, no hang)."""
    async def probe(i):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /health/live HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n")
        data = await reader.read()
        writer.close()
        return data.split(b" ", 2)[1]

    async def burst():
        return await asyncio.gather(*(probe(i) for i in range(400)))
    assert set(asyncio.run(burst())) == {b"200"}
