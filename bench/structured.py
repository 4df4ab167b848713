"""Structured outputs: what a JSON schema costs the continuous batch, in one run.

    python -m bench.structured [--rounds 3 --ttft-rounds 20] [--json out.json]

One real server (``--max-slots 16``), then, alternating so that noise from other processes hits
both sides alike:

* throughput: 16 concurrent streaming chat completions, once with ``response_format`` a typical
  schema (an array of people objects, ``minItems`` 20, so every answer runs to ``max_tokens``)
  and once unconstrained on the same prompts (``ignore_eos``, the same ``max_tokens``); generated
  tokens/s over the wall time of each round. Reported: the ratio constrained / unconstrained
  of the summed rounds, and the constraint's cost per engine step derived from it
  (``16 / tok/s`` is one step's time when all 16 decode together).
* time to first token, one request at a time on the idle server (request sent to the first
  chunk with text): no format, a schema never seen before (a new property name each time, so
  the front end checks and the engine compiles it), and the same schema again (cached).
  Medians and their differences (ms).
* the constraint by itself (no model): for the schema's tokens of a real document, the
  microseconds of the check of a sampled token (``validate_tokens``), of the allowed set on a
  refusal (llguidance's mask as ids) and of advancing (``consume_token``).
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time

from bench.common import concurrently, save

PEOPLE = {"type": "object", "properties": {"people": {"type": "array", "minItems": 20, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                     "email": {"type": "string", "format": "email"}},
    "required": ["name", "age", "email"], "additionalProperties": False}}},
          "required": ["people"], "additionalProperties": False}
QUESTIONS = ["List the people in the office.", "Who lives on this street?", "Name the members of the club.",
             "Who came to the party?", "List the students in the class.", "Who works at the bakery?",
             "Name the players of the team.", "Who was on the train?"]


def fmt(schema: dict, name: str = "people") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def chat_stream(port: int, body: dict) -> dict:
    """One streaming chat completion: ``{"ttft", "done", "tokens", "finish"}`` (seconds)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    ttft, tokens, finish = None, 0, None
    for line in resp:
        if line.strip() == b"data: [DONE]":
            break
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices", []):
            if (choice.get("delta") or {}).get("content") and ttft is None:
                ttft = time.perf_counter() - t0
            finish = choice.get("finish_reason") or finish
    done = time.perf_counter() - t0
    conn.close()
    return {"ttft": ttft if ttft is not None else done, "done": done, "tokens": tokens, "finish": finish}


def throughput(port: int, clients: int, max_tokens: int, constrained: bool) -> dict:
    """``clients`` concurrent streams, one request each: generated tok/s over the wall time."""
    results = []
    extra = {"response_format": fmt(PEOPLE)} if constrained else {"ignore_eos": True}

    def work(i):
        body = {"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + " Answer in JSON."}],
                "max_tokens": max_tokens, "temperature": 1.0, "seed": i, **extra}
        results.append(chat_stream(port, body))

    wall = concurrently(clients, work)
    tokens = sum(r["tokens"] for r in results)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "finish": sorted({r["finish"] for r in results})}


def ttft(port: int, rounds: int) -> dict:
    """Median TTFT (ms) with no format, a new schema each time, the same schema each time."""
    samples = {"none": [], "new": [], "cached": []}
    ask = [{"role": "user", "content": "Who is in the room? Answer in JSON."}]
    small = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
             "required": ["name", "age"], "additionalProperties": False}
    chat_stream(port, {"messages": ask, "max_tokens": 2, "response_format": fmt(small, "warm")})  # warm both caches
    stamp = time.time_ns()
    for k in range(rounds):
        new = {**small, "properties": {**small["properties"], f"field_{stamp}_{k}": {"type": "string"}}}
        for kind, extra in (("none", {}), ("new", {"response_format": fmt(new)}),
                            ("cached", {"response_format": fmt(small, "warm")})):
            samples[kind].append(chat_stream(port, {"messages": ask, "max_tokens": 2, "temperature": 0,
                                                    **extra})["ttft"] * 1000)
    p50 = {k: statistics.median(v) for k, v in samples.items()}
    return {"p50_ms": p50, "new_minus_none_ms": p50["new"] - p50["none"],
            "cached_minus_none_ms": p50["cached"] - p50["none"], "rounds": rounds}


