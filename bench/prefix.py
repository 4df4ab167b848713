"""Prefix cache: the same workloads with the cache on and off (and, if given, llama.cpp's
``llama-server``), in one run.

    python -m bench.prefix [--clients 16 --requests 48] [--llama-server PATH] [--json out.json]

Starts two real servers (``inference-server`` with its default prefix cache, and with
``--no-prefix-cache``), both ``--max-slots`` = clients, and runs on each, one after the other:

* chat: ``--requests`` streaming chat completions from ``--clients`` concurrent clients, every
  one with the same system prompt (about 250 tokens) and its own question, ``max_tokens`` 128
  with ``ignore_eos``, greedy. Generated tokens/s over the wall time, and the median time to
  first token (request sent to the first chunk carrying text).
* conversations: each client holds a 4-turn conversation (the whole history sent every turn,
  ``max_tokens`` 32 with ``ignore_eos``); prompt tokens actually prefilled, the sum of
  ``prompt_tokens - cached_tokens`` from the returned usage.
* distinct: ``bench.http``'s workload (``/v1/completions``, prompts that share no prefix, 32
  tokens, 128 generated); generated tokens/s. With ``--distinct-repeat N`` it also runs N more
  times on each server, alternating, with both up, and reports the ratio of the medians.

Reported as ratios, cache on / cache off. With ``--llama-server`` the chat workload also runs
against ``llama-server -m <model> --port P -np <clients>`` at its defaults (prompt cache on), and
once more with ``cache_prompt: false`` in every request.
"""
from __future__ import annotations

import http.client
import json
import statistics
import subprocess
import sys
import time

from bench.common import concurrently, save

SYSTEM = ("You are the concierge of the Grand Harbour Hotel. Guests ask about rooms, meals, transport "
          "and the town. Answer warmly and briefly, recommend only services listed here, and never "
          "promise prices. Breakfast is served from seven to ten in the garden room, dinner from six "
          "to eleven on the terrace. The spa opens at nine and closes at eight; the pool is heated "
          "from May to October. Taxis wait at the main entrance, the airport shuttle leaves every "
          "hour from six in the morning, and bicycles can be borrowed at the front desk. ") * 2
QUESTIONS = ["When is breakfast?", "Is the pool open in winter?", "How do I get to the airport?",
             "Can I borrow a bicycle?", "Where is dinner served?", "When does the spa open?",
             "Is there a taxi at night?", "What can I do in town?"]


