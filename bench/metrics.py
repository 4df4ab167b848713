"""What metrics cost, in one run: throughput with metrics on and off, the engine's per-step
recording, and the time of a ``/metrics`` scrape with many workers, before and after many
worker restarts.

    python -m bench.metrics [--clients 16 --prompt-tokens 32 --gen-tokens 128 --repeat 3]
                            [--scrape-workers 8 --restarts 100 --scrapes 50] [--json out.json]

* throughput: ``bench.http``'s workload (``--clients`` concurrent streaming ``/v1/completions``,
  prompts of about P tokens, G tokens each with ``ignore_eos``) on two servers, one with metrics
  (the default) and one with ``--no-metrics``, alternating runs, ``--repeat`` each; the ratio of
  the medians (on / off).
* engine step: the mean time of a step observer (:func:`engine.metrics.step_observer`) in multiprocess mode (a
  child process, a fresh directory), against the mean engine step measured in the metered runs
  (their wall time over ``inference_batch_size_count``).
* scrape: a server with ``--scrape-workers`` workers, each having served requests; the median and
  95th percentile of ``--scrapes`` scrapes (client-side, request to last byte); then
  ``--restarts`` times SIGKILL a worker, wait for its replacement and serve a request; scrape
  again (each replacement booted before the next kill). Also the number of files in the
  multiprocess directory, and the requests counted against those sent.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request

from bench.http import throughput, workload


def scrape_ms(url: str, n: int) -> tuple[float, float, int]:
    """``n`` scrapes of ``url/metrics``: (median ms, p95 ms, bytes of the last)."""
    times, size = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            size = len(r.read())
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(0.95 * len(times)))], size


def sample(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def observe_step_us(calls: int = 100_000) -> float:
    """Mean microseconds of one step observation in multiprocess mode, in a child process."""
    import tempfile

    code = ("import time; from engine.metrics import step_observer; observe_step = step_observer('m')\n"
            f"t = time.perf_counter()\nfor i in range({calls}): observe_step(1 + i % 16, 16 + i % 64)\n"
            f"print((time.perf_counter() - t) / {calls} * 1e6)")
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": d},
                             capture_output=True, text=True, check=True)
    return float(out.stdout)


def post(url: str, prompt: str) -> None:
    req = urllib.request.Request(url + "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 2}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


def main(argv=None) -> int:
    from bench.common import concurrently, parser, save
    from tests.support.servers import running_server

    p = parser("python -m bench.metrics", __doc__, "--clients")
    p.add_argument("--workers", type=int, default=2, help="workers of the throughput servers")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--scrape-workers", type=int, default=8)
    p.add_argument("--restarts", type=int, default=100)
    p.add_argument("--scrapes", type=int, default=50)
    a = p.parse_args(argv)
    prompts, flags = workload(a)
    result = {}

    on, off, walls = [], [], []
    with running_server(*flags) as metered, running_server(*flags, "--no-metrics") as bare:
        for server in (metered, bare):
            throughput(server.port, prompts[:1], 4)  # warm-up
        for _ in range(a.repeat):
            steps = sample(metered.url, "inference_batch_size_count")
            t0 = time.perf_counter()
            on.append(throughput(metered.port, prompts, a.gen_tokens)[0])
            walls.append((time.perf_counter() - t0, sample(metered.url, "inference_batch_size_count") - steps))
            metered.wait_idle()
            off.append(throughput(bare.port, prompts, a.gen_tokens)[0])
            bare.wait_idle()
    step_ms = statistics.median(w / n for w, n in walls) * 1000
    record_us = observe_step_us()
    result["throughput"] = {"metrics_on_tok_s": on, "metrics_off_tok_s": off,
                            "ratio_of_medians": statistics.median(on) / statistics.median(off)}
    result["engine_step"] = {"observe_step_us": record_us, "mean_step_ms": step_ms,
                             "share": record_us / 1000 / step_ms}
    print("metrics on (tok/s): " + ", ".join(f"{x:.1f}" for x in on))
    print("metrics off (tok/s): " + ", ".join(f"{x:.1f}" for x in off))
    print(f"throughput, metrics on / off (medians): {result['throughput']['ratio_of_medians']:.3f}")
    print(f"engine step: recording {record_us:.2f} us per step; mean step {step_ms:.2f} ms "
          f"({record_us / 10 / step_ms:.4f} % of a step)")

    with running_server("--max-slots", "4", "--max-seq-len", "256", "--workers", str(a.scrape_workers),
                        "--threads", "4") as server:
        concurrently(4 * a.scrape_workers, lambda i: post(server.url, f"Warm {i}"))
        path = next(line.split()[-1] for line in open(server.log) if "multiprocess directory" in line)
        fresh = scrape_ms(server.url, a.scrapes)
        files_fresh = len(os.listdir(path))
        t0 = time.perf_counter()
        for i in range(a.restarts):
            workers = server.worker_pids()
            os.kill(workers[i % len(workers)], signal.SIGKILL)
            while not (new := set(server.worker_pids()) - set(workers)):
                time.sleep(0.02)
            # Booted: its app made its first metric values (server/observability/telemetry.py, at start).
            replacement = new.pop()
            while not os.path.exists(os.path.join(path, f"counter_{replacement}.db")):
                time.sleep(0.02)
            concurrently(2, lambda j: post(server.url, f"Restart {i} {j}"))
        restart_s = time.perf_counter() - t0
        after = scrape_ms(server.url, a.scrapes)
        files_after = len(os.listdir(path))
        served = sample(server.url, "inference_requests_total")
    result["scrape"] = {"workers": a.scrape_workers, "fresh_ms_median": fresh[0], "fresh_ms_p95": fresh[1],
                        "fresh_files": files_fresh, "restarts": a.restarts, "after_ms_median": after[0],
                        "after_ms_p95": after[1], "after_files": files_after, "bytes": after[2],
                        "requests_counted": served, "requests_sent": 4 * a.scrape_workers + 2 * a.restarts}
    print(f"scrape, {a.scrape_workers} workers: median {fresh[0]:.1f} ms, p95 {fresh[1]:.1f} ms, {files_fresh} files")
    print(f"after {a.restarts} worker restarts ({restart_s:.0f} s): median {after[0]:.1f} ms, p95 {after[1]:.1f} ms, "
          f"{files_after} files, {after[2]} bytes; requests counted {served:.0f} of "
          f"{result['scrape']['requests_sent']} sent")
    save(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
