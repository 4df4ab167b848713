"""The scheduling policies side by side against the physical limit, in one run.

    bench/run_bench.sh [--quick] [--concurrency 16] [--requests 64] [--json PATH]
    python -m bench.policies ...          (the same)

For each policy (``continuous``, ``static``, ``fifo``) a real server is started with the same
model, slots and threads, and the same request list is driven against it twice:

* the Python driver: ``--concurrency`` connections, each taking the next request of the list
  (closed loop), streaming ``/v1/completions``, so it sees time to first token;
* ``wrk`` with ``bench/wrk_mix.lua`` (non-streamed, the list in a loop for ``--wrk-seconds``),
  when ``wrk`` is installed.

Two ceilings, both ``bench.limit`` at B = ``--concurrency`` with the servers' weights and
threads: the limit the ratios use replays this very request list over B lanes in a bare
``llama_decode`` loop (``--mix``: a finished lane takes the next request at once, new prompts
are prefilled whole, every lane decodes each step; tokens/s while every lane is busy, as the
driver counts), so it pays the same long contexts and uneven lengths as the servers; the
"mean shape" one decodes B identical sequences of the workload's mean prompt and response
length (the same tokens per request without the mix), and is reported beside it. With
``LLAMA_SERVER=/path/to/llama-server`` set, the same workload also runs against llama.cpp's own
server (``-np`` = slots, same context per slot and threads, its defaults otherwise; building it:
``bench/README.md``).

Workload (:func:`workload`, fixed ``--seed``): 70 % short prompts (about 16 words), 30 % long
ones (about 150 words), and ``max_tokens`` drawn from a log-normal (median 48, sigma 1, so a
heavy tail) clipped to 4..400, with ``ignore_eos`` so every policy generates exactly the same
tokens. Per policy: requests/s and generated tokens/s sustained while every connection is busy
(:func:`summarize`; whole-run rates too), p50/p99 latency and time to first token (ms), errors;
then each policy ÷ ``fifo``, ``continuous`` ÷ ``static`` and tokens/s ÷ the limit (and
``continuous`` ÷ the mean-shape ceiling). ``--weights`` sets the weight format of the servers and
the ceilings alike (the server's ``--weights``; default ``auto``).
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

POLICIES = ("continuous", "static", "fifo")
WORDS = ("the sea wind stars ship harbor night light storm sailor map island river stone bird tree "
         "mountain road city market bread song story dream voice fire rain cloud moon sun field").split()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Request:
    """One request of the workload: a text prompt and the tokens to generate (EOS ignored)."""

    prompt: str
    max_tokens: int

    def body(self, stream: bool) -> dict:
        body = {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body


def workload(n: int, seed: int = 1234) -> list[Request]:
    """``n`` requests, the same for the same ``seed``: short and long prompts, heavy-tailed
    response lengths (see the module)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = 16 if rng.random() < 0.7 else 150
        prompt = f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(words))
        max_tokens = min(400, max(4, int(rng.lognormvariate(math.log(48), 1.0))))
        out.append(Request(prompt, max_tokens))
    return out


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks (numpy's
    default method); NaN for no values."""
    if not values:
        return float("nan")
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


@dataclass
class Sample:
    """One request as the driver saw it: start (s since the run began), time to first token and
    latency (ms; None after an error), generated tokens, the error if any, and when each piece
    of text arrived (s since the run began; one token each, as both servers stream)."""

    start_s: float
    ttft_ms: float | None
    latency_ms: float | None
    tokens: int
    error: str | None = None
    arrivals: tuple = ()

    @property
    def end_s(self) -> float:
        return self.start_s + (self.latency_ms or 0) / 1000


def summarize(samples: list[Sample], wall_s: float, busy_s: float | None = None) -> dict:
    """The per-policy figures of the JSON (see the module) from one driver run.

    ``req_per_s`` and ``gen_tok_per_s`` are sustained rates: requests answered and tokens
    received while every connection was busy (the first ``busy_s`` seconds, until one found the
    list empty), so the ramp-down of the last few requests, which says nothing about a policy,
    does not count; ``whole_run`` has the rates over the whole run. Latency and time to first
    token percentiles are over every answered request.
    """
    ok = [s for s in samples if s.error is None]
    busy_s = busy_s or wall_s
    return {"req_per_s": sum(s.end_s <= busy_s for s in ok) / busy_s,
            "gen_tok_per_s": sum(sum(t <= busy_s for t in s.arrivals) if s.arrivals else s.tokens * (s.end_s <= busy_s)
                                 for s in ok) / busy_s,
            "lat_p50_ms": percentile([s.latency_ms for s in ok], 50),
            "lat_p99_ms": percentile([s.latency_ms for s in ok], 99),
            "ttft_p50_ms": percentile([s.ttft_ms for s in ok if s.ttft_ms is not None], 50),
            "ttft_p99_ms": percentile([s.ttft_ms for s in ok if s.ttft_ms is not None], 99),
            "errors": len(samples) - len(ok), "requests": len(samples), "busy_s": busy_s, "wall_s": wall_s,
            "whole_run": {"req_per_s": len(ok) / wall_s, "gen_tok_per_s": sum(s.tokens for s in ok) / wall_s}}


def ratios(policies: dict, limit_tok_per_s: float, shape_tok_per_s: float | None = None) -> dict:
    """Requests/s of each policy ÷ ``fifo``'s, ``continuous`` ÷ ``static`` (requests/s and p50
    latency), each policy's generated tokens/s ÷ the limit (the replayed mix), and
    ``continuous``'s ÷ the mean-shape ceiling when given."""
    fifo = policies["fifo"]["req_per_s"]
    out = {f"{name}/fifo_req_per_s": p["req_per_s"] / fifo for name, p in policies.items()}
    out["continuous/static_req_per_s"] = policies["continuous"]["req_per_s"] / policies["static"]["req_per_s"]
    out["continuous/static_lat_p50"] = policies["continuous"]["lat_p50_ms"] / policies["static"]["lat_p50_ms"]
    out.update({f"{name}/limit_gen_tok_per_s": p["gen_tok_per_s"] / limit_tok_per_s for name, p in policies.items()})
    if shape_tok_per_s:
        out["continuous/limit_mean_shape_gen_tok_per_s"] = policies["continuous"]["gen_tok_per_s"] / shape_tok_per_s
    return out


