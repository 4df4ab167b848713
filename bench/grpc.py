"""gRPC streams against HTTP streams on one server, in one run.

    python -m bench.grpc [--clients 16 --prompt-tokens 32 --gen-tokens 128 --repeat 2] [--json out.json]

Starts a real ``inference-server`` with its gRPC sidecar and runs ``bench.http``'s workload
(``--clients`` concurrent streams, prompts of about P tokens that share nothing but the chat
template's system prompt, new ones every run, G generated
tokens each with ``ignore_eos``, greedy) as streaming chat completions: over HTTP
(``/v1/chat/completions`` with SSE) and over gRPC (``ChatCompleteStream``), alternating,
``--repeat`` times each. Reports generated tokens/s (total over the wall time) and the median time
to first token (call sent to the first piece of text), and gRPC / HTTP of the medians.
"""
from __future__ import annotations

import http.client
import json
import statistics
import sys
import time


def http_stream(port: int, content: str, gen: int) -> tuple[float, int]:
    """One streaming chat completion over HTTP: (seconds to first text, completion tokens)."""
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": gen, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    first, tokens = None, 0
    for line in conn.getresponse():
        if first is None and b'"content":"' in line and b'"content":""' not in line:
            first = time.perf_counter() - t0
        if b'"choices":[]' in line:  # the usage chunk
            tokens = json.loads(line[6:])["usage"]["completion_tokens"]
        if line.strip() == b"data: [DONE]":
            break
    conn.close()
    return first, tokens


def grpc_stream(stub, content: str, gen: int) -> tuple[float, int]:
    """One ``ChatCompleteStream`` call: (seconds to first text, completion tokens)."""
    from proto import inference_pb2 as pb

    request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=content)], max_tokens=gen,
                             temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    first, tokens = None, 0
    for chunk in stub.ChatCompleteStream(request, timeout=600):
        if first is None and chunk.text:
            first = time.perf_counter() - t0
        if chunk.HasField("usage"):
            tokens = chunk.usage.completion_tokens
    return first, tokens


def run(call, prompts: list[str], gen: int) -> dict:
    """Every prompt at once, one client thread each: tokens/s and TTFT p50 (ms)."""
    from bench.common import concurrently

    results = [None] * len(prompts)

    def client(i):
        results[i] = call(prompts[i], gen)

    wall = concurrently(len(prompts), client)
    return {"tokens_per_s": sum(r[1] for r in results) / wall,
            "ttft_p50_ms": statistics.median(r[0] for r in results) * 1000}


def main(argv=None) -> int:
    import argparse

    import grpc

    from bench.common import save
    from bench.http import prompt_text
    from engine.config import default_model_path
    from proto import inference_pb2_grpc
    from engine.llama.tokenizer import Tokenizer
    from tests.support.servers import running_server

    p = argparse.ArgumentParser(prog="python -m bench.grpc", description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    tokenizer = Tokenizer(default_model_path())
    # New prompts for every run: none is in the prefix cache from an earlier run.
    prompts = [[prompt_text(tokenizer, a.prompt_tokens, 1000 * k + i) for i in range(a.clients)]
               for k in range(2 * a.repeat)]
    flags = ["--max-slots", str(a.clients), "--max-seq-len", str(max(256, a.prompt_tokens + a.gen_tokens + 64)),
             "--threads", str(a.clients + 4), "--grpc-threads", str(a.clients + 4)]
    runs = {"http": [], "grpc": []}
    with running_server(*flags, grpc=True) as server:
        channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        calls = {"http": lambda c, g: http_stream(server.port, c, g), "grpc": lambda c, g: grpc_stream(stub, c, g)}
        for name in calls:  # warm-up
            calls[name]("Hello", 2)
        for k in range(a.repeat):
            for j, (name, call) in enumerate(calls.items()):
                runs[name].append(run(call, prompts[2 * k + j], a.gen_tokens))
                server.wait_idle()
        channel.close()
    result = {name: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                     "ttft_p50_ms": statistics.median(r["ttft_p50_ms"] for r in rs), "runs": rs}
              for name, rs in runs.items()}
    result["ratio_tokens_per_s"] = result["grpc"]["tokens_per_s"] / result["http"]["tokens_per_s"]
    result["ratio_ttft_p50"] = result["grpc"]["ttft_p50_ms"] / result["http"]["ttft_p50_ms"]
    print("runs (tok/s, TTFT p50 ms): " + "; ".join(
        f"{name} {r['tokens_per_s']:.1f} {r['ttft_p50_ms']:.0f}" for name in runs for r in runs[name]))
    print(f"gRPC {result['grpc']['tokens_per_s']:.1f} tok/s, TTFT p50 {result['grpc']['ttft_p50_ms']:.0f} ms; "
          f"HTTP {result['http']['tokens_per_s']:.1f} tok/s, TTFT p50 {result['http']['ttft_p50_ms']:.0f} ms; "
          f"gRPC / HTTP: {result['ratio_tokens_per_s']:.3f} tok/s, {result['ratio_ttft_p50']:.3f} TTFT")
    save(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
