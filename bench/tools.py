"""Tool calling: what a constrained, parsed answer costs next to a plain one, in one run.

    python -m bench.tools [--clients 16 --gen-tokens 128 --rounds 3 --ttft-rounds 2] [--json out.json]

Starts one real server (``--max-slots`` = clients, the bundled model: the generic tool format)
and alternates, ``--rounds`` times each:

* tools: ``--clients`` concurrent streaming chat completions with ``tool_choice: "required"``
  and ``parallel_tool_calls: false``, whose one function takes a string of at least 4000
  characters, so every answer is grammar-constrained JSON for all ``--gen-tokens`` tokens
  (``finish_reason: "length"``), parsed into streamed ``delta.tool_calls``;
* plain: the same number of streams with the same prompt text (the generic format's system
  message written as a plain system message, no tools), ``ignore_eos``, the same
  ``max_tokens``.

Generated tokens/s over each batch's wall time; reported as the ratio of the medians
(tools / plain). Then the time to first token (request sent to the first chunk with content or
a tool call) of one request with 8 tools (``tool_choice: "auto"``) beside the same request
without tools, and beside a plain request with the same prompt text (the 8 tools written into
its system message as the generic format writes them: the prefill's share), alternating
``--ttft-rounds`` times; each request opens with a fresh nonce, so neither the prefix cache nor
the engine's grammar cache serves it. ``--rounds 0`` or ``--ttft-rounds 0`` leaves that part
out (each part alone stays under five minutes on a busy two-core machine).
"""
from __future__ import annotations

import argparse
import http.client
import json
import secrets
import statistics
import time

from bench.common import concurrently, save
from server.tools.formats import generic_messages
from server.tools.spec import Tool

QUESTION = "Write a long note about the history of Paris, then file it."
NOTE = {"type": "object", "properties": {"note": {"type": "string", "minLength": 4000}}, "required": ["note"],
        "additionalProperties": False}


def eight_tools(tag: str) -> list[dict]:
    """Eight functions of realistic size; ``tag`` in each description makes the set new."""
    kinds = ["weather", "time", "stock", "flight", "hotel", "news", "calendar", "email"]
    return [{"type": "function", "function": {
        "name": f"get_{k}", "description": f"Look up {k} information ({tag}); returns JSON.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": f"what to look up about {k}"},
            "limit": {"type": "integer", "minimum": 1, "maximum": 20},
            "units": {"type": "string", "enum": ["metric", "imperial"]}}, "required": ["query"]}}} for k in kinds]


def stream(port: int, body: dict) -> dict:
    """One streaming chat completion: ``{"ttft", "done", "completion_tokens", "calls"}``."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    ttft, usage, calls = None, None, 0
    for line in resp:
        if line.strip() == b"data: [DONE]":
            break
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls"):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                calls += sum(1 for c in delta.get("tool_calls", ()) if "id" in c)
    done = time.perf_counter() - t0
    conn.close()
    return {"ttft": ttft if ttft is not None else done, "done": done, "completion_tokens": usage["completion_tokens"],
            "calls": calls}


def batch(port: int, clients: int, body: dict) -> dict:
    results = []
    wall = concurrently(clients, lambda i: results.append(stream(port, body)))
    generated = sum(r["completion_tokens"] for r in results)
    return {"tokens_per_s": generated / wall, "generated": generated, "wall_s": wall,
            "calls": sum(r["calls"] for r in results)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="bench.tools", description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ttft-rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from tests.support.servers import running_server

    system = "You are a careful archivist."
    tool = Tool("file_note", "File a note in the archive", NOTE)
    prompt_system = generic_messages([{"role": "system", "content": system}], (tool,))[0]["content"]
    tools_body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}],
                  "tools": [tool.openai()], "tool_choice": "required", "parallel_tool_calls": False,
                  "max_tokens": args.gen_tokens, "temperature": 0}
    plain_body = {"messages": [{"role": "system", "content": prompt_system}, {"role": "user", "content": QUESTION}],
                  "max_tokens": args.gen_tokens, "temperature": 0, "ignore_eos": True}
    result: dict = {"clients": args.clients, "gen_tokens": args.gen_tokens}
    with running_server("--max-slots", str(args.clients), "--max-seq-len", "2048", "--max-queued", "16",
                        "--workers", "2", "--grpc-port", "0") as server:
        port = server.port
        if args.rounds:  # 0: the time to first token only
            batch(port, args.clients, {**plain_body, "max_tokens": 8})  # warm-up (and the grammar compiled)
            batch(port, 1, {**tools_body, "max_tokens": 8})
            runs = {"tools": [], "plain": []}
            for _ in range(args.rounds):
                for kind, body in (("tools", tools_body), ("plain", plain_body)):
                    runs[kind].append(batch(port, args.clients, body))
                    server.wait_idle(60)
            report_throughput(args, runs, result)
        if args.ttft_rounds:  # 0: the throughput only
            time_to_first_token(args, port, result)
    save(result, args.json)
    return result


def report_throughput(args, runs: dict, result: dict) -> None:
    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    result.update(throughput_runs=runs, tools_tokens_per_s=med["tools"], plain_tokens_per_s=med["plain"],
                  ratio=med["tools"] / med["plain"])
    print(f"{args.clients} streams, {args.gen_tokens} tokens: tools (required) {med['tools']:.1f} tok/s, "
          f"plain {med['plain']:.1f} tok/s; ratio {med['tools'] / med['plain']:.3f} "
          f"(runs tools {[round(r['tokens_per_s'], 1) for r in runs['tools']]}, "
          f"plain {[round(r['tokens_per_s'], 1) for r in runs['plain']]})")


def time_to_first_token(args, port: int, result: dict) -> None:
    ttft = {"8 tools": [], "no tools": [], "no tools, same prompt": []}
    prompt_tokens = {}
    for _ in range(args.ttft_rounds):
        for kind in ttft:
            nonce = secrets.token_hex(6)  # each request its own: nothing cached serves it
            ask = [{"role": "system", "content": f"[{nonce}] You are a concise assistant."},
                   {"role": "user", "content": "What is the weather in Paris?"}]
            tools = eight_tools(nonce)
            written = generic_messages(ask, tuple(Tool(t["function"]["name"], t["function"]["description"],
                                                       t["function"]["parameters"]) for t in tools))
            extra = {"8 tools": {"tools": tools}, "no tools": {}, "no tools, same prompt": {"messages": written}}
            body = {"messages": ask, "max_tokens": 8, "temperature": 0, **extra[kind]}
            ttft[kind].append(stream(port, body)["ttft"] * 1000)
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", "/v1/chat/completions", json.dumps({**body, "max_tokens": 0}),
                         {"Content-Type": "application/json"})
            prompt_tokens[kind] = json.loads(conn.getresponse().read())["usage"]["prompt_tokens"]
            conn.close()
    med_ttft = {k: statistics.median(v) for k, v in ttft.items()}
    result.update(ttft_ms=ttft, ttft_p50_ms=med_ttft, ttft_prompt_tokens=prompt_tokens)
    print(f"time to first token, p50 of {args.ttft_rounds}: 8 tools {med_ttft['8 tools']:.0f} ms "
          f"({prompt_tokens['8 tools']} prompt tokens), no tools {med_ttft['no tools']:.0f} ms "
          f"({prompt_tokens['no tools']} prompt tokens), no tools with the same prompt text "
          f"{med_ttft['no tools, same prompt']:.0f} ms ({prompt_tokens['no tools, same prompt']} prompt tokens)")


if __name__ == "__main__":
    main()