def constraint_alone(tokens: int = 200) -> dict:
    """Microseconds per token of the constraint's operations over a real document of PEOPLE."""
    import llama_cpp

    from engine.config import default_model_path
    from engine.llama.grammar import Grammars
    from engine.llama.tokenizer import Tokenizer
    from server.api.structured import parse_structured

    tok = Tokenizer(default_model_path())
    eog = frozenset(t for t in range(tok.n_vocab) if llama_cpp.llama_vocab_is_eog(tok.vocab, t))
    grammars = Grammars(tok.vocab, eog, tok.n_vocab)
    grammar = parse_structured({"response_format": fmt(PEOPLE)}).grammar()
    t0 = time.perf_counter()
    future = grammars.compile(0, grammar)
    future.result()
    compile_ms = (time.perf_counter() - t0) * 1000  # includes the tokenizer's build, once per engine
    t0 = time.perf_counter()
    grammars.compile(1, grammar).result()
    compile_again_ms = (time.perf_counter() - t0) * 1000
    person = {"name": "Ann Lee", "age": 34, "email": "ann@example.com"}
    doc = json.dumps({"people": [person] * 40})  # as the server lays JSON out (JSON_OPTIONS)
    ids = tok.encode(doc)[:tokens]
    c = grammars.constraint(future)
    check = allowed = accept = 0.0
    for t in ids:
        s = time.perf_counter()
        assert c.allows(t)
        check += time.perf_counter() - s
        s = time.perf_counter()
        c.allowed()
        allowed += time.perf_counter() - s
        s = time.perf_counter()
        c.accept(t)
        accept += time.perf_counter() - s
    assert not c.error
    grammars.close()
    n = len(ids)
    return {"tokens": n, "check_us": check / n * 1e6, "allowed_on_refusal_us": allowed / n * 1e6,
            "accept_us": accept / n * 1e6, "first_compile_ms_with_tokenizer": compile_ms,
            "compile_ms": compile_again_ms}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ttft-rounds", type=int, default=20)
    p.add_argument("--json")
    a = p.parse_args()
    from tests.support.servers import running_server

    alone = constraint_alone()
    print(f"constraint alone: check {alone['check_us']:.1f} us, allowed set on a refusal "
          f"{alone['allowed_on_refusal_us']:.1f} us, accept {alone['accept_us']:.1f} us per token; "
          f"compile {alone['compile_ms']:.2f} ms (first, with the tokenizer: "
          f"{alone['first_compile_ms_with_tokenizer']:.0f} ms)")
    with running_server("--max-slots", str(a.clients), "--max-seq-len", "256", "--max-queued", str(a.clients),
                        "--workers", "2", "--threads", str(2 * a.clients)) as server:
        port = server.port
        throughput(port, a.clients, 8, True)  # warm-up: the schema compiled, the caches warm
        rounds = {"constrained": [], "unconstrained": []}
        for r in range(a.rounds):
            for kind in (("constrained", "unconstrained") if r % 2 == 0 else ("unconstrained", "constrained")):
                rounds[kind].append(throughput(port, a.clients, a.max_tokens, kind == "constrained"))
        tps = {k: sum(x["tokens"] for x in v) / sum(x["wall_s"] for x in v) for k, v in rounds.items()}
        ratio = tps["constrained"] / tps["unconstrained"]
        step_cost_ms = (a.clients / tps["constrained"] - a.clients / tps["unconstrained"]) * 1000
        t = ttft(port, a.ttft_rounds)
    print(f"throughput, {a.clients} streams x {a.max_tokens} tokens, {a.rounds} rounds each, alternating: "
          f"constrained {tps['constrained']:.1f} tok/s, unconstrained {tps['unconstrained']:.1f} tok/s, "
          f"ratio {ratio:.3f}; constraint cost per step (all {a.clients} constrained) {step_cost_ms:.2f} ms; "
          f"endings {sorted({f for v in rounds['constrained'] for f in v['finish']})}")
    print(f"TTFT p50 over {t['rounds']} rounds: none {t['p50_ms']['none']:.1f} ms, new schema "
          f"{t['p50_ms']['new']:.1f} ms (+{t['new_minus_none_ms']:.1f}), cached schema {t['p50_ms']['cached']:.1f} ms "
          f"(+{t['cached_minus_none_ms']:.1f})")
    save({"constraint_alone": alone, "throughput": {"tokens_per_s": tps, "ratio": ratio,
                                                            "step_cost_ms": step_cost_ms, "rounds": rounds},
                  "ttft": t}, a.json)


if __name__ == "__main__":
    main()