def one_stream(port: int, req: Request, t0: float) -> Sample:
    start = time.perf_counter()
    ttft, tokens, arrivals = None, 0, []
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/v1/completions", json.dumps(req.body(stream=True)), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return Sample(start - t0, None, None, 0, f"HTTP {resp.status}")
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                break
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event.get("choices") and event["choices"][0].get("text"):
                now = time.perf_counter()
                arrivals.append(now - t0)
                if ttft is None:
                    ttft = (now - start) * 1000
        conn.close()
    except (OSError, http.client.HTTPException, ValueError) as e:
        return Sample(start - t0, None, None, 0, type(e).__name__)
    return Sample(start - t0, ttft, (time.perf_counter() - start) * 1000, tokens or len(arrivals),
                  arrivals=tuple(arrivals))


def drive(port: int, requests: list[Request], concurrency: int) -> tuple[list[Sample], float, float]:
    """Closed loop: ``concurrency`` connections, each sending the list's next request when its
    previous one ended. Returns the samples (in list order), the wall time and how long every
    connection was busy (s: until the first found the list empty)."""
    samples: list[Sample | None] = [None] * len(requests)
    lock, nxt, idle = threading.Lock(), [0], []
    t0 = time.perf_counter()

    def client():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
                if i >= len(requests):
                    idle.append(time.perf_counter() - t0)
                    return
            samples[i] = one_stream(port, requests[i], t0)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return samples, time.perf_counter() - t0, min(idle)


def run_wrk(port: int, requests: list[Request], concurrency: int, seconds: int) -> dict | None:
    """``wrk`` with ``bench/wrk_mix.lua`` over the list (non-streamed); None without wrk."""
    wrk = shutil.which("wrk")
    if wrk is None:
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for r in requests:
            f.write(json.dumps(r.body(stream=False)) + "\n")
    try:
        out = subprocess.run([wrk, "-t", "2", "-c", str(concurrency), "-d", f"{seconds}s", "--timeout", "600s",
                              "-s", os.path.join(ROOT, "bench", "wrk_mix.lua"), f"http://127.0.0.1:{port}"],
                             env={**os.environ, "WRK_BODIES": f.name}, capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    fields = dict(re.findall(r"(\w+)=([0-9.]+)", " ".join(line for line in out.stdout.splitlines()
                                                             if line.startswith("WRK_"))))
    duration = float(fields["duration_us"]) / 1e6
    return {"req_per_s": float(fields["requests"]) / duration, "gen_tok_per_s": float(fields["tokens"]) / duration,
            "lat_p50_ms": float(fields["p50_us"]) / 1000, "lat_p99_ms": float(fields["p99_us"]) / 1000,
            "errors": int(float(fields["errors"])), "requests": int(float(fields["requests"])), "seconds": duration}


def machine(threads: int, weights_file: str = "") -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    fmt = weights_file.rsplit(".", 2)[-2].upper() if weights_file.count(".") >= 2 else "?"
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)),
            "model": f"SmolLM2-135M-Instruct (bundled Q4_1 file), computed as {fmt}",
            "threads": threads, "python": platform.python_version()}


def peer(binary: str, requests: list[Request], a, max_seq_len: int, threads: int) -> dict:
    """llama.cpp's server at its defaults but slots, context and threads (ours)."""
    from bench.common import llama_server
    from engine.config import default_model_path

    with llama_server(binary, default_model_path(), "-np", str(a.slots), "-c", str(a.slots * max_seq_len),
                      threads=threads) as (port, _):
        one_stream(port, Request("warm up", 4), time.perf_counter())
        samples, wall, busy = drive(port, requests, a.concurrency)
        result = summarize(samples, wall, busy)
        result["samples"] = [[s.start_s, s.ttft_ms] for s in samples]
        result["wrk"] = run_wrk(port, requests, a.concurrency, a.wrk_seconds)
        return result


