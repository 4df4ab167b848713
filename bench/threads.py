"""Compute threads: the adaptive default against every fixed setting, on an idle machine and with
one CPU held by another busy process, in one run.

    python -m bench.threads [--quick] [--clients 16] [--requests 48] [--json PATH]

For each setting (the default, adaptive; 1 thread; 2 threads with libgomp's bounded spin;
2 threads spinning, ``OMP_WAIT_POLICY=ACTIVE``; 2 threads parked, ``OMP_WAIT_POLICY=PASSIVE``)
one real server is started, and under each condition (idle; a ``while True: pass`` process
started by this benchmark) two workloads run with ``--clients`` streaming connections (closed
loop, ``bench.policies.drive``):

* fixed: ``--requests`` prompts of about 32 tokens, 128 generated tokens each, ``ignore_eos``
  (generated tokens/s, sustained while every connection is busy);
* mix: ``bench.policies.workload`` (short and long prompts, heavy-tailed lengths; requests/s).

The ceiling (``bench.limit``, B = clients, P = 32, G = 128) runs for every fixed setting under
both conditions too (with no server up: an idle server's ACTIVE threads keep spinning). The table
gives each figure and its ratio to the best fixed setting of its column. The machine is noisy (one
run's figures move by 10-15 %): ``--repeat R`` alternates the settings R times and reports
medians. Then the switch: the adaptive server under steady load while the busy process starts and
later stops; generated tokens per second, and how long after each change throughput stayed
within 10 % of its new level.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time

from bench.policies import Request, drive, one_stream, summarize, workload

SETTINGS = {  # key -> (shown as, flags, extra environment of the server and the ceiling)
    "adaptive": ("adaptive (default)", [], {}),
    "1": ("1 thread", ["--engine-threads", "1"], {}),
    "2-spin": ("2 threads, bounded spin", ["--engine-threads", "2"], {}),
    "2-active": ("2 threads, OMP_WAIT_POLICY=ACTIVE", ["--engine-threads", "2"], {"OMP_WAIT_POLICY": "ACTIVE"}),
    "2-passive": ("2 threads, OMP_WAIT_POLICY=PASSIVE", ["--engine-threads", "2"], {"OMP_WAIT_POLICY": "PASSIVE"}),
}
CONDITIONS = ("idle", "busy")


class BusyProcess:
    """A ``while True: pass`` process (one CPU held) for the ``with`` block."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(1.0)  # let it be scheduled and the engine see it
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def fixed_workload(n: int, gen: int) -> list[Request]:
    return [Request(f"Client {i} asks: tell a long story about the sea, the wind and the stars, please", gen)
            for i in range(n)]


def ceiling(clients: int, gen: int, threads: int, env: dict) -> float:
    """``bench.limit`` in a child process with ``env``; generated tokens/s."""
    import os
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "bench.limit", "--batch", str(clients), "--prompt-tokens", "32",
                        "--gen-tokens", str(gen), "--engine-threads", str(threads), "--json", f.name],
                       check=True, stdout=subprocess.DEVNULL, env={**os.environ, **env})
        return json.load(open(f.name))["tokens_per_s"]


def switch(port: int, clients: int, before_s: float, busy_s: float, after_s: float) -> dict:
    """Steady load on ``port``; the busy process runs from ``before_s`` for ``busy_s`` seconds.
    Returns tokens per 1 s bin and the settling times (s) after the start and the stop."""
    arrivals: list[float] = []
    stop = threading.Event()
    t0 = time.perf_counter()

    def client(i):
        while not stop.is_set():
            s = one_stream(port, Request(f"Client {i} tells a long story about the sea", 64), t0)
            arrivals.extend(s.arrivals)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(before_s)
    with BusyProcess():
        started = time.perf_counter() - t0 - 1.0  # BusyProcess waits 1 s after starting it
        time.sleep(busy_s)
    stopped = time.perf_counter() - t0
    time.sleep(after_s)
    stop.set()
    for t in threads:
        t.join()
    end = int(stopped + after_s)
    bins = [0] * (end + 1)
    for a in arrivals:
        if int(a) <= end:
            bins[int(a)] += 1
    return {"tokens_per_s_bins": bins, "busy_from_s": started, "busy_until_s": stopped,
            "settle_after_start_s": settle(bins, started, stopped), "settle_after_stop_s": settle(bins, stopped, end)}


