"""Long prompts: this server against itself with ``--deterministic`` and, if given, llama.cpp's
``llama-server`` on the same weights, in alternating rounds (issue 23's table).

    python -m bench.prefill [--llama-server PATH] [--rounds 3] [--only cold,distinct8,...]
                            [--one-at-a-time] [--json out.json]

Workloads (``/v1/completions``, greedy, text prompts made of words so each is about the given
number of tokens with this model's tokenizer; prompts differ between rounds and servers, so no
run finds another's in a prefix cache):

* ``cold``: one 1,440-token prompt, ``max_tokens`` 1, alone: time to answer (ms).
* ``distinct8``: 8 clients, 16 distinct 860-token prompts, 64 tokens each (``ignore_eos``),
  streamed: requests/s over the wall time and time to first token p50 (ms).
* ``stream``: one stream of 512 tokens (``ignore_eos``) after a 20-token prompt: tokens/s.
* ``fixed``: 16 clients, 48 requests of a 32-token prompt and 128 tokens (``ignore_eos``),
  streamed: generated tokens/s.
* ``mix``: 16 clients, 64 requests of ``bench.policies``' heavy-tailed workload (short and long
  prompts, lognormal ``max_tokens``), streamed: requests/s and generated tokens/s while every
  client was busy (the latter to hold against ``bench.limit --mix``'s ceiling of the same work).
* ``itl``: 15 streams of 256 tokens running, then one 4,000-token prompt (``max_tokens`` 1):
  the inter-token gaps of the running streams while it is prefilled (from its send to its
  answer) against their gaps before it was sent, p50 and p99 (ms). Run with ``--only itl``:
  its servers are started with ``--max-seq-len 4352`` (llama-server: the same context a slot).

Servers: ``ours`` (the defaults but ``--threads``, the gunicorn request threads),
``deterministic`` (the same with ``--deterministic``; its price), ``llama-server`` (at its
defaults but ``-np 16 -c 16 x max-seq-len -t CPUs`` (and ``--no-repack`` where this CPU faults
on AMX, as the engine loads), given the Q8_0 file this server converts the bundled model to, so
both compute with the same weights), ``ceiling`` (no server: ``fixed``'s and ``mix``'s work in
``bench.limit``'s bare decode loop, each round, so both servers can be held to what this machine
allows at the time). Each round runs every workload on every server, one server after the other;
the figures are the medians over the rounds, and the ratios of each median, ours ÷ llama-server
and ours ÷ deterministic (per second: > 1 is better; milliseconds: < 1 is better), and each
server ÷ ceiling; also ours ÷ llama-server within each round (the two ran minutes apart), whose
spread shows how far this machine's noise moves a ratio. ``--one-at-a-time`` starts each server for its turn of a round (every
workload) and stops it after, so no other server is resident while one is measured (an idle
``llama-server`` beside ours seemed to slow ours: bench/RESULTS.md, "On an AVX2 machine").
"""
from __future__ import annotations

import http.client
import json
import os
import statistics
import sys
import threading
import time

from bench.common import limit, limit_mix, llama_server, save
from bench.policies import Request, drive, one_stream, percentile, summarize, workload

WORDS = ("harbor lantern meadow orchard granite willow ember falcon compass tide glacier canyon thistle "
         "saffron beacon quarry marble juniper cobalt velvet prairie summit cedar bramble delta").split()
WORKLOADS = ("cold", "distinct8", "stream", "fixed", "mix", "itl")
#: Context a slot for the ``itl`` workload's servers: its 4,000-token prompt and the streams' 256.
ITL_MAX_SEQ_LEN = 4352


class Prompts:
    """Text prompts of a given token count (this model's tokenizer), new ones on every call."""

    def __init__(self, tokenizer):
        self.tokenizer, self.n = tokenizer, 0

    def make(self, n_tokens: int) -> str:
        """A prompt of about ``n_tokens`` tokens that starts with its own serial number."""
        self.n += 1
        words = [f"Document {self.n}:"] + [WORDS[(self.n * 7 + i * i) % len(WORDS)] for i in range(n_tokens)]
        ids = self.tokenizer.encode(" ".join(words), add_bos=False)[:n_tokens - 1]
        return self.tokenizer.decode(ids)


