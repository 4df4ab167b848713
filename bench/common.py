"""Helpers shared by the benchmarks: a private engine, the ceiling in a child process."""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

from engine.client import EngineClient
from engine.config import EngineConfig
from engine.supervisor import EngineSupervisor


@contextlib.contextmanager
def engine(config: EngineConfig):
    """Yield an :class:`EngineClient` over a fresh transport and engine process."""
    supervisor = EngineSupervisor.create(config)
    try:
        supervisor.start()
        if not supervisor.wait_ready(120):
            raise RuntimeError("engine did not start")
        yield EngineClient(supervisor.t)
    finally:
        supervisor.stop()


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """Return once a peer server (``llama-server``) answers 200 at ``/health``.

    Raises:
        RuntimeError: it exited, or did not answer within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("llama-server exited")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("llama-server did not start")


@contextlib.contextmanager
def llama_server(binary: str, model_path: str, *flags: str, threads: int = 0):
    """llama.cpp's ``llama-server`` (the executable ``binary``) serving ``model_path`` on a free
    port: its defaults but ``flags``, ``-t threads`` (0: one per CPU this process may run on) and,
    where this CPU advertises AMX but faults on it, ``--no-repack`` (the engine then loads without
    llama.cpp's extra buffer types too, engine/llama/library.py; without the flag llama-server
    dies of SIGILL at start). Yields ``(port, process)`` once it answers at ``/health``; it is
    terminated after.

    Raises:
        RuntimeError: it exited or did not answer (the message ends with its log's tail).
    """
    from engine.llama.library import amx_faults
    from tests.support.servers import free_port

    port = free_port()
    repack = ["--no-repack"] if amx_faults(model_path) else []
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([binary, "-m", model_path, "--port", str(port), "-t",
                                 str(threads or len(os.sched_getaffinity(0))), *repack, *flags],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                wait_healthy(port, proc)
            except RuntimeError as e:
                log.seek(0)
                raise RuntimeError(f"{e}: {log.read()[-2000:].decode(errors='replace')}") from None
            yield port, proc
        finally:
            proc.terminate()
            proc.wait(30)


def tree_memory(pid: int) -> dict:
    """Resident memory of process ``pid`` and every descendant (children of any of its threads,
    recursively), summed from ``/proc/<pid>/smaps_rollup``: ``rss_mib`` (each process's resident
    pages; pages two processes share count twice), ``pss_mib`` (proportional: a page shared by n
    processes counts 1/n in each, so the sum is what the tree holds, less its share of pages that
    processes outside it map too) and ``processes``. A process that ends during the walk is left
    out."""
    totals, seen, todo = {"Rss": 0, "Pss": 0}, 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                kib = {k.rstrip(":"): int(v) for k, v, *_ in map(str.split, f) if k.rstrip(":") in totals}
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
        seen += 1
        for key in totals:
            totals[key] += kib.get(key, 0)
    return {"rss_mib": totals["Rss"] / 1024, "pss_mib": totals["Pss"] / 1024, "processes": seen}


def limit(batch: int, prompt: int, gen: int, threads: int = 0, weights: str = "auto", all_logits: bool = False) -> dict:
    """Run ``python -m bench.limit`` in a child process (its own llama.cpp) and return its JSON."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "bench.limit", "--batch", str(batch), "--prompt-tokens",
                        str(prompt), "--gen-tokens", str(gen), "--engine-threads", str(threads), "--weights", weights,
                        "--json", f.name] + (["--all-logits"] if all_logits else []),
                       check=True, stdout=subprocess.DEVNULL)
        return json.load(open(f.name))


def limit_mix(batch: int, requests: list[tuple[list[int], int]], threads: int = 0, weights: str = "auto") -> dict:
    """Run ``python -m bench.limit --mix`` over ``requests`` (prompt token ids, tokens to
    generate) in a child process and return its JSON."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as mix, tempfile.NamedTemporaryFile(suffix=".json") as f:
        json.dump(requests, mix)
        mix.flush()
        subprocess.run([sys.executable, "-m", "bench.limit", "--batch", str(batch), "--mix", mix.name,
                        "--engine-threads", str(threads), "--weights", weights, "--json", f.name],
                       check=True, stdout=subprocess.DEVNULL)
        return json.load(open(f.name))


def parser(prog: str, doc: str, batch_flag: str):
    """Flags every comparison benchmark takes: B (named ``batch_flag``), P, G, threads, JSON."""
    import argparse

    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    p.add_argument(batch_flag, type=int, default=16, dest="batch")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--engine-threads", type=int, default=0, help="0: the engine's default")
    p.add_argument("--json", default=None, help="also write the result here")
    return p


def report(label: str, tokens_per_s: float, before: dict, after: dict, json_path: str | None,
           **extra) -> dict:
    """Ratio of ``tokens_per_s`` to the mean of two ceiling runs; printed and optionally saved."""
    ceiling = (before["tokens_per_s"] + after["tokens_per_s"]) / 2
    result = {"tokens_per_s": tokens_per_s, "limit_tokens_per_s": ceiling,
              "limit_runs": [before["tokens_per_s"], after["tokens_per_s"]],
              "ratio": tokens_per_s / ceiling, "batch": before["batch"],
              "prompt_tokens": before["prompt_tokens"], "gen_tokens": before["gen_tokens"],
              "threads": before["threads"], **extra}
    print(f"{label}: {tokens_per_s:.1f} generated tok/s; limit {ceiling:.1f} tok/s (runs "
          f"{before['tokens_per_s']:.1f}, {after['tokens_per_s']:.1f}); ratio {result['ratio']:.3f}")
    save(result, json_path)
    return result


def save(result: dict, json_path: str | None) -> None:
    """Write a benchmark's result as JSON when ``--json`` named a file."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)


def concurrently(n_clients: int, work: Callable[[int], None]) -> float:
    """Run ``work(client index)`` in ``n_clients`` threads at once; returns the wall time in
    seconds from the first start to the last end."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0
