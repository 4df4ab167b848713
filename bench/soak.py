"""Soak: mixed traffic against a real server for minutes, with one engine and one worker
SIGKILL, then a check for leaks.

    python -m bench.soak --minutes M [--clients 10] [--warmup-s 15] [--max-rss-growth 0.10] [--json out.json]

Starts a real ``inference-server`` (gunicorn master, workers, engine, gRPC sidecar) with a tenant
file, fills every KV slot once (a priming burst), then runs ``--clients`` client threads for
``--minutes``. Each thread picks one request at a time at random from a mix (the first clients' first
request is fixed, :data:`FIRST`, so every run holds the outcomes the test requires):

* valid: chat and legacy completions, streamed and not, over HTTP, and chat over gRPC, unary and
  streamed; ``max_tokens`` 8-48, short and long prompts (some repeated, for the prefix cache);
* client disconnects: closed before the response, in the middle of a stream, in the middle of the
  request body, a gRPC stream cancelled;
* invalid requests: bad JSON, bad fields, a prompt over the sequence limit, unknown model and
  route, wrong content type, a body over ``--max-body-bytes``, no key, an unknown key (4xx);
* over quota: a tenant allowed one request per 100 s (429 mostly);

and at 1/3 of the run SIGKILLs the engine (the supervisor starts a new one), at 2/3 one gunicorn
worker (one with a request in flight when there is one; gunicorn forks a new one).

Every request ends in one kind: ``ok``; an expected refusal (``client_error_<status>`` for a
request built to be refused so, ``rate_limited_429`` for the tiny tenant, ``503_saturated``);
``503_engine_restarting`` (a 503, SSE error event or gRPC ``UNAVAILABLE`` with code
``engine_unavailable`` while the engine was down: from its kill until 2 s after the new one was
ready); ``worker_killed`` (a connection cut by the worker kill, the request was in flight then);
``client_disconnect`` (ours); and everything else is ``unexpected_*`` (a 5xx outside those
windows, a status other than the one the request was built for, a connection error nobody caused,
a stream without ``[DONE]``, no answer within 60 s).

The RSS of every process (``/proc/<pid>/status`` ``VmRSS``; master, each worker, engine,
sidecar, multiprocessing's resource tracker) is sampled every second (the server's prefix cache
is 1,024 tokens: its cells are engine memory, which grows until the cache is full). A process's start value is
its first sample ``--warmup-s`` seconds after the traffic began or after it appeared (a restarted
engine, a replacement worker: compared from its own first sample after its own warm-up); its
end value is its last sample (after the traffic, the server idle; a killed process: its last
before the kill). At the end: the engine's mailboxes and slots in use (read from the shared
memory, after waiting up to 30 s for idle), the workers and engine still there; then SIGTERM, and
the ``/dev/shm`` entries of this server (its segment, the segment's ``.d`` folder, its metrics
directory, anything else new named after the segment) still there, and its processes still alive.

Passes (exit 0) when no request ended unexpectedly, every kind of check above is clean (no
mailbox or slot in use, no ``/dev/shm`` entry or process left, the master exited 0) and no
process's RSS grew by more than ``--max-rss-growth`` (0.10: 10 %). Exit 1 otherwise; the summary
and ``--json`` say why.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from tests.support.servers import cmdline, is_sidecar

SHM = "/dev/shm"
TIMEOUT_S = 60.0  # a request with no answer for this long is a hang
ENGINE_GRACE_S = 2.0  # after the new engine is ready, 503 engine_unavailable is still expected this long
WORKER_SKEW_S = 0.5  # a request started this soon after the worker kill may still have reached that worker
MAIN_KEY, TINY_KEY = "soak-main-key", "soak-tiny-key"
TENANTS = {"tenants": [
    {"id": "main", "api_keys": [MAIN_KEY]},
    # One request, then one per 100 s: over quota nearly always, however slow the machine.
    {"id": "tiny", "api_keys": [TINY_KEY], "requests_per_second": {"rate": 0.01, "burst": 1}},
]}
WORDS = ("the sea wind stars a ship sails north under grey skies while the crew sings of home and "
         "distant harbours lanterns swing ropes creak gulls cry over cold water").split()

#: (request kind, weight, status the request is built for: 200 valid, 0 our own disconnect)
MIX = [
    ("chat", 12, 200), ("chat_stream", 12, 200), ("completion", 8, 200), ("completion_stream", 8, 200),
    ("grpc_chat", 4, 200), ("grpc_chat_stream", 4, 200),
    ("disconnect_before_response", 5, 0), ("disconnect_mid_stream", 5, 0), ("disconnect_mid_body", 2, 0),
    ("grpc_cancel_mid_stream", 2, 0),
    ("bad_json", 2, 400), ("bad_field", 3, 400), ("prompt_too_long", 1, 400), ("unknown_model", 1, 404),
    ("unknown_route", 1, 404), ("wrong_content_type", 1, 415), ("body_too_large", 1, 413),
    ("no_key", 1, 401), ("unknown_key", 1, 401),
    ("over_quota", 5, 429),
]
EXPECTED = {kind: status for kind, _, status in MIX}
#: The first request of the first clients: every run has the outcomes the soak must see, however
#: few requests a slow machine gets through (two over quota: at least one is a 429).
FIRST = ["over_quota", "over_quota", "disconnect_mid_stream", "bad_json"]


# -- the record of one request ---------------------------------------------------------------------
class Result:
    """What one request ended with, before classification: ``raw`` is ``ok``, ``status``
    (an HTTP status or its gRPC equivalent, with the error ``code``), ``stream_error`` (an SSE
    error event or a gRPC error after chunks, with ``code``), ``disconnect`` (ours),
    ``conn_error``, ``timeout`` or ``bad_response``; ``detail`` says more."""

    __slots__ = ("kind", "start", "end", "raw", "status", "code", "detail")

    def __init__(self, kind: str, start: float):
        self.kind, self.start, self.end = kind, start, start
        self.raw, self.status, self.code, self.detail = "ok", 200, None, ""

    def set(self, raw: str, status: int | None = None, code: str | None = None, detail: str = "") -> "Result":
        self.raw, self.status, self.code, self.detail = raw, status, code, detail
        return self


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


# Prompts reused across requests, so the prefix cache both hits and evicts.
SHARED = [_text(random.Random(i), n) for i, n in enumerate((6, 20, 60, 120, 160))]


def _prompt(rng: random.Random) -> str:
    """Short or long (up to about 230 tokens: with the template and 48 generated tokens that
    stays under the 384-token sequence); a shared prefix half of the time."""
    if rng.random() < 0.5:
        return rng.choice(SHARED) + " " + _text(rng, rng.randint(0, 8))
    return _text(rng, rng.choice((4, 12, 40, 90, 160)))


def _params(rng: random.Random) -> dict:
    return {"max_tokens": rng.randint(8, 48), "temperature": rng.choice((0, 0.7, 1.0)),
            "ignore_eos": rng.random() < 0.5, "seed": rng.randint(0, 1000)}


def _headers(key: str | None = MAIN_KEY, content_type: str = "application/json") -> dict:
    headers = {"Content-Type": content_type}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return headers


# -- HTTP ------------------------------------------------------------------------------------------
def _error_code(body: bytes) -> str | None:
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _read_stream(resp, r: Result, stop_after: int | None = None) -> Result:
    """Read SSE events to ``[DONE]``; with ``stop_after``, stop reading after that many events
    (the caller then hangs up)."""
    events = 0
    for line in resp:
        if not line.startswith(b"data: "):
            continue
        if line.strip() == b"data: [DONE]":
            return r if r.raw != "ok" else r.set("ok", 200)
        events += 1
        if b'"error"' in line[:16]:  # an error event: {"error": {...}}
            r.set("stream_error", 200, _error_code(line[6:]), line[6:200].decode(errors="replace"))
        if stop_after is not None and events >= stop_after:
            return r.set("disconnect", detail=f"after {events} events")
    return r.set("bad_response", 200, detail=f"stream ended without [DONE] after {events} events")


def _http(port: int, r: Result, method: str, path: str, body: bytes | None, headers: dict, *,
          stream: bool = False, stop_after: int | None = None, hang_up_after: float | None = None) -> Result:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request(method, path, body, headers)
        if hang_up_after is not None:  # ours: gone before the answer
            time.sleep(hang_up_after)
            return r.set("disconnect", detail=f"{hang_up_after:.2f} s after sending")
        resp = conn.getresponse()
        if resp.status != 200:
            data = resp.read()
            return r.set("status", resp.status, _error_code(data), data[:200].decode(errors="replace"))
        if stream:
            return _read_stream(resp, r, stop_after)
        data = resp.read()
        try:
            json.loads(data)["choices"]
        except (ValueError, KeyError, TypeError):
            return r.set("bad_response", 200, detail=data[:200].decode(errors="replace"))
        return r.set("ok", 200)
    except (TimeoutError, socket.timeout):
        return r.set("timeout", detail=f"no answer within {TIMEOUT_S:.0f} s")
    except (OSError, http.client.HTTPException) as e:
        return r.set("conn_error", detail=f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def _chat_body(rng: random.Random, stream: bool, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": _prompt(rng)}], **_params(rng), **extra}
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return body


def _completion_body(rng: random.Random, stream: bool) -> dict:
    body = {"prompt": _prompt(rng), **_params(rng)}
    if stream:
        body["stream"] = True
    return body


def _mid_body(port: int, r: Result, rng: random.Random) -> Result:
    """Headers and part of the body, then gone."""
    body = json.dumps(_chat_body(rng, False)).encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as s:
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
                      f"Authorization: Bearer {MAIN_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                      + body[:rng.randint(0, len(body) - 1)])
            time.sleep(rng.uniform(0, 0.2))
    except OSError as e:
        return r.set("conn_error", detail=f"{type(e).__name__}: {e}")
    return r.set("disconnect", detail="mid body")


# -- gRPC ------------------------------------------------------------------------------------------
_GRPC_STATUS = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
                "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "INTERNAL": 500}


def _grpc(stub, r: Result, rng: random.Random, stream: bool, cancel_after: int | None = None) -> Result:
    import grpc

    from proto import inference_pb2 as pb

    p = _params(rng)
    request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=_prompt(rng))], max_tokens=p["max_tokens"],
                             temperature=p["temperature"], ignore_eos=p["ignore_eos"], seed=p["seed"])
    metadata = (("authorization", f"Bearer {MAIN_KEY}"),)
    chunks = 0
    try:
        if not stream:
            reply = stub.ChatComplete(request, metadata=metadata, timeout=TIMEOUT_S)
            return r.set("ok", 200) if reply.choices else r.set("bad_response", 200, detail="no choices")
        call = stub.ChatCompleteStream(request, metadata=metadata, timeout=TIMEOUT_S)
        for chunk in call:
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                call.cancel()
                return r.set("disconnect", detail=f"cancelled after {chunks} chunks")
        return r.set("ok", 200)
    except grpc.RpcError as e:
        name = e.code().name
        if name == "DEADLINE_EXCEEDED":
            return r.set("timeout", detail=f"gRPC deadline of {TIMEOUT_S:.0f} s")
        if name == "CANCELLED" and cancel_after is not None:
            return r.set("disconnect", detail="cancelled")
        code = dict(e.trailing_metadata() or ()).get("code")
        status = _GRPC_STATUS.get(name)
        if status is None:
            return r.set("conn_error", detail=f"gRPC {name}: {e.details()}")
        return r.set("stream_error" if chunks else "status", status, code, f"gRPC {name}: {e.details()}")


# -- one request of each kind ----------------------------------------------------------------------
def one_request(kind: str, port: int, stub, rng: random.Random, t0: float) -> Result:
    """Send one request of ``kind`` (see :data:`MIX`) and return how it ended."""
    r = Result(kind, time.monotonic() - t0)
    post = "POST"
    if kind in ("chat", "chat_stream"):
        stream = kind == "chat_stream"
        _http(port, r, post, "/v1/chat/completions", json.dumps(_chat_body(rng, stream)).encode(), _headers(),
              stream=stream)
    elif kind in ("completion", "completion_stream"):
        stream = kind == "completion_stream"
        _http(port, r, post, "/v1/completions", json.dumps(_completion_body(rng, stream)).encode(), _headers(),
              stream=stream)
    elif kind in ("grpc_chat", "grpc_chat_stream"):
        _grpc(stub, r, rng, kind == "grpc_chat_stream")
    elif kind == "grpc_cancel_mid_stream":
        _grpc(stub, r, rng, True, cancel_after=rng.randint(1, 4))
    elif kind == "disconnect_before_response":
        stream = rng.random() < 0.5
        _http(port, r, post, "/v1/chat/completions", json.dumps(_chat_body(rng, stream)).encode(), _headers(),
              hang_up_after=rng.uniform(0, 0.3))
    elif kind == "disconnect_mid_stream":
        body = _chat_body(rng, True, max_tokens=48, ignore_eos=True)
        _http(port, r, post, "/v1/chat/completions", json.dumps(body).encode(), _headers(), stream=True,
              stop_after=rng.randint(1, 20))
    elif kind == "disconnect_mid_body":
        _mid_body(port, r, rng)
    elif kind == "bad_json":
        _http(port, r, post, "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"', _headers())
    elif kind == "bad_field":
        field = rng.choice(({"max_tokens": -5}, {"temperature": "hot"}, {"messages": "hi"}, {"n": 0},
                            {"top_p": 7}))
        _http(port, r, post, "/v1/chat/completions", json.dumps({**_chat_body(rng, False), **field}).encode(),
              _headers())
    elif kind == "prompt_too_long":
        _http(port, r, post, "/v1/completions", json.dumps({"prompt": _text(rng, 2000), "max_tokens": 8}).encode(),
              _headers())
    elif kind == "unknown_model":
        _http(port, r, post, "/v1/chat/completions", json.dumps(_chat_body(rng, False, model="gpt-17")).encode(),
              _headers())
    elif kind == "unknown_route":
        _http(port, r, "GET", "/v1/nothing-here", None, _headers())
    elif kind == "wrong_content_type":
        _http(port, r, post, "/v1/chat/completions", json.dumps(_chat_body(rng, False)).encode(),
              _headers(content_type="text/plain"))
    elif kind == "body_too_large":
        _http(port, r, post, "/v1/completions", json.dumps({"prompt": "x" * 70_000}).encode(), _headers())
    elif kind == "no_key":
        _http(port, r, post, "/v1/chat/completions", json.dumps(_chat_body(rng, False)).encode(), _headers(None))
    elif kind == "unknown_key":
        _http(port, r, post, "/v1/chat/completions", json.dumps(_chat_body(rng, False)).encode(),
              _headers("not-a-key"))
    elif kind == "over_quota":
        stream = rng.random() < 0.5
        _http(port, r, post, "/v1/chat/completions", json.dumps(_chat_body(rng, stream)).encode(), _headers(TINY_KEY),
              stream=stream)
    else:
        raise ValueError(kind)
    r.end = time.monotonic() - t0
    return r


# -- classification --------------------------------------------------------------------------------
def classify(r: Result, engine_down: list[tuple[float, float]], worker_kills: list[float]) -> str:
    """The kind ``r`` ended in (module docstring); ``engine_down``: (kill, ready + grace)
    intervals; ``worker_kills``: times of the worker kills (seconds from the traffic start)."""
    expected = EXPECTED[r.kind]
    overlaps_engine = any(r.start <= b and r.end >= a for a, b in engine_down)
    in_worker_kill = any(r.start <= k + WORKER_SKEW_S and r.end >= k for k in worker_kills)
    if r.raw == "disconnect":
        return "client_disconnect" if expected == 0 else "unexpected_disconnect"
    # A 503 before the answer began, or the same error as an SSE event / gRPC status after it.
    if (r.raw == "status" and r.status == 503) or r.raw == "stream_error":
        if r.code == "server_overloaded":
            return "503_saturated"
        if r.code == "engine_unavailable" and overlaps_engine:
            return "503_engine_restarting"
        return f"unexpected_503_{r.code}" if r.raw == "status" else f"unexpected_stream_error_{r.code}"
    if r.raw == "conn_error" and in_worker_kill:
        return "worker_killed"
    if r.raw == "bad_response" and in_worker_kill and "without [DONE]" in r.detail:
        return "worker_killed"
    if r.raw in ("conn_error", "bad_response", "timeout"):
        return f"unexpected_{r.raw}"
    if r.raw == "ok":
        # A tiny-tenant request is admitted when its bucket holds a token.
        return "ok" if expected in (200, 429) else f"unexpected_200_for_{r.kind}"
    # r.raw == "status"
    if r.status == expected == 429:
        return "rate_limited_429"
    if r.status == expected:
        return f"client_error_{r.status}"
    return f"unexpected_{r.status}"


# -- processes and memory --------------------------------------------------------------------------
def rss_kb(pid: int) -> int | None:
    """``VmRSS`` of ``pid`` in KiB; None when it is gone (or a zombie, which has none)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def role(pid: int, master_cmdline: bytes) -> str:
    """master's child ``pid`` as worker, engine, sidecar, resource_tracker or other."""
    cmd = cmdline(pid) or b""
    if is_sidecar(pid):  # forked from the master, as the workers are: its command line is the master's
        return "sidecar"
    if cmd == master_cmdline:
        return "worker"
    if b"engine.process" in cmd:
        return "engine"
    if b"resource_tracker" in cmd:
        return "resource_tracker"
    return "other"