def table(result: dict) -> str:
    b = result["concurrency"]
    rows = [(f"limit: this mix replayed, bare llama_decode, B={b}", None, result["limit"]["gen_tok_per_s"]),
            (f"limit: mean shape, B={b}", None, result["limit"]["mean_shape"]["gen_tok_per_s"])]
    lines = ["| server | driver | req/s | gen tok/s | latency p50 / p99 ms | TTFT p50 / p99 ms | errors |",
             "|---|---|---|---|---|---|---|"]
    entries = [(name, p) for name, p in result["policies"].items()]
    if result.get("peer"):
        entries.append(("llama-server", result["peer"]))
    for name, p in entries:
        lines.append(f"| {name} | python, streaming | {p['req_per_s']:.2f} | {p['gen_tok_per_s']:.1f} | "
                     f"{p['lat_p50_ms']:.0f} / {p['lat_p99_ms']:.0f} | "
                     f"{p['ttft_p50_ms']:.0f} / {p['ttft_p99_ms']:.0f} | {p['errors']} |")
        w = p.get("wrk")
        if w:
            lines.append(f"| {name} | wrk, whole answers | {w['req_per_s']:.2f} | {w['gen_tok_per_s']:.1f} | "
                         f"{w['lat_p50_ms']:.0f} / {w['lat_p99_ms']:.0f} | n/a | {w['errors']} |")
    for label, _, tps in rows:
        lines.append(f"| {label} | | | {tps:.1f} | | | |")
    lines.append("")
    lines += [f"- {k}: **{v:.2f}**" for k, v in result["ratios"].items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    from bench.common import limit, limit_mix, save
    from engine.config import default_model_path, default_threads
    from engine.llama.tokenizer import Tokenizer
    from tests.support.servers import running_server

    p = argparse.ArgumentParser(prog="bench/run_bench.sh", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a smaller run (under 3 minutes here)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--requests", type=int, default=None, help="requests per policy (default 96; --quick 32)")
    p.add_argument("--wrk-seconds", type=int, default=None, help="default 30; --quick 10")
    p.add_argument("--engine-threads", type=int, default=0)
    p.add_argument("--weights", default="auto", help="weight format of the servers and the ceilings (server --weights)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    a.requests = a.requests or (32 if a.quick else 96)
    a.wrk_seconds = a.wrk_seconds or (10 if a.quick else 30)
    threads = a.engine_threads or default_threads()
    requests = workload(a.requests, a.seed)
    max_seq_len = 1024
    tokenizer = Tokenizer(default_model_path())
    prompts = [tokenizer.encode(r.prompt, add_bos=True) for r in requests]
    mean_prompt = round(sum(map(len, prompts)) / len(requests))
    mean_gen = round(sum(r.max_tokens for r in requests) / len(requests))
    result = {"machine": {}, "concurrency": a.concurrency, "slots": a.slots,
              "workload": {"requests": a.requests, "seed": a.seed,
                           "max_tokens": [r.max_tokens for r in requests],
                           "prompt_words": [len(r.prompt.split()) for r in requests]},
              "limit": {}, "policies": {}}
    mix = limit_mix(a.concurrency, [(p, r.max_tokens) for p, r in zip(prompts, requests)], a.engine_threads,
                    a.weights)
    shape = limit(a.concurrency, mean_prompt, mean_gen, a.engine_threads, a.weights)
    result["machine"] = machine(threads, mix["weights_file"])
    result["limit"] = {"gen_tok_per_s": mix["tokens_per_s"], "batch": a.concurrency, "weights": mix["weights"],
                       "whole_run_gen_tok_per_s": mix["whole_run_tokens_per_s"],
                       "mean_shape": {"gen_tok_per_s": shape["tokens_per_s"], "prompt_tokens": mean_prompt,
                                      "gen_tokens": mean_gen}}
    for policy in a.policies.split(","):
        flags = ["--policy", policy, "--max-slots", str(a.slots), "--max-seq-len", str(max_seq_len),
                 "--threads", str(a.concurrency + 4), "--engine-threads", str(a.engine_threads), "--weights", a.weights]
        with running_server(*flags) as server:
            one_stream(server.port, Request("warm up", 4), time.perf_counter())
            samples, wall, busy = drive(server.port, requests, a.concurrency)
            figures = summarize(samples, wall, busy)
            figures["samples"] = [[s.start_s, s.ttft_ms] for s in samples]
            server.wait_idle(60)
            figures["wrk"] = run_wrk(server.port, requests, a.concurrency, a.wrk_seconds)
        result["policies"][policy] = figures
        print(f"{policy}: {figures['req_per_s']:.2f} req/s, {figures['gen_tok_per_s']:.1f} tok/s", flush=True)
    if os.environ.get("LLAMA_SERVER"):
        result["peer"] = peer(os.environ["LLAMA_SERVER"], requests, a, max_seq_len, threads)
    if set(POLICIES) <= set(result["policies"]):
        result["ratios"] = ratios(result["policies"], result["limit"]["gen_tok_per_s"],
                                  result["limit"]["mean_shape"]["gen_tok_per_s"])
    else:
        result["ratios"] = {}
    print(table(result))
    save(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
