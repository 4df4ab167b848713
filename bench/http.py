"""HTTP throughput and time to first token against the ceiling, in one run.

    python -m bench.http [--clients 16 --prompt-tokens 32 --gen-tokens 128] [--json out.json]

Starts a real ``inference-server`` (gunicorn + engine) on a free port, then:

* throughput: ``--clients`` concurrent streaming ``/v1/completions`` clients, a prompt of about
  P tokens each, ``max_tokens`` G with ``ignore_eos``; generated tokens/s = total completion
  tokens over the wall time from the first request sent to the last ``[DONE]``. Divided by
  ``bench.limit`` (B = clients, same P and G) run before and after, in child processes.
  ``--repeat`` runs alternate with ceiling runs; the median ratio is reported (the machine is
  noisy: one run's ratio has varied between 0.91 and 1.02).
* TTFT overhead: a lone streaming request on the idle server; time to the first token seen by
  the client minus the engine's own prefill time for the same prompt (taken from the engine's
  mailbox timestamps of that same request: admission to the end of its prefill decode).
  Medians of ``--ttft-runs``.
"""
from __future__ import annotations

import http.client
import json
import statistics
import sys
import time


#: Seconds after a ceiling run before the server is measured again: two of the engine's 0.5 s
#: samples of the CPUs' use (engine/threads.py), so it is back to its idle-machine thread count.
SETTLE_S = 1.5


def stream_completion(port: int, prompt: str, max_tokens: int, key: str | None = None) -> tuple[float, float, int]:
    """One streaming request (with API ``key`` if given); returns (seconds to first token,
    seconds to [DONE], tokens)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request("POST", "/v1/completions", body, headers)
    resp = conn.getresponse()
    first, tokens = None, 0
    for line in resp:
        if not line.startswith(b"data: "):
            continue
        if first is None:
            first = time.perf_counter() - t0
        if line.strip() == b"data: [DONE]":
            break
        if b'"choices":[]' in line:  # the usage chunk; the client parses no other (it shares the CPUs)
            tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    done = time.perf_counter() - t0
    conn.close()
    return first, done, tokens


def prompt_text(tokenizer, n_tokens: int, salt: int) -> str:
    """A text prompt of about ``n_tokens`` tokens, different per ``salt``."""
    words = f"Client {salt} asks: tell a long story about the sea, the wind and the stars".split()
    text = ""
    while len(tokenizer.encode(text + " " + words[len(text.split()) % len(words)])) <= n_tokens:
        text += " " + words[len(text.split()) % len(words)]
    return text.strip()


def workload(a) -> tuple[list[str], list[str]]:
    """This benchmark's prompts (``a.batch`` of about ``a.prompt_tokens`` tokens) and server flags
    (a slot per client, room for prompt and generation, ``a.workers`` and ``a.engine_threads``),
    from the parsed flags of :func:`bench.common.parser` plus ``--workers``."""
    from engine.config import default_model_path
    from engine.llama.tokenizer import Tokenizer

    B, P, G = a.batch, a.prompt_tokens, a.gen_tokens
    tokenizer = Tokenizer(default_model_path())
    prompts = [prompt_text(tokenizer, P, i) for i in range(B)]
    flags = ["--max-slots", str(B), "--max-seq-len", str(max(256, P + G + 8)), "--workers", str(a.workers),
             "--threads", str(B + 4), "--engine-threads", str(a.engine_threads)]
    return prompts, flags


def throughput(port: int, prompts: list[str], gen: int, key: str | None = None) -> tuple[float, int]:
    """All prompts streamed at once, one client thread each; returns (tokens/s, tokens)."""
    from bench.common import concurrently

    results = [None] * len(prompts)

    def client(i):
        results[i] = stream_completion(port, prompts[i], gen, key)

    wall = concurrently(len(prompts), client)
    generated = sum(r[2] for r in results)
    return generated / wall, generated


def main(argv=None) -> int:
    from bench.common import limit, parser, report
    from engine.config import default_model_path
    from engine.llama.tokenizer import Tokenizer
    from tests.support.servers import running_server

    p = parser("python -m bench.http", __doc__, "--clients")
    p.add_argument("--ttft-runs", type=int, default=15)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3, help="throughput runs, each between two ceiling runs")
    a = p.parse_args(argv)
    B, P, G = a.batch, a.prompt_tokens, a.gen_tokens
    prompts, flags = workload(a)
    limits, runs = [limit(B, P, G, a.engine_threads)], []
    with running_server(*flags) as server:
        stream_completion(server.port, prompts[0], 4)  # warm-up
        for _ in range(a.repeat):  # the idle server sleeps while the ceiling runs
            runs.append(throughput(server.port, prompts, G))
            server.wait_idle()
            limits.append(limit(B, P, G, a.engine_threads))
            # The idle engine saw the ceiling take the CPUs (engine/threads.py samples while idle);
            # let it see them free again, as a server on an otherwise idle machine would.
            time.sleep(SETTLE_S)

        ttft, prefill = [], []
        boxes = server.engine.t.mailboxes.boxes
        for _ in range(a.ttft_runs):
            ttft.append(stream_completion(server.port, prompts[0], 1)[0])
            # The request's mailbox keeps its engine timestamps until it is leased again.
            i = int(boxes["t_queued"].argmax())
            prefill.append(float(boxes["t_prefill_done"][i] - boxes["t_admitted"][i]))
        ids = Tokenizer(default_model_path()).encode(prompts[0], add_bos=True)
    ratios = [tps / ((limits[k]["tokens_per_s"] + limits[k + 1]["tokens_per_s"]) / 2)
              for k, (tps, _) in enumerate(runs)]
    median = sorted(range(len(runs)), key=lambda k: ratios[k])[len(runs) // 2]
    ttft_ms, prefill_ms = statistics.median(ttft) * 1000, statistics.median(prefill) * 1000
    print("ceiling runs (tok/s): " + ", ".join(f"{lim['tokens_per_s']:.1f}" for lim in limits))
    print("HTTP runs (tok/s, ratio): " + ", ".join(f"{tps:.1f} {r:.3f}" for (tps, _), r in zip(runs, ratios)))
    report("HTTP streaming (median run)", runs[median][0], limits[median], limits[median + 1], a.json,
           generated_tokens=runs[median][1], ratios=ratios,
           ttft_ms_median=ttft_ms, engine_prefill_ms_median=prefill_ms,
           ttft_overhead_ms=ttft_ms - prefill_ms, ttft_prompt_tokens=len(ids))
    print(f"TTFT of a lone request: {ttft_ms:.2f} ms; engine prefill {prefill_ms:.2f} ms; "
          f"overhead {ttft_ms - prefill_ms:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
