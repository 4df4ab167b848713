"""KV memory by use (issue 23, point 3): the model's whole context for any request, at the
default settings, without the KV memory of 16 full-length slots.

    python -m bench.kv_memory [--model PATH] [--rounds 1] [--json out.json]

One server at the defaults but ``--threads`` (8,192 tokens a sequence, ``--kv-cache-tokens``
32,768; its engine started fresh) on ``--model`` (default: the bundled SmolLM2-135M; any GGUF,
whatever its KV cache layout: the server's ``--chat-template`` is not needed, the prompts are
completions), then:

* ``start``: the engine process's resident memory after start (``VmRSS``, and ``Pss``: its
  share of pages shared with other processes, the model file's among them) and its peak so far
  (``VmHWM``: llama.cpp clears the whole KV buffer before the unused pages go back), MiB;
* ``long``: one 8,000-token prompt, 16 tokens (``ignore_eos``): time to answer (ms), its
  ``prompt_tokens``;
* ``many``: 16 clients, 32 requests of a 2,000-token prompt and 128 tokens (``ignore_eos``),
  streamed: requests/s, errors, and the preemptions the engine counted
  (``inference_preemptions_total``; 16 × 2,128 cells is more than the 32,768 of the budget);
* ``after``: the engine's resident memory after those (the prefix cache full), MiB.

The memory before this design (every slot a resident stream of 2,048 cells) is the same
``start`` figure measured on the commit before it; ``bench/RESULTS.md`` gives both.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from bench.common import save
from bench.policies import Request, drive
from bench.prefill import Prompts

MIB = 1 << 20


def engine_memory(pid: int) -> dict:
    """``VmRSS``, ``VmHWM`` and ``Pss`` of process ``pid``, MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(line.split()[1]) * 1024 / MIB
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                out["Pss"] = int(line.split()[1]) * 1024 / MIB
    return out


def run_long(port: int, prompts: Prompts) -> dict:
    """One 8,000-token prompt: time to answer and the usage the server counted."""
    import http.client

    body = json.dumps({"prompt": prompts.make(8000), "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    ms = (time.perf_counter() - t0) * 1000
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {data}")
    return {"ms": ms, "prompt_tokens": data["usage"]["prompt_tokens"],
            "completion_tokens": data["usage"]["completion_tokens"]}


def run_many(port: int, prompts: Prompts, engine) -> dict:
    """16 clients, 32 requests of 2,000 prompt tokens and 128 generated: none may fail."""
    before = engine.snapshot().preemptions
    samples, wall, _ = drive(port, [Request(prompts.make(2000), 128) for _ in range(32)], 16)
    ok = [s for s in samples if s.error is None]
    return {"req_per_s": len(ok) / wall, "errors": len(samples) - len(ok),
            "tokens": sum(s.tokens for s in ok), "preemptions": engine.snapshot().preemptions - before}


def main(argv=None) -> int:
    from engine.config import default_model_path
    from engine.llama.tokenizer import Tokenizer
    from tests.support.servers import running_server

    p = argparse.ArgumentParser(prog="python -m bench.kv_memory", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF to serve (default: the bundled SmolLM2-135M)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    model = a.model or default_model_path()
    prompts = Prompts(Tokenizer(model))
    result = {"model": model, "rounds": []}
    with running_server("--threads", "48", "--grpc-port", "0", env={"MODEL_PATH": model}) as server:
        pid = server.engine.t.control.engine_pid
        result["start"] = engine_memory(pid)
        print("start", json.dumps(result["start"]), flush=True)
        for r in range(a.rounds):
            one = {"long": run_long(server.port, prompts), "many": run_many(server.port, prompts, server.engine)}
            one["after"] = engine_memory(pid)
            print(f"round {r + 1}", json.dumps(one), flush=True)
            result["rounds"].append(one)
    save(result, a.json)
    return 0 if all(r["many"]["errors"] == 0 for r in result["rounds"]) else 1


if __name__ == "__main__":
    sys.exit(main())
