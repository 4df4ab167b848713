"""Overload: many more concurrent requests than the server can hold, at once.

    python -m bench.overload [--factor 10] [--max-tokens 32] [--ramp 0] [--json out.json]
                             [-- server flags...]

Starts a real ``inference-server`` (default settings unless flags follow ``--``) and sends
``--factor`` x (slots + queue places) chat requests concurrently (each on its own connection,
sent within ``--ramp`` seconds). Reports:

* every status (200, 429 and 503 expected; a 503 must carry ``Retry-After``);
* time to a 503 (client-measured: request sent to answer read), median, p99 and max;
* the unseen wait of every 200: client latency minus the server's own ``latency_s`` (its JSON
  log line, matched by ``X-Request-ID``): time spent where the server could not see it
  (accept backlog, a worker's thread queue);
* the server's queue wait of every 200 (``queue_wait_s``) against the slots: a request behind
  ``k`` others waits about ``k / slots`` service times;
* RSS and threads of every worker at the peak of the load, and health afterwards.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from urllib.parse import urlparse


async def _request(host: str, port: int, body: bytes, request_id: str) -> dict:
    """One chat request on a fresh connection; returns its status, headers and timings."""
    start = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nX-Request-ID: " + request_id.encode() + b"\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        data = await reader.read()
        writer.close()
    except OSError as e:
        return {"id": request_id, "status": None, "error": type(e).__name__, "seconds": time.monotonic() - start}
    seconds = time.monotonic() - start
    head, _, _ = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines and lines[0].startswith("HTTP/") else None
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return {"id": request_id, "status": status, "retry_after": headers.get("retry-after"), "seconds": seconds}


async def burst(url: str, n: int, max_tokens: int, ramp_s: float) -> list[dict]:
    """``n`` concurrent requests, started evenly within ``ramp_s`` seconds."""
    u = urlparse(url)
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me a story about a cat."}],
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(_request(u.hostname, u.port, body, f"overload-{i}")))
        if ramp_s:
            await asyncio.sleep(ramp_s / n)
    return await asyncio.gather(*tasks)


def _proc_status(pid: int) -> dict:
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024, "threads": int(fields["Threads"])}
    except (OSError, KeyError):
        return {}


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def analyse(results: list[dict], log_lines: list[dict], slots: int) -> dict:
    """Statuses, time to 503, unseen waits and queue waits (see the module)."""
    by_id = {line["request_id"]: line for line in log_lines if "request_id" in line}
    statuses: dict = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    refused = [r["seconds"] for r in results if r["status"] == 503]
    served = [r for r in results if r["status"] == 200]
    unseen = [r["seconds"] - by_id[r["id"]]["latency_s"] for r in served if r["id"] in by_id]
    service = [by_id[r["id"]]["latency_s"] - (by_id[r["id"]]["queue_wait_s"] or 0) for r in served if r["id"] in by_id]
    waits = sorted(by_id[r["id"]]["queue_wait_s"] or 0 for r in served if r["id"] in by_id)
    # the k-th shortest queue wait had k requests ahead at most: about k / slots service times
    explained = [(k // slots) * max(service) for k in range(len(waits))] if service else []
    return {
        "requests": len(results), "statuses": statuses,
        "refused_without_retry_after": sum(1 for r in results if r["status"] == 503 and not r.get("retry_after")),
        "time_to_503_ms": {"median": _ms(statistics.median(refused)) if refused else None,
                           "p99": _ms(_pct(refused, 0.99)), "max": _ms(max(refused) if refused else None)},
        "served": len(served), "served_logged": len(unseen),
        "shortest_200_s": min((r["seconds"] for r in served), default=None),
        "unseen_wait_ms": {"median": _ms(statistics.median(unseen)) if unseen else None,
                           "max": _ms(max(unseen) if unseen else None)},
        "service_s_max": max(service) if service else None,
        "queue_wait_beyond_position_s": max((w - e for w, e in zip(waits, explained)), default=None),
    }


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 2)


def run(server, n: int, max_tokens: int, ramp_s: float, slots: int) -> dict:
    """Drive ``server`` (a ``tests.support.servers.RunningServer``) with one burst; sample its workers."""
    peak: dict = {}
    done = threading.Event()

    def sample():
        while not done.wait(0.05):
            for pid in server.worker_pids():
                s = _proc_status(pid)
                if s and s["threads"] >= peak.get(pid, {}).get("threads", 0):
                    peak[pid] = s
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    log_start = open(server.log, "rb").seek(0, 2)
    try:
        results = asyncio.run(burst(server.url, n, max_tokens, ramp_s))
    finally:
        done.set()
        sampler.join()
    server.wait_idle(60)
    with open(server.log, "rb") as f:
        f.seek(log_start)
        lines = [json.loads(line) for line in f.read().decode(errors="replace").splitlines()
                 if line.startswith("{\"request_id\"")]
    out = analyse(results, lines, slots)
    out["workers_at_peak"] = [{"pid": pid, **s} for pid, s in sorted(peak.items())]
    out["mailboxes_in_use_after"] = server.engine.mailboxes_in_use()
    out["errors"] = sorted({r["error"] for r in results if r.get("error")})
    return out


def main(argv=None) -> int:
    from bench.common import save
    from server.config import ServerConfig, from_args
    from tests.support.servers import running_server

    p = argparse.ArgumentParser(prog="python -m bench.overload", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--factor", type=float, default=10.0, help="requests per slot and queue place")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ramp", type=float, default=0.0, help="seconds over which the requests are sent")
    p.add_argument("--json", help="write the results here")
    p.add_argument("flags", nargs="*", help="server flags (after --)")
    a = p.parse_args(argv)
    config = from_args(a.flags, environ={}) if a.flags else ServerConfig()
    capacity = config.max_slots + config.max_queued
    n = int(a.factor * capacity)
    with running_server(*a.flags) as server:
        out = run(server, n, a.max_tokens, a.ramp, config.max_slots)
        import urllib.request
        with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
            out["healthy_after"] = r.status == 200
    out.update(capacity=capacity, slots=config.max_slots, workers=config.workers,
               threads_per_worker=config.front_end_threads, ramp_s=a.ramp, max_tokens=a.max_tokens)
    print(json.dumps(out, indent=1))
    save(out, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