def chat_stream(port: int, messages: list[dict], max_tokens: int, extra: dict | None = None,
                headers: dict | None = None, host: str = "127.0.0.1") -> dict:
    """One streaming chat completion to ``host:port`` (``headers`` added to the request's);
    ``{"ttft", "done", "usage", "text"}`` (seconds)."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}, **(extra or {})})
    conn = http.client.HTTPConnection(host, port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    ttft, usage, text = None, None, []
    for line in resp:
        if not line.startswith(b"data: {"):
            if line.strip() == b"data: [DONE]":
                break
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                text.append(piece)
                if ttft is None:
                    ttft = time.perf_counter() - t0
    done = time.perf_counter() - t0
    conn.close()
    return {"ttft": ttft if ttft is not None else done, "done": done, "usage": usage, "text": "".join(text)}


def chat_workload(port: int, clients: int, requests: int, extra: dict | None = None) -> dict:
    """The shared-system-prompt chat workload: generated tok/s and TTFT p50 (ms)."""
    results = []

    def work(i):
        for r in range(i, requests, clients):
            messages = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"{QUESTIONS[r % len(QUESTIONS)]} (room {100 + r})"}]
            results.append(chat_stream(port, messages, 128, extra))

    wall = concurrently(clients, work)
    generated = sum(r["usage"]["completion_tokens"] for r in results)
    return {"tokens_per_s": generated / wall, "ttft_p50_ms": statistics.median(r["ttft"] for r in results) * 1000,
            "requests": len(results), "generated": generated}


def conversation_workload(port: int, clients: int, turns: int = 4) -> dict:
    """Every client holds a ``turns``-turn conversation; prompt tokens prefilled and reused."""
    usages = []

    def work(i):
        messages = [{"role": "system", "content": SYSTEM}]
        for t in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[(i + t) % len(QUESTIONS)]})
            r = chat_stream(port, messages, 32)
            usages.append(r["usage"])
            messages.append({"role": "assistant", "content": r["text"]})

    concurrently(clients, work)
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usages)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "prefilled_tokens": prompt - cached}


def distinct_workload(port: int, clients: int, requests: int, tokenizer, salt: int = 0) -> dict:
    """``/v1/completions`` prompts that share nothing (``bench.http``; ``salt`` makes a new set):
    generated tok/s."""
    from bench.http import prompt_text, stream_completion

    prompts = [prompt_text(tokenizer, 32, 10_000 * salt + i) for i in range(requests)]
    generated = []

    def work(i):
        for r in range(i, requests, clients):
            generated.append(stream_completion(port, prompts[r], 128)[2])

    wall = concurrently(clients, work)
    return {"tokens_per_s": sum(generated) / wall}


def llama_server(binary: str, model: str, port: int, slots: int) -> subprocess.Popen:
    """``llama-server`` at its defaults but ``-np``; returns once ``/health`` answers 200."""
    proc = subprocess.Popen([binary, "-m", model, "--port", str(port), "-np", str(slots)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("llama-server did not start")


def main(argv=None) -> int:
    import argparse

    from engine.config import default_model_path
    from engine.llama.tokenizer import Tokenizer
    from tests.support.servers import free_port, running_server

    p = argparse.ArgumentParser(prog="python -m bench.prefix", description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--llama-server", default=None, help="path of a llama-server binary to compare with")
    p.add_argument("--distinct-repeat", type=int, default=0,
                   help="then run the distinct-prompt workload this many more times on each server, "
                        "alternating, both servers up (new prompts every run); medians")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    tokenizer = Tokenizer(default_model_path())
    flags = ["--max-slots", str(a.clients), "--max-seq-len", "1024", "--threads", str(a.clients + 4)]
    results = {}
    for name, extra in (("off", ["--no-prefix-cache"]), ("on", [])):
        with running_server(*flags, *extra) as server:
            chat_stream(server.port, [{"role": "user", "content": "Hi"}], 4)  # warm-up
            results[name] = {"chat": chat_workload(server.port, a.clients, a.requests)}
            server.wait_idle()
            results[name]["conversations"] = conversation_workload(server.port, a.clients)
            server.wait_idle()
            results[name]["distinct"] = distinct_workload(server.port, a.clients, a.requests, tokenizer)
        print(name, json.dumps(results[name]))
    on, off = results["on"], results["off"]
    results["ratios"] = {
        "chat_tokens_per_s": on["chat"]["tokens_per_s"] / off["chat"]["tokens_per_s"],
        "chat_ttft_p50": on["chat"]["ttft_p50_ms"] / off["chat"]["ttft_p50_ms"],
        "conversation_prefilled_tokens": on["conversations"]["prefilled_tokens"]
        / off["conversations"]["prefilled_tokens"],
        "distinct_tokens_per_s": on["distinct"]["tokens_per_s"] / off["distinct"]["tokens_per_s"],
    }
    if a.llama_server:
        port = free_port()
        proc = llama_server(a.llama_server, default_model_path(), port, a.clients)
        try:
            chat_stream(port, [{"role": "user", "content": "Hi"}], 4)
            results["llama_server"] = chat_workload(port, a.clients, a.requests)
            results["llama_server_no_cache"] = chat_workload(port, a.clients, a.requests, {"cache_prompt": False})
        finally:
            proc.terminate()
            proc.wait()
        print("llama-server", json.dumps(results["llama_server"]), json.dumps(results["llama_server_no_cache"]))
    if a.distinct_repeat:
        runs = {"on": [], "off": []}
        with running_server(*flags) as on_server, running_server(*flags, "--no-prefix-cache") as off_server:
            for k in range(a.distinct_repeat):
                for name, server in (("on", on_server), ("off", off_server)):
                    runs[name].append(distinct_workload(server.port, a.clients, a.requests, tokenizer,
                                                        salt=1 + 2 * k + (name == "off"))["tokens_per_s"])
        results["distinct_alternating"] = runs
        ratio = statistics.median(runs["on"]) / statistics.median(runs["off"])
        results["ratios"]["distinct_alternating_median"] = ratio
        print("distinct prompts, alternating (tok/s): on " + ", ".join(f"{v:.1f}" for v in runs["on"]) + "; off "
              + ", ".join(f"{v:.1f}" for v in runs["off"])
              + f"; medians on / off {ratio:.3f}")
    r = results["ratios"]
    print(f"cache on / off: chat {r['chat_tokens_per_s']:.3f}x tok/s ({on['chat']['tokens_per_s']:.1f} vs "
          f"{off['chat']['tokens_per_s']:.1f}), TTFT p50 {r['chat_ttft_p50']:.3f}x ({on['chat']['ttft_p50_ms']:.0f} vs "
          f"{off['chat']['ttft_p50_ms']:.0f} ms); conversations prefill {r['conversation_prefilled_tokens']:.3f}x "
          f"({on['conversations']['prefilled_tokens']} vs {off['conversations']['prefilled_tokens']} tokens); "
          f"distinct prompts {r['distinct_tokens_per_s']:.3f}x tok/s")
    save(results, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