def completion(port: int, prompt: str, max_tokens: int) -> float:
    """One unstreamed completion; seconds to the answer."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    elapsed = time.perf_counter() - t0
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {data[:200]!r}")
    return elapsed


def run_cold(port: int, prompts: Prompts) -> dict:
    return {"ms": completion(port, prompts.make(1440), 1) * 1000}


def run_distinct8(port: int, prompts: Prompts) -> dict:
    requests = [Request(prompts.make(860), 64) for _ in range(16)]
    samples, wall, _ = drive(port, requests, 8)
    ok = [s for s in samples if s.error is None]
    return {"req_per_s": len(ok) / wall, "ttft_p50_ms": percentile([s.ttft_ms for s in ok], 50),
            "errors": len(samples) - len(ok)}


def run_stream(port: int, prompts: Prompts) -> dict:
    s = one_stream(port, Request(prompts.make(20), 512), time.perf_counter())
    return {"tok_per_s": s.tokens / (s.latency_ms / 1000), "tokens": s.tokens}


def run_fixed(port: int, prompts: Prompts) -> dict:
    samples, wall, _ = drive(port, [Request(prompts.make(32), 128) for _ in range(48)], 16)
    ok = [s for s in samples if s.error is None]
    return {"tok_per_s": sum(s.tokens for s in ok) / wall, "errors": len(samples) - len(ok)}


def mix_requests(prompts: Prompts) -> list[Request]:
    """``mix``'s 64 requests, new ones on every call."""
    return [Request(f"{prompts.make(4)} {r.prompt}", r.max_tokens) for r in workload(64, seed=prompts.n)]


def run_mix(port: int, prompts: Prompts) -> dict:
    samples, wall, busy = drive(port, mix_requests(prompts), 16)
    s = summarize(samples, wall, busy)
    return {"req_per_s": s["req_per_s"], "gen_tok_per_s": s["gen_tok_per_s"], "errors": s["errors"]}


def gaps(arrivals, start: float, end: float) -> list[float]:
    """Gaps (ms) between consecutive arrivals whose later one falls in ``[start, end)``."""
    return [(b - a) * 1000 for a, b in zip(arrivals, arrivals[1:]) if start <= b < end]


def run_itl(port: int, prompts: Prompts) -> dict:
    """15 running streams, then a 4,000-token prompt: their gaps during its prefill vs before."""
    t0 = time.perf_counter()
    samples = [None] * 15
    threads = [threading.Thread(target=lambda i=i: samples.__setitem__(i, one_stream(
        port, Request(prompts.make(24), 256), t0))) for i in range(15)]
    for t in threads:
        t.start()
    time.sleep(4.0)  # every stream admitted and decoding
    sent = time.perf_counter() - t0
    answered = sent + completion(port, prompts.make(4000), 1)
    for t in threads:
        t.join()
    before = [g for s in samples for g in gaps(s.arrivals, 1.0, sent)]
    during = [g for s in samples for g in gaps(s.arrivals, sent, answered)]
    return {"prefill_ms": (answered - sent) * 1000, "before_p50_ms": percentile(before, 50),
            "before_p99_ms": percentile(before, 99), "during_p50_ms": percentile(during, 50),
            "during_p99_ms": percentile(during, 99), "errors": sum(s.error is not None for s in samples)}


def ceiling_fixed(prompts: Prompts) -> dict:
    """``fixed``'s work in a bare decode loop (``bench.limit``): 16 lanes of a 32-token prompt and
    128 tokens, prefill included."""
    return {"tok_per_s": limit(16, 32, 128)["tokens_per_s"]}


def ceiling_mix(prompts: Prompts) -> dict:
    """``mix``'s work (the same kind of 64 requests, tokenized as the server does) replayed over 16
    lanes by ``bench.limit --mix``: generated tokens/s while every lane was busy."""
    requests = [(prompts.tokenizer.encode(r.prompt, add_bos=True), r.max_tokens) for r in mix_requests(prompts)]
    return {"gen_tok_per_s": limit_mix(16, requests)["tokens_per_s"]}


#: The hardware ceiling of the workloads that have one (``--servers ...,ceiling``).
CEILINGS = {"fixed": ceiling_fixed, "mix": ceiling_mix}
RUNS = {"cold": run_cold, "distinct8": run_distinct8, "stream": run_stream, "fixed": run_fixed, "mix": run_mix,
        "itl": run_itl}