class Memory:
    """Samples the RSS of the master and each of its children every ``period`` seconds."""

    def __init__(self, server, t0: float, period: float = 1.0):
        self.server, self.t0, self.period = server, t0, period
        self.master_cmdline = cmdline(server.proc.pid)
        self.procs: dict[int, dict] = {}  # pid -> {"role", "first_seen", "samples": [(t, kb)]}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)

    def sample(self) -> None:
        """One sample of every process of the server now."""
        now = time.monotonic() - self.t0
        try:
            children = self.server.children()
        except OSError:
            children = []
        for pid in [self.server.proc.pid, *children]:
            p = self.procs.setdefault(pid, {"role": None, "cmdline": None, "first_seen": now, "samples": []})
            kb, command = rss_kb(pid), cmdline(pid)
            if kb is None or not command:
                continue
            # Looked at every time: a child between fork and exec still has the master's command
            # line (the engine and the sidecar would pass for workers).
            p["cmdline"] = command
            p["role"] = "master" if pid == self.server.proc.pid else role(pid, self.master_cmdline)
            p["samples"].append((now, kb))

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, warmup_s: float, max_growth: float, alive: set[int]) -> list[dict]:
        """Per process: start (first sample ``warmup_s`` after the traffic began or after it
        appeared), end (its last sample), growth, and whether it is over ``max_growth``."""
        rows = []
        for pid, p in sorted(self.procs.items(), key=lambda kv: (kv[1]["first_seen"], kv[0])):
            if not p["samples"]:
                continue  # gone before its first sample
            after = p["first_seen"] + warmup_s
            baseline = next(((t, kb) for t, kb in p["samples"] if t >= after), None)
            last = p["samples"][-1] if p["samples"] else None
            row = {"pid": pid, "role": p["role"], "first_seen_s": round(p["first_seen"], 1),
                   "alive_at_end": pid in alive, "samples": len(p["samples"]),
                   "peak_kb": max((kb for _, kb in p["samples"]), default=None),
                   # every few seconds, to see whether growth is steady or a step
                   "series": [[round(t, 1), kb] for t, kb in p["samples"][::5] + p["samples"][-1:]]}
            if baseline is None or last is None or last[0] <= baseline[0]:
                row.update(start_kb=None, end_kb=last[1] if last else None, growth=None, judged=False,
                           note="no sample after its warm-up")
            else:
                growth = (last[1] - baseline[1]) / baseline[1]
                row.update(start_s=round(baseline[0], 1), start_kb=baseline[1], end_s=round(last[0], 1),
                           end_kb=last[1], growth=round(growth, 4), judged=True, over=growth > max_growth)
            rows.append(row)
        return rows