def settle(bins: list[int], change: float, until: float) -> float:
    """Seconds from ``change`` to the first whole 1 s bin within 15 % of the new level (the
    median of the second half of the span up to ``until``): how soon throughput reaches it."""
    first, last = int(change) + 1, int(until) - 1
    tail = bins[(first + last) // 2:last + 1]
    level = statistics.median(tail) if tail else 0
    reached = next((b for b in range(first, last + 1) if abs(bins[b] - level) <= 0.15 * level), last)
    return reached + 1 - change  # the end of that bin


def main(argv=None) -> int:
    from bench.common import save
    from tests.conftest import running_server

    p = argparse.ArgumentParser(prog="python -m bench.threads", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a short run (CI checks that it runs)")
    p.add_argument("--clients", type=int, default=None, help="default 16; --quick 4")
    p.add_argument("--requests", type=int, default=None, help="per run (default 48; --quick 8)")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated: " + ", ".join(SETTINGS))
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds over the settings, alternating; each cell is the median of its rounds")
    p.add_argument("--switch-only", action="store_true", help="only the switch measurement")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    a.clients = a.clients or (4 if a.quick else 16)
    n = a.requests or (8 if a.quick else 48)
    gen = 16 if a.quick else 128
    fixed, mix = fixed_workload(n, gen), workload(n, seed=99)
    if a.quick:
        mix = [Request(r.prompt, min(r.max_tokens, 32)) for r in mix]
    names = [] if a.switch_only else a.settings.split(",")
    result: dict = {"clients": a.clients, "requests": n, "repeat": a.repeat, "settings": {}, "runs": {}}
    for _ in range(a.repeat):
        for key in names:
            name, flags, env = SETTINGS[key]
            runs = result["runs"].setdefault(name, {})
            with running_server("--max-slots", str(a.clients), "--max-seq-len", "1024", "--threads",
                                str(a.clients + 4), *flags, env=env) as server:
                for condition in CONDITIONS:
                    with BusyProcess() if condition == "busy" else contextlib.nullcontext():
                        f = summarize(*_run(server, fixed, a))
                        runs.setdefault(f"{condition} fixed tok/s", []).append(f["gen_tok_per_s"])
                        m = summarize(*_run(server, mix, a))
                        runs.setdefault(f"{condition} mix req/s", []).append(m["req_per_s"])
            # The ceiling alone: an idle server would still hold CPUs (ACTIVE threads spin on).
            for condition in CONDITIONS if flags else ():
                with BusyProcess() if condition == "busy" else contextlib.nullcontext():
                    runs.setdefault(f"{condition} ceiling tok/s", []).append(
                        ceiling(a.clients, gen, int(flags[1]), env))
            row = result["settings"][name] = {k: statistics.median(v) for k, v in runs.items()}
            print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    columns = list(dict.fromkeys(c for row in result["settings"].values() for c in row))
    if not columns:
        names = ["adaptive"]
    best = {c: max((r[c] for k, r in result["settings"].items() if k != "adaptive (default)" and c in r), default=0)
            for c in columns}
    if columns:
        print("| setting | " + " | ".join(columns) + " |")
        print("|---|" + "---|" * len(columns))
    for name, row in result["settings"].items():
        cells = [f"{row[c]:.1f} ({row[c] / best[c]:.2f})" if c in row and best[c] else "" for c in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")
    result["best_fixed"] = best
    if "adaptive" in names:
        with running_server("--max-slots", str(a.clients), "--max-seq-len", "1024", "--threads",
                            str(a.clients + 4)) as server:
            spans = (5, 8, 8) if a.quick else (10, 20, 20)
            result["switch"] = switch(server.port, a.clients, *spans)
        s = result["switch"]
        print(f"switch (adaptive): tokens/s per second {s['tokens_per_s_bins']}")
        print(f"busy process from {s['busy_from_s']:.1f} s to {s['busy_until_s']:.1f} s; settled "
              f"{s['settle_after_start_s']:.1f} s after the start, {s['settle_after_stop_s']:.1f} s after the stop")
    save(result, a.json)
    return 0


def _run(server, requests, a):
    samples, wall, busy = drive(server.port, requests, a.clients)
    server.wait_idle(60)
    return samples, wall, busy


if __name__ == "__main__":
    sys.exit(main())
