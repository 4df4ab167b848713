"""The Responses API: what the translation costs next to chat, and what a continuation through
``previous_response_id`` saves, in one run.

    python -m bench.responses [--rounds 8 --turns 4 --gen-tokens 48] [--json out.json]

Starts one real server (the bundled model) and alternates, ``--rounds`` times:

* overhead: the same greedy request (a fresh nonce, so the prefix cache does not serve it) as
  ``POST /v1/chat/completions`` and as ``POST /v1/responses`` (``store: false``), at most
  ``--gen-tokens`` tokens each (the tokens each generated are reported), non-streamed, the
  order swapped every round; the ratio of the median latencies (responses / chat);
* continuation: a conversation of ``--turns`` turns built through ``previous_response_id``,
  then the time to first token of one more streamed turn continuing it, beside the time to
  first token of the same conversation sent whole as input items with a new nonce (the same
  number of prompt tokens, none cached); the ratio of the medians (continued / cold), with
  the prompt and cached token counts.
"""
from __future__ import annotations

import argparse
import http.client
import json
import secrets
import statistics
import time

from bench.common import save


def post(port: int, path: str, body: dict) -> tuple[float, float, dict | None]:
    """``(seconds to the first output event or whole answer, seconds in all, the response)``;
    a stream's response is its last event's."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:300]
    if not body.get("stream"):
        out = json.loads(resp.read())
        t = time.perf_counter() - t0
        return t, t, out
    first, last = None, None
    for line in resp:
        if line.startswith(b"data: "):
            event = json.loads(line[6:])
            if first is None and event["type"] == "response.output_text.delta":
                first = time.perf_counter() - t0
            last = event
    return first, time.perf_counter() - t0, last.get("response")


def overhead(port: int, gen_tokens: int, responses_first: bool) -> dict:
    """One chat and one Responses request of the same length (new nonces), in the given order:
    latencies and generated tokens."""
    def question() -> str:
        return f"[{secrets.token_hex(6)}] Tell me about the history of Paris."

    def chat() -> tuple[float, int]:
        _, t, out = post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": question()}],
                                                        "max_tokens": gen_tokens, "temperature": 0})
        return t, out["usage"]["completion_tokens"]

    def responses() -> tuple[float, int]:
        _, t, out = post(port, "/v1/responses", {"input": question(), "max_output_tokens": gen_tokens,
                                                 "temperature": 0, "store": False})
        return t, out["usage"]["output_tokens"]

    order = (responses, chat) if responses_first else (chat, responses)
    got = {f.__name__: f() for f in order}
    return {"chat": got["chat"][0], "responses": got["responses"][0], "chat_tokens": got["chat"][1],
            "responses_tokens": got["responses"][1]}


def continuation(port: int, turns: int, gen_tokens: int) -> dict:
    nonce = secrets.token_hex(6)
    previous, items = None, []
    for k in range(turns):
        text = f"[{nonce}] Question {k}: tell me one more thing about Paris."
        body = {"input": text, "max_output_tokens": gen_tokens, "temperature": 0}
        if previous:
            body["previous_response_id"] = previous["id"]
        previous = post(port, "/v1/responses", body)[2]
        items += [{"role": "user", "content": text},
                  {"role": "assistant", "content": "".join(c["text"] for o in previous["output"] for c in o["content"])}]
    last = "And one last thing?"
    ttft_continued, _, cont = post(port, "/v1/responses", {"input": last, "previous_response_id": previous["id"],
                                                           "max_output_tokens": 8, "temperature": 0, "stream": True})
    cold_items = [{**i, "content": i["content"].replace(nonce, secrets.token_hex(6))} for i in items]
    ttft_cold, _, cold = post(port, "/v1/responses", {"input": cold_items + [{"role": "user", "content": last}],
                                                      "max_output_tokens": 8, "temperature": 0, "stream": True,
                                                      "store": False})
    return {"continued": ttft_continued, "cold": ttft_cold, "prompt_tokens": cont["usage"]["input_tokens"],
            "cached_continued": cont["usage"]["input_tokens_details"]["cached_tokens"],
            "cached_cold": cold["usage"]["input_tokens_details"]["cached_tokens"]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="bench.responses", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--gen-tokens", type=int, default=48)
    p.add_argument("--json")
    args = p.parse_args(argv)
    from tests.support.servers import running_server

    with running_server("--max-slots", "2", "--max-seq-len", "2048", "--workers", "1", "--threads", "8") as s:
        port = s.port
        overhead(port, 4, False)  # warm-up
        pairs, runs = [], []
        for k in range(args.rounds):
            pairs.append(overhead(port, args.gen_tokens, responses_first=bool(k % 2)))  # alternating order
            runs.append(continuation(port, args.turns, args.gen_tokens))
    chat = [p["chat"] for p in pairs]
    responses = [p["responses"] for p in pairs]
    result = {
        "rounds": args.rounds, "turns": args.turns, "gen_tokens": args.gen_tokens,
        "chat_latency_s": statistics.median(chat), "responses_latency_s": statistics.median(responses),
        "responses_over_chat": statistics.median(responses) / statistics.median(chat),
        "pair_ratios": [round(p["responses"] / p["chat"], 3) for p in pairs],
        "tokens_chat_responses": [(p["chat_tokens"], p["responses_tokens"]) for p in pairs],
        "ttft_continued_s": statistics.median(r["continued"] for r in runs),
        "ttft_cold_s": statistics.median(r["cold"] for r in runs),
        "continued_over_cold": statistics.median(r["continued"] for r in runs) / statistics.median(
            r["cold"] for r in runs),
        "prompt_tokens": statistics.median(r["prompt_tokens"] for r in runs),
        "cached_tokens_continued": statistics.median(r["cached_continued"] for r in runs),
        "cached_tokens_cold": statistics.median(r["cached_cold"] for r in runs),
    }
    print(json.dumps(result, indent=2))
    save(result, args.json)
    return result


if __name__ == "__main__":
    main()
