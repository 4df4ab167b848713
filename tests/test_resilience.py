"""Crashes lose nothing: a dead engine fails its requests and comes back; a dead worker's
mailboxes are reclaimed. Real processes, real SIGKILL."""
from __future__ import annotations

import http.client
import json
import os
import signal
import time

import pytest

from engine.client import EngineUnavailable, SamplingParams
from shm import MailboxState
from tests.conftest import assert_idle_and_clean, kill_engine_mid_stream, running_engine, running_server


def test_engine_crash_fails_in_flight_requests_and_restarts():
    with running_engine(max_slots=2) as (client, supervisor):
        long_params = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)
        kill_engine_mid_stream(client, supervisor, [40, 41, 42], long_params)
        assert supervisor.restarts == 1
        with client.submit([40, 41, 42], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)) as s:
            assert len(list(s)) == 4
        assert_idle_and_clean(client)


def test_stalled_engine_is_killed_and_replaced():
    """SIGSTOP: the engine is alive but makes no step. Health says so, and the supervisor's
    watchdog kills it, failing its requests, then a new engine serves."""
    with running_engine(max_slots=1, supervisor_args={"stall_s": 1.0}) as (client, supervisor):
        stream = client.submit([50, 51], SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True))
        it = iter(stream)
        next(it)
        pid = client.t.control.engine_pid
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(0.3)  # no step can happen meanwhile: the heartbeat is at least this old
            assert not client.ready(stall_s=0.25)
            with pytest.raises(EngineUnavailable):
                list(it)
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert supervisor.wait_ready(120) and client.ready()
        with client.submit([50, 51], SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True)) as s:
            assert len(list(s)) == 3
        assert_idle_and_clean(client)


def test_killed_worker_leases_are_reclaimed_and_its_slot_freed():
    with running_server("--max-slots", "2", "--max-seq-len", "512", "--workers", "2", "--threads", "4") as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 400,
                "ignore_eos": True, "stream": True, "temperature": 0}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.readline()  # the stream has started: its mailbox is leased and its slot busy
        boxes = server.engine.t.mailboxes.boxes
        leased = [i for i in range(len(boxes)) if int(boxes["state"][i]) != MailboxState.FREE]
        assert len(leased) == 1
        os.kill(int(boxes["owner_pid"][leased[0]]), signal.SIGKILL)
        server.wait_idle(timeout=30)
        conn.close()
        # The server still answers (gunicorn started a new worker).
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        deadline = time.monotonic() + 30
        while True:
            try:
                conn.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}),
                             {"Content-Type": "application/json"})
                assert conn.getresponse().status == 200
                break
            except (ConnectionError, http.client.HTTPException):
                assert time.monotonic() < deadline
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.close()


def test_engine_killed_under_gunicorn_fails_requests_then_comes_back():
    """gunicorn's master reaps every child, the engine included: the restart must not depend
    on the engine's exit status."""
    with running_server("--max-slots", "2", "--max-seq-len", "512", "--workers", "1", "--threads", "4") as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 400,
                "ignore_eos": True, "temperature": 0}
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        deadline = time.monotonic() + 30
        while all(m == -1 for m in server.engine.slot_mailboxes()):  # until it runs
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(server.engine.t.control.engine_pid, signal.SIGKILL)
        resp = conn.getresponse()
        reply = json.loads(resp.read())
        assert resp.status == 503 and reply["error"]["code"] == "engine_unavailable"
        assert resp.getheader("Retry-After")
        conn.close()
        server._wait_healthy(timeout=60)  # a new engine loaded
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2}),
                     {"Content-Type": "application/json"})
        assert conn.getresponse().status == 200
        conn.close()
        server.wait_idle()