# -- the run ---------------------------------------------------------------------------------------
def _metric(url: str, name: str) -> float | None:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return None
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
              or line.startswith(name + "{")]
    return sum(values) if values else None


def _busy(server) -> bool:
    return any(m != -1 for m in server.engine.slot_mailboxes())


def _wait(cond, timeout: float, step: float = 0.05) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()


def kill_engine(server, t0: float, events: list) -> None:
    """SIGKILL the engine while a sequence runs (waiting up to 5 s for one), then wait for the
    new one to be ready."""
    busy = _wait(lambda: _busy(server), 5)
    pid = server.engine.t.control.engine_pid
    at = time.monotonic() - t0
    os.kill(pid, signal.SIGKILL)
    _wait(lambda: server.engine.t.control.engine_pid != pid and server.engine.ready(), 120)
    ready = time.monotonic() - t0
    events.append({"what": "engine_sigkill", "pid": pid, "t": round(at, 2), "ready_t": round(ready, 2),
                   "new_pid": server.engine.t.control.engine_pid, "slot_busy_at_kill": busy})


def kill_worker(server, t0: float, events: list) -> None:
    """SIGKILL a worker that holds a leased mailbox (waiting up to 5 s for one), else any, and
    wait for gunicorn's replacement."""
    from shm import MailboxState

    workers = server.worker_pids()
    boxes = server.engine.t.mailboxes.boxes

    def holder():
        owners = {int(boxes["owner_pid"][i]) for i in range(len(boxes)) if int(boxes["state"][i]) != MailboxState.FREE}
        return next((w for w in workers if w in owners), None)

    _wait(lambda: holder() is not None, 5)
    pid = holder() or random.choice(workers)
    in_flight = pid == holder()
    at = time.monotonic() - t0
    os.kill(pid, signal.SIGKILL)
    replaced = _wait(lambda: len(set(server.worker_pids()) - set(workers)) >= 1, 60)
    events.append({"what": "worker_sigkill", "pid": pid, "t": round(at, 2), "had_request_in_flight": in_flight,
                   "replaced_t": round(time.monotonic() - t0, 2) if replaced else None})


