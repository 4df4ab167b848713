"""What discarding refused bodies costs the server (``--max-discard-bytes``, ``server/http/worker.py``).

    python -m bench.discard [--bodies 20] [--mb 32] [--json out.json]

Starts a real server (1 worker) and sends ``--bodies`` chat requests of ``--mb`` MB each the way
Python's ``http.client`` does (the whole body, then the answer); each gets its 413 after the
server read and dropped the body. Reports the worker's CPU time (``/proc/<pid>/stat``) per body
and per MiB, and the wall time per request.
"""
from __future__ import annotations

import argparse
import http.client
import os
import sys
import time


def _cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return total


def main(argv=None) -> int:
    from bench.common import save
    from tests.support.servers import running_server

    p = argparse.ArgumentParser(prog="python -m bench.discard", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bodies", type=int, default=20)
    p.add_argument("--mb", type=int, default=32)
    p.add_argument("--json")
    a = p.parse_args(argv)
    body = b'{"messages":[{"role":"user","content":"' + b"a" * (a.mb * 10**6) + b'"}]}'
    with running_server("--workers", "1", "--max-slots", "2", "--max-queued", "2") as server:
        pids = server.worker_pids()
        cpu, wall = _cpu_s(pids), time.monotonic()
        for _ in range(a.bodies):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
            reply = conn.getresponse()
            reply.read()
            conn.close()
            if reply.status != 413:
                raise SystemExit(f"expected 413, got {reply.status}")
        cpu, wall = _cpu_s(pids) - cpu, time.monotonic() - wall
    mib = a.bodies * len(body) / 2**20
    out = {"bodies": a.bodies, "body_bytes": len(body), "worker_cpu_ms_per_body": cpu / a.bodies * 1000,
           "worker_cpu_ms_per_mib": cpu / mib * 1000, "wall_ms_per_request": wall / a.bodies * 1000}
    print(f"{a.bodies} bodies of {len(body) / 1e6:.0f} MB, each answered 413: worker CPU "
          f"{out['worker_cpu_ms_per_body']:.1f} ms per body ({out['worker_cpu_ms_per_mib']:.3f} ms per MiB); "
          f"{out['wall_ms_per_request']:.0f} ms per request")
    save(out, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
