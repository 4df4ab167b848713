"""Compute threads: the adaptive default against every fixed setting, on an idle machine and under
contention that comes before the server, while it idles, or from a CPU quota, in one run.

    python -m bench.threads [--quick] [--clients 16] [--requests 32] [--conditions ...] [--json PATH]

For each setting (the default, adaptive; 1 thread; 2 threads with the engine's default wait, a
brief spin, ``engine.threads.SPIN_COUNT``; 2 threads with libgomp's own bounded spin, 300,000;
2 threads spinning, ``OMP_WAIT_POLICY=ACTIVE``; 2 threads parked, ``OMP_WAIT_POLICY=PASSIVE``)
real servers run under each condition:

* ``idle``: nothing else runs;
* ``busy``: a ``while True: pass`` process started while that server idles after the idle runs;
* ``busy-start``: the busy process runs before the server starts (the first decode is then the
  largest of all, every prompt's prefill, under contention);
* ``busy2-start``: the same with two busy processes;
* ``quota``: the server started inside a cgroup CPU quota of one CPU (v1 ``cpu.cfs_quota_us`` or
  v2 ``cpu.max``; needs root, skipped otherwise), nothing else running.

Under ``idle`` and ``busy`` two workloads run with ``--clients`` streaming connections (closed
loop, ``bench.policies.drive``), under the others the first only:

* fixed: ``--requests`` prompts of about 32 tokens, 128 generated tokens each, ``ignore_eos``
  (generated tokens/s, sustained while every connection is busy);
* mix: ``bench.policies.workload`` (short and long prompts, heavy-tailed lengths; requests/s).

Every run also counts failed requests and engine restarts (its PID changed, or the server's log
says it died): the ``errors`` and ``restarts`` of the JSON must be 0 under every condition.
The ceiling (``bench.limit``, B = clients, P = 32, G = 128) runs for every fixed setting under
the conditions asked of ``idle`` and ``busy`` (with no server up: an idle server's ACTIVE threads
keep spinning). The table gives each figure and its ratio to the best fixed setting of its
column. The machine is noisy (one run's figures move by 10-15 %): ``--repeat R`` alternates the
settings R times and reports medians. Then the switch: the adaptive server under steady load
while the busy process starts and later stops; generated tokens per second, and how long after
each change throughput stayed within 10 % of its new level.
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
from engine.threads import SPIN_COUNT

SETTINGS = {  # key -> (shown as, flags, extra environment of the server and the ceiling)
    "adaptive": ("adaptive (default)", ["--engine-threads", "0"], {}),  # explicit: the suite sets ENGINE_THREADS
    "1": ("1 thread", ["--engine-threads", "1"], {}),
    "2-brief": ("2 threads, GOMP_SPINCOUNT=3000 (the engine's default wait)", ["--engine-threads", "2"],
                {"GOMP_SPINCOUNT": str(SPIN_COUNT)}),
    "2-spin": ("2 threads, GOMP_SPINCOUNT=300000 (libgomp's default)", ["--engine-threads", "2"],
               {"GOMP_SPINCOUNT": "300000"}),
    "2-active": ("2 threads, OMP_WAIT_POLICY=ACTIVE", ["--engine-threads", "2"], {"OMP_WAIT_POLICY": "ACTIVE"}),
    "2-passive": ("2 threads, OMP_WAIT_POLICY=PASSIVE", ["--engine-threads", "2"], {"OMP_WAIT_POLICY": "PASSIVE"}),
}
CONDITIONS = ("idle", "busy", "busy-start", "busy2-start", "quota")
CGROUP_NAME = "bench-threads-quota"


class BusyProcess:
    """``n`` ``while True: pass`` processes (``n`` CPUs held) for the ``with`` block."""

    def __init__(self, n: int = 1):
        self.n = n

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        time.sleep(1.0)  # let them be scheduled and the engine see them
        return self

    def __exit__(self, *exc):
        for proc in self.procs:
            proc.kill()
            proc.wait()


class CpuQuota:
    """A cgroup with a CPU quota of ``cpus`` (v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``).
    Processes started inside ``with quota.joined():`` run in it (children inherit their cgroup);
    the benchmark itself is moved back out afterwards. Raises OSError without root or cgroups."""

    def __init__(self, cpus: float = 1.0, period_us: int = 100_000):
        import os

        v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
        self.root = "/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/cpu"
        self.path = os.path.join(self.root, CGROUP_NAME)
        os.makedirs(self.path, exist_ok=True)
        quota = int(cpus * period_us)
        if v2:
            with open(os.path.join(self.root, "cgroup.subtree_control"), "w") as f:
                f.write("+cpu")
            self._write("cpu.max", f"{quota} {period_us}")
        else:
            self._write("cpu.cfs_period_us", str(period_us))
            self._write("cpu.cfs_quota_us", str(quota))

    def _write(self, name: str, value: str, path: str | None = None) -> None:
        import os

        with open(os.path.join(path or self.path, name), "w") as f:
            f.write(value)

    @contextlib.contextmanager
    def joined(self):
        import os

        self._write("cgroup.procs", str(os.getpid()))
        try:
            yield
        finally:
            self._write("cgroup.procs", str(os.getpid()), self.root)

    def close(self, timeout: float = 10.0) -> None:
        """Remove the cgroup once its processes have gone (a stopped server's last ones may take
        a moment to be reaped)."""
        import os

        end = time.monotonic() + timeout
        while True:
            try:
                os.rmdir(self.path)
                return
            except OSError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.1)


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
    from tests.support.servers import running_server

    p = argparse.ArgumentParser(prog="python -m bench.threads", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a short run (CI checks that it runs)")
    p.add_argument("--clients", type=int, default=None, help="default 16; --quick 4")
    p.add_argument("--requests", type=int, default=None, help="per run (default 32; --quick 8)")
    p.add_argument("--settings", default=None,
                   help="comma-separated: " + ", ".join(SETTINGS) + " (default all; --quick adaptive,1)")
    p.add_argument("--idle-only", default="",
                   help="comma-separated settings measured under the idle condition only (the long spins: "
                        "beside busy processes they run at a tenth of one thread's speed, for minutes a run)")
    p.add_argument("--conditions", default=None,
                   help="comma-separated: " + ", ".join(CONDITIONS) + " (default all; --quick all but quota)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds over the settings, alternating; each cell is the median of its rounds")
    p.add_argument("--no-ceiling", action="store_true", help="skip the bench.limit ceilings")
    p.add_argument("--no-mix", action="store_true", help="skip the mix workload (the fixed one only)")
    p.add_argument("--switch-only", action="store_true", help="only the switch measurement")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    a.clients = a.clients or (4 if a.quick else 16)
    n = a.requests or (8 if a.quick else 32)
    gen = 16 if a.quick else 128
    fixed, mix = fixed_workload(n, gen), workload(n, seed=99)
    if a.quick:
        mix = [Request(r.prompt, min(r.max_tokens, 32)) for r in mix]
    names = [] if a.switch_only else (a.settings or ("adaptive,1" if a.quick else ",".join(SETTINGS))).split(",")
    conditions = (a.conditions or ",".join(c for c in CONDITIONS if c != "quota" or not a.quick)).split(",")
    result: dict = {"clients": a.clients, "requests": n, "repeat": a.repeat, "settings": {}, "runs": {},
                    "errors": {}, "restarts": {}}
    idle_only = [k for k in a.idle_only.split(",") if k]
    for _ in range(a.repeat):
        for key in names + [k for k in idle_only if k not in names]:
            name, flags, env = SETTINGS[key]
            runs = result["runs"].setdefault(name, {})
            asked = ["idle"] if key in idle_only else conditions
            for condition, figures in _conditions(a, asked, flags, env, fixed, mix):
                for column, (value, errors, restarts) in figures.items():
                    runs.setdefault(f"{condition} {column}", []).append(value)
                    result["errors"][f"{name}, {condition}"] = result["errors"].get(f"{name}, {condition}", 0) + errors
                    result["restarts"][f"{name}, {condition}"] = \
                        result["restarts"].get(f"{name}, {condition}", 0) + restarts
            # The ceiling alone: an idle server would still hold CPUs (ACTIVE threads spin on). Fixed
            # settings only (0 is adaptive), under the conditions asked that have one: idle, and
            # busy (a busy process beside it).
            threads = int(flags[1])
            for condition in [c for c in ("idle", "busy") if c in asked] if threads and not a.no_ceiling else ():
                with BusyProcess() if condition == "busy" else contextlib.nullcontext():
                    runs.setdefault(f"{condition} ceiling tok/s", []).append(ceiling(a.clients, gen, threads, env))
            row = result["settings"][name] = {k: statistics.median(v) for k, v in runs.items()}
            print(f"{name}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    _table(result)
    failed = {k: (v, result["restarts"][k]) for k, v in result["errors"].items() if v or result["restarts"][k]}
    print("errors and restarts: " + (", ".join(f"{k}: {e} errors, {r} restarts" for k, (e, r) in failed.items())
                                     if failed else "none"))
    if "adaptive" in names or a.switch_only:
        with running_server(*_server_flags(a, *SETTINGS["adaptive"][1])) as server:
            spans = (1, 2, 2) if a.quick else (10, 20, 20)
            result["switch"] = switch(server.port, a.clients, *spans)
        s = result["switch"]
        print(f"switch (adaptive): tokens/s per second {s['tokens_per_s_bins']}")
        print(f"busy process from {s['busy_from_s']:.1f} s to {s['busy_until_s']:.1f} s; settled "
              f"{s['settle_after_start_s']:.1f} s after the start, {s['settle_after_stop_s']:.1f} s after the stop")
    save(result, a.json)
    return 0


def _server_flags(a, *flags: str) -> tuple[str, ...]:
    return ("--max-slots", str(a.clients), "--max-seq-len", "1024", "--threads", str(a.clients + 4), *flags)


def _conditions(a, conditions: list[str], flags: list[str], env: dict, fixed: list, mix: list):
    """Yield ``(condition, {column: (value, errors, engine restarts)})`` for each condition asked."""
    if "idle" in conditions or "busy" in conditions:
        with _server(a, flags, env) as server:  # started on an idle machine
            for condition in ("idle", "busy"):
                if condition in conditions:
                    with BusyProcess() if condition == "busy" else contextlib.nullcontext():
                        figures = {"fixed tok/s": _measure(server, fixed, a, "gen_tok_per_s")}
                        if not a.no_mix:
                            figures["mix req/s"] = _measure(server, mix, a, "req_per_s")
                        yield condition, figures
    for condition, n_busy in (("busy-start", 1), ("busy2-start", 2)):
        if condition in conditions:
            with BusyProcess(n_busy), _server(a, flags, env) as server:
                yield condition, {"fixed tok/s": _measure(server, fixed, a, "gen_tok_per_s")}
    if "quota" in conditions:
        try:
            quota = CpuQuota(1.0)
        except OSError as e:
            print(f"quota: skipped ({e})", flush=True)
            return
        try:
            with _server(a, flags, env, quota) as server:
                yield "quota", {"fixed tok/s": _measure(server, fixed, a, "gen_tok_per_s")}
        finally:
            quota.close()


@contextlib.contextmanager
def _server(a, flags: list[str], env: dict, quota: CpuQuota | None = None):
    from tests.support.servers import RunningServer

    with quota.joined() if quota else contextlib.nullcontext():
        server = RunningServer(*_server_flags(a, *flags), env=env)
    try:
        server.first_pid = server.engine.t.control.engine_pid
        yield server
    finally:
        server.stop()


def _measure(server, requests, a, figure: str) -> tuple[float, int, int]:
    """``(figure, failed requests, engine restarts so far)`` of one closed-loop run."""
    samples, wall, busy = drive(server.port, requests, a.clients)
    server.wait_idle(60)
    restarted = (server.engine.t.control.engine_pid != server.first_pid
                 or "died; failed its in-flight requests" in open(server.log).read())
    return summarize(samples, wall, busy)[figure], sum(s.error is not None for s in samples), int(restarted)


def _table(result: dict) -> None:
    """The Markdown table: each figure and its ratio to the best fixed setting of its column."""
    columns = list(dict.fromkeys(c for row in result["settings"].values() for c in row))
    best = {c: max((r[c] for k, r in result["settings"].items() if k != "adaptive (default)" and c in r), default=0)
            for c in columns}
    result["best_fixed"] = best
    if not columns:
        return
    print("| setting | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, row in result["settings"].items():
        # a figure, and its ratio where a fixed setting was measured in that column
        cells = [(f"{row[c]:.1f}" + (f" ({row[c] / best[c]:.2f})" if best[c] else "")) if c in row else ""
                 for c in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