def prime(port: int, slots: int) -> None:
    """Every slot busy at once with a long prompt, so the warm-up has touched all of them."""
    from bench.common import concurrently

    def one(i):
        body = {"prompt": _text(random.Random(i), 160), "max_tokens": 48, "ignore_eos": True, "temperature": 0}
        _http(port, Result("completion", 0), "POST", "/v1/completions", json.dumps(body).encode(), _headers())

    concurrently(slots, one)


def run(a) -> dict:
    """The soak (module docstring); returns the result dictionary (``passed`` among it)."""
    from tests.support.servers import RunningServer

    with tempfile.NamedTemporaryFile("w", prefix="soak-tenants-", suffix=".json") as tenants:
        json.dump(TENANTS, tenants)
        tenants.flush()
        # The engine's KV memory is what its sequences and its prefix cache hold (engine/llama/
        # kv_pages.py): the cache's cells grow until its budget is full. A budget of 1,024 tokens
        # (23 MiB of SmolLM2's cells, a few entries: it evicts often) keeps that growth inside the
        # RSS threshold, which is there for leaks.
        flags = ["--max-slots", str(a.slots), "--max-seq-len", "384", "--prefix-cache-tokens", "1024",
                 "--max-queued", str(a.queued),
                 "--workers", str(a.workers), "--threads", "16", "--max-body-bytes", "65536",
                 "--tenants", tenants.name, "--drain-timeout", "30"]
        shm_before = set(os.listdir(SHM))
        started = time.monotonic()
        server = RunningServer(*flags, grpc=True)
        try:
            print(f"server up in {time.monotonic() - started:.1f} s: port {server.port}, gRPC {server.grpc_port}, "
                  f"shared memory {server.shm}, log {server.log}", flush=True)
            metrics_path = next((line.split()[-1] for line in open(server.log) if "multiprocess directory" in line),
                                None)
            ours = {server.shm, server.shm + ".d"} | ({os.path.basename(metrics_path)} if metrics_path else set())
            ours |= {e for e in set(os.listdir(SHM)) - shm_before if e.startswith(server.shm)}
            res = _traffic(server, a)
        finally:
            if server.proc.poll() is None:  # an error on the way: stop the server anyway
                with contextlib.suppress(AssertionError):
                    server.stop()
    res["server_flags"] = flags
    shm_after = set(os.listdir(SHM))
    res["shm"] = {"ours": sorted(ours), "left_after_shutdown": sorted(e for e in ours if e in shm_after),
                  "other_new_entries_not_counted": sorted(shm_after - shm_before - ours)}
    if res["shm"]["left_after_shutdown"]:
        res["failures"].append(f"/dev/shm entries left after shutdown: {res['shm']['left_after_shutdown']}")
    res["passed"] = not res["failures"]
    return res