def main(argv=None) -> int:
    import argparse
    import contextlib

    from engine.config import EngineConfig, default_model_path
    from engine.llama.tokenizer import Tokenizer
    from engine.llama.weights import weights_path
    from tests.support.servers import running_server

    p = argparse.ArgumentParser(prog="python -m bench.prefill", description=__doc__.split("\n")[0])
    p.add_argument("--llama-server", default=None, help="path of a llama-server binary to compare with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default="cold,distinct8,stream,fixed,mix",
                   help="comma-separated workloads, of " + ", ".join(WORKLOADS))
    p.add_argument("--servers", default="ours,deterministic,llama-server",
                   help="comma-separated, of ours, deterministic, llama-server (only with --llama-server) and "
                        "ceiling (bench.limit's bare decode loop, for fixed and mix)")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="start each server for its turn and stop it after (never two up at once)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    names = [w for w in a.only.split(",") if w]
    if any(w not in WORKLOADS for w in names) or ("itl" in names and len(names) > 1):
        p.error(f"--only takes workloads of {', '.join(WORKLOADS)}; itl runs alone")
    servers = [s for s in a.servers.split(",") if s and (s != "llama-server" or a.llama_server)]
    max_seq_len = ITL_MAX_SEQ_LEN if names == ["itl"] else EngineConfig.max_seq_len
    slots, cpus = EngineConfig.max_slots, len(os.sched_getaffinity(0))
    ours_flags = ["--threads", "48", "--grpc-port", "0"] + (["--max-seq-len", str(max_seq_len)]
                                                             if names == ["itl"] else [])
    tokenizer = Tokenizer(default_model_path())
    prompts = Prompts(tokenizer)
    runs = {s: {w: [] for w in names} for s in servers}
    def start(s: str, stack: contextlib.ExitStack) -> int:
        """Start server ``s`` (stopped when ``stack`` closes), warmed up; returns its port."""
        if s == "ceiling":
            return 0  # no server: the workload's ceiling runs in a child process of its own
        if s == "llama-server":
            port, _ = stack.enter_context(llama_server(a.llama_server, weights_path(default_model_path(), "auto"),
                                                       "-np", str(slots), "-c", str(slots * max_seq_len)))
        else:
            extra = ["--deterministic"] if s == "deterministic" else []
            port = stack.enter_context(running_server(*ours_flags, *extra)).port
        completion(port, "warm up", 4)
        return port

    def turn(r: int, w: str, s: str, port: int) -> None:
        if s == "ceiling" and w not in CEILINGS:
            return
        result = CEILINGS[w](prompts) if s == "ceiling" else RUNS[w](port, prompts)
        runs[s][w].append(result)
        print(f"round {r + 1} {w} {s}: {json.dumps({k: round(v, 1) for k, v in result.items()})}", flush=True)

    if a.one_at_a_time:  # a server's whole turn (every workload) with no other server resident
        for r in range(a.rounds):
            for s in servers if r % 2 == 0 else servers[::-1]:
                with contextlib.ExitStack() as stack:
                    port = start(s, stack)
                    for w in names:
                        turn(r, w, s, port)
    else:
        with contextlib.ExitStack() as stack:
            ports = {s: start(s, stack) for s in servers}
            for r in range(a.rounds):
                order = servers if r % 2 == 0 else servers[::-1]  # alternate who goes first
                for w in names:
                    for s in order:
                        turn(r, w, s, ports[s])
    medians = {s: {w: {k: statistics.median(x[k] for x in runs[s][w]) for k in runs[s][w][0]} for w in names
                   if runs[s][w]} for s in servers}
    result = {"rounds": a.rounds, "runs": runs, "medians": medians, "cpus": cpus}
    for mine, peer in (("ours", "llama-server"), ("ours", "deterministic"), ("ours", "ceiling"),
                       ("llama-server", "ceiling")):
        if peer in medians and mine in medians:
            result[f"{mine}/{peer}"] = {w: {k: medians[mine][w][k] / medians[peer][w][k] for k in medians[peer][w]
                                            if k != "errors" and medians[peer][w][k] and k in medians[mine][w]}
                                        for w in names if w in medians[peer] and w in medians[mine]}
    if "ours" in runs and "llama-server" in runs:  # the same round's pair: how far noise moves a ratio
        result["ours/llama-server by round"] = {
            w: {k: [round(a[k] / b[k], 3) for a, b in zip(runs["ours"][w], runs["llama-server"][w]) if b.get(k)]
                for k in runs["ours"][w][0] if k != "errors"} for w in names if runs["ours"][w]}
    print(json.dumps({"medians": medians, **{k: v for k, v in result.items() if "/" in k}}, indent=1))
    save(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