def _traffic(server, a) -> dict:
    """Prime, run the traffic and the kills, read the end state, stop the server; the result
    without its ``/dev/shm`` part."""
    import grpc

    from proto import inference_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    grpc.channel_ready_future(channel).result(timeout=60)
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    prime(server.port, a.slots)

    duration = a.minutes * 60
    t0 = time.monotonic()
    memory = Memory(server, t0)
    memory.start()
    results: list[Result] = []
    events: list[dict] = []
    lock = threading.Lock()
    kinds, weights = [k for k, _, _ in MIX], [w for _, w, _ in MIX]

    def client(i: int) -> None:
        crng = random.Random(a.seed * 1000 + i)
        first = FIRST[i:i + 1]
        while time.monotonic() - t0 < duration:
            kind = first.pop() if first else crng.choices(kinds, weights)[0]
            r = one_request(kind, server.port, stub, crng, t0)
            with lock:
                results.append(r)
            if r.status == 503:  # as a client should (Retry-After is 1 s); else 503s crowd out the rest
                time.sleep(crng.uniform(0.2, 1.0))

    def chaos() -> None:
        for at, action in ((duration / 3, kill_engine), (2 * duration / 3, kill_worker)):
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            action(server, t0, events)
            print(f"  {events[-1]}", flush=True)

    threads = [threading.Thread(target=client, args=(i,), name=f"client-{i}") for i in range(a.clients)]
    threads.append(threading.Thread(target=chaos, name="chaos"))
    for t in threads:
        t.start()
    progress = 15.0
    while any(t.is_alive() for t in threads):
        time.sleep(1)
        if progress <= time.monotonic() - t0 < duration:
            print(f"  t={time.monotonic() - t0:5.0f} s: {len(results)} requests", flush=True)
            progress += 15
    traffic_s = time.monotonic() - t0
    channel.close()

    # The end state: idle, nothing held.
    idle = _wait(lambda: server.engine.mailboxes_in_use() == 0 and not _busy(server), 30)
    end_state = {"idle_within_30s": idle, "mailboxes_in_use": server.engine.mailboxes_in_use(),
                 "slots_in_use": sum(m != -1 for m in server.engine.slot_mailboxes()),
                 "slot_mailboxes": server.engine.slot_mailboxes(),
                 "metrics_kv_slot_utilization": _metric(server.url, "inference_kv_slot_utilization"),
                 "metrics_queue_depth": _metric(server.url, "inference_queue_depth"),
                 "workers": len(server.worker_pids()), "engine_ready": server.engine.ready()}
    time.sleep(1)  # one more RSS sample, idle
    memory.stop()
    memory.sample()
    alive = {p for p in memory.procs if rss_kb(p) is not None}

    # Shutdown (SIGTERM: the drain, nothing in flight), and the processes it left.
    server.engine.close()
    server.engine = None
    server.proc.send_signal(signal.SIGTERM)
    try:
        master_exit = server.proc.wait(60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        master_exit = f"killed after 60 s without exiting ({server.proc.wait()})"

    def left() -> list[dict]:  # still running the same program (not a reused pid)
        return [{"pid": pid, "role": p["role"]} for pid, p in sorted(memory.procs.items())
                if p["cmdline"] and cmdline(pid) == p["cmdline"]]

    _wait(lambda: not left(), 10)
    processes_left = left()

    engine_down = [(e["t"], e["ready_t"] + ENGINE_GRACE_S) for e in events if e["what"] == "engine_sigkill"]
    worker_kills = [e["t"] for e in events if e["what"] == "worker_sigkill"]
    outcomes: collections.Counter = collections.Counter()
    by_request: dict = collections.defaultdict(collections.Counter)
    unexpected = []
    for r in results:
        k = classify(r, engine_down, worker_kills)
        outcomes[k] += 1
        by_request[r.kind][k] += 1
        if k.startswith("unexpected"):
            unexpected.append({"kind": r.kind, "outcome": k, "start_s": round(r.start, 2), "end_s": round(r.end, 2),
                               "status": r.status, "code": r.code, "detail": r.detail})
    rss = memory.report(a.warmup_s, a.max_rss_growth, alive)

    failures = []
    if unexpected:
        failures.append(f"{len(unexpected)} unexpected outcomes")
    if len(events) != 2:
        failures.append(f"only {len(events)} of the 2 kills happened")
    if not idle or end_state["mailboxes_in_use"] or end_state["slots_in_use"]:
        failures.append(f"not idle at the end: {end_state['mailboxes_in_use']} mailboxes, "
                        f"{end_state['slots_in_use']} slots in use")
    if end_state["workers"] != a.workers or not end_state["engine_ready"]:
        failures.append(f"at the end: {end_state['workers']} workers, engine ready {end_state['engine_ready']}")
    for row in rss:
        if row.get("over"):
            failures.append(f"RSS of {row['role']} {row['pid']} grew {row['growth']:.1%} "
                            f"({row['start_kb']} -> {row['end_kb']} KiB)")
    if not any(row["role"] == "engine" and row["judged"] and row["alive_at_end"] for row in rss):
        failures.append("no RSS judgement for the live engine")
    if processes_left:
        failures.append(f"processes left after shutdown: {processes_left}")
    if master_exit != 0:
        failures.append(f"master exit status {master_exit}")
    if a.warmup_s * 2 > duration:
        failures.append("the run is too short for its warm-up")

    return {"minutes": a.minutes, "traffic_s": round(traffic_s, 1), "clients": a.clients, "warmup_s": a.warmup_s,
            "max_rss_growth": a.max_rss_growth, "requests": len(results),
            "outcomes": dict(outcomes.most_common()),
            "by_request": {k: dict(v.most_common()) for k, v in sorted(by_request.items())},
            "unexpected": unexpected[:50], "events": events, "rss": rss, "end_state": end_state,
            "processes_left": processes_left, "master_exit": master_exit, "server_log": server.log,
            "failures": failures}


def summary(res: dict) -> str:
    """The human-readable report of :func:`run`'s result."""
    out = [f"soak: {res['minutes']} min, {res['clients']} clients, {res['requests']} requests "
           f"in {res['traffic_s']:.0f} s"]
    out.append("outcomes (errors by kind):")
    for k, n in res["outcomes"].items():
        out.append(f"  {k:32s} {n:6d}")
    for e in res["events"]:
        out.append(f"event: {e}")
    for u in res["unexpected"][:10]:
        out.append(f"unexpected: {u}")
    out.append(f"RSS (KiB; start = first sample after a warm-up: every slot filled once, then {res['warmup_s']:.0f} s "
               "of the traffic, or of the process's own life for one that appeared later; end = last sample, "
               "idle, or the last before a kill):")
    for row in res["rss"]:
        who = f"{row['role']} {row['pid']}" + ("" if row["alive_at_end"] else " (gone)")
        if row["judged"]:
            out.append(f"  {who:28s} {row['start_kb']:9d} @{row['start_s']:5.0f}s -> {row['end_kb']:9d} "
                       f"@{row['end_s']:5.0f}s  {row['growth']:+7.1%}" + ("  OVER" if row["over"] else ""))
        else:
            out.append(f"  {who:28s} not judged: {row['note']} (last {row['end_kb']} KiB)")
    es = res["end_state"]
    out.append(f"end: mailboxes in use {es['mailboxes_in_use']}, slots in use {es['slots_in_use']}, workers "
               f"{es['workers']}, engine ready {es['engine_ready']}; /metrics kv_slot_utilization "
               f"{es['metrics_kv_slot_utilization']}, queue_depth {es['metrics_queue_depth']}")
    out.append(f"shutdown: master exit {res['master_exit']}; /dev/shm entries of this server left: "
               f"{res['shm']['left_after_shutdown'] or 'none'} (watched: {', '.join(res['shm']['ours'])}); "
               f"processes left: {res['processes_left'] or 'none'}")
    if res["shm"]["other_new_entries_not_counted"]:
        out.append("  (new /dev/shm entries of other programs, not counted: "
                   f"{res['shm']['other_new_entries_not_counted']})")
    out.append("PASS" if res["passed"] else "FAIL: " + "; ".join(res["failures"]))
    return "\n".join(out)


def main(argv=None) -> int:
    """Run the soak, print the summary, save ``--json``; exit 0 when it passed."""
    from bench.common import save

    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--clients", type=int, default=10, help="client threads sending at once")
    p.add_argument("--slots", type=int, default=8, help="the server's --max-slots")
    p.add_argument("--queued", type=int, default=4, help="the server's --max-queued (few: some 503 saturated)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--warmup-s", type=float, default=15.0,
                   help="seconds of traffic before a process's start RSS sample")
    p.add_argument("--max-rss-growth", type=float, default=0.10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the result here")
    a = p.parse_args(argv)
    res = run(a)
    print(summary(res))
    save(res, a.json)
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
