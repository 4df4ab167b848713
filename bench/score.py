"""Scoring prompts (``echo`` with ``logprobs``, ``max_tokens: 0``) against the bare prefill ceiling,
and what scoring does to generation streams running beside it, in one run.

    python -m bench.score [--prompts 256 --prompt-tokens 200 --clients 8] [--json out.json]

Starts one real server (``--max-slots`` = 2 x clients, so scoring and generation clients all
hold a slot) and measures, alternating with the ceiling so machine noise hits both alike:

* ceiling: ``bench.limit``'s prefill (``--batch`` clients x ``--prompt-tokens``, one bare
  ``llama_decode``, logits of the last token only), run before and after scoring; prompt
  tokens/s = tokens / its ``prefill_seconds``.
* scoring ceiling: the same decode with the logits of every prompt row (``bench.limit
  --all-logits``), which scoring cannot do without: its ratio to the ceiling is the most any
  server can score at, over the ceiling, on this model (the output matrix is about a fifth of
  SmolLM2-135M's work per token). Alternated with the ceiling.
* scoring: ``--prompts`` distinct token-id prompts scored by ``--clients`` concurrent clients,
  one prompt per request (lm-eval's shape); prompt tokens/s over the wall time, every answer
  checked to hold one entry per prompt token.
* engine prefill: as many other prompts of the same length, each generating one token
  (``max_tokens: 1``, no echo): what the engine's own chunked prefill reaches through HTTP,
  so scoring's cost over it (the logits of every prompt row) shows apart from the engine's.
* generation alone: ``--clients`` streams, each ``--gen-requests`` requests of ``--gen-tokens``
  greedy tokens (``ignore_eos``) after a short prompt; generated tokens/s. Run before and after
  the mixed run.
* mixed: the same generation while ``--clients`` scoring clients keep scoring; generated
  tokens/s, and scoring's share of the tokens the engine took in meanwhile (prompt tokens
  scored / (those + generated tokens)).

Reported: scoring / ceiling, scoring / scoring ceiling, and generation mixed / alone next to ``1 - share``, the speed
generation would keep if scoring took exactly its share of every batch.
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time

from bench.common import concurrently, limit, save
from bench.limit import prompt_tokens


def post(port: int, body: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, data[:300]
        return json.loads(data)
    finally:
        conn.close()


def score(port: int, prompt: list[int]) -> None:
    """One scoring request; its answer must hold an entry per prompt token."""
    out = post(port, {"prompt": [prompt], "max_tokens": 0, "echo": True, "logprobs": 1})
    lp = out["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lp) == len(prompt) and lp[0] is None and None not in lp[1:], len(lp)


def _drain(prompts: list[list[int]], clients: int, one) -> float:
    """Prompt tokens/s of ``one(prompt)`` over every prompt, ``clients`` at a time."""
    lock, todo = threading.Lock(), list(prompts)

    def work(_):
        while True:
            with lock:
                if not todo:
                    return
                prompt = todo.pop()
            one(prompt)
    wall = concurrently(clients, work)
    return sum(len(p) for p in prompts) / wall


def scoring(port: int, prompts: list[list[int]], clients: int) -> float:
    """Prompt tokens/s scoring every prompt from ``clients`` concurrent clients."""
    return _drain(prompts, clients, lambda prompt: score(port, prompt))


def prefill(port: int, prompts: list[list[int]], clients: int) -> float:
    """Prompt tokens/s of one generated token per prompt, ``clients`` at a time."""
    return _drain(prompts, clients, lambda prompt: post(
        port, {"prompt": [prompt], "max_tokens": 1, "temperature": 0, "ignore_eos": True}))


def generation(port: int, clients: int, requests: int, tokens: int, salt: int) -> tuple[float, float]:
    """``(generated tokens/s, wall seconds)`` of ``clients`` streams of ``requests`` requests."""
    def work(i):
        for r in range(requests):
            k = (salt * clients + i) * requests + r  # distinct prompts: no prefix cache hits
            prompt = [(7919 * k + 13 * j) % 40000 + 500 for j in range(16)]
            out = post(port, {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
            assert out["usage"]["completion_tokens"] == tokens
    wall = concurrently(clients, work)
    return clients * requests * tokens / wall, wall


def mixed(port: int, prompts: list[list[int]], clients: int, requests: int, tokens: int) -> dict:
    """Generation while ``clients`` scoring clients keep scoring ``prompts`` (round robin)."""
    stop, scored, lock = threading.Event(), [0], threading.Lock()

    def scorer(i):
        k = i
        while not stop.is_set():
            prompt = prompts[k % len(prompts)]
            score(port, prompt)
            k += clients
            with lock:
                if not stop.is_set():
                    scored[0] += len(prompt)
    threads = [threading.Thread(target=scorer, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # every scoring client has a request in flight
    with lock:
        scored[0] = 0
    tokens_per_s, wall = generation(port, clients, requests, tokens, salt=7)
    with lock:
        stop.set()
        in_window = scored[0]
    for t in threads:
        t.join()
    generated = clients * requests * tokens
    return {"gen_tokens_per_s": tokens_per_s, "wall_s": wall, "scored_tokens": in_window,
            "score_share": in_window / (in_window + generated)}


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(prog="bench.score", description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--gen-requests", type=int, default=1)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--engine-threads", type=int, default=0, help="the server's --engine-threads (0: adaptive)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from tests.support.servers import running_server

    c = args.clients
    both = prompt_tokens(2 * args.prompts, args.prompt_tokens, 49152)  # distinct: no prefix cache hits
    prompts, others = both[:args.prompts], both[args.prompts:]
    ceilings, score_ceilings, alone = [], [], []
    with running_server("--max-slots", str(2 * c), "--max-queued", str(2 * c), "--max-seq-len", "512",
                        "--workers", "2", "--threads", str(4 * c), "--engine-threads", str(args.engine_threads)) as server:
        port = server.port
        score(port, prompts[0])  # warm up
        def run():
            ceilings.append(limit(c, args.prompt_tokens, 1, args.engine_threads))
            score_ceilings.append(limit(c, args.prompt_tokens, 1, args.engine_threads, all_logits=True))
            log(f"ceiling {ceilings[-1]['prefill_seconds']:.2f} s, with every row's logits "
                f"{score_ceilings[-1]['prefill_seconds']:.2f} s")
        run()
        score_tps = scoring(port, prompts, c)
        log(f"scoring {score_tps:.0f} tok/s")
        prefill_tps = prefill(port, others, c)
        log(f"engine prefill {prefill_tps:.0f} tok/s")
        run()
        alone.append(generation(port, c, args.gen_requests, args.gen_tokens, salt=0)[0])
        log(f"generation alone {alone[-1]:.1f} tok/s")
        mix = mixed(port, prompts, c, args.gen_requests, args.gen_tokens)
        log(f"generation beside scoring {mix['gen_tokens_per_s']:.1f} tok/s")
        alone.append(generation(port, c, args.gen_requests, args.gen_tokens, salt=1)[0])
    ceiling_runs = [r["batch"] * r["prompt_tokens"] / r["prefill_seconds"] for r in ceilings]
    ceiling = statistics.mean(ceiling_runs)
    score_ceiling_runs = [r["batch"] * r["prompt_tokens"] / r["prefill_seconds"] for r in score_ceilings]
    score_ceiling = statistics.mean(score_ceiling_runs)
    gen_alone = statistics.mean(alone)
    result = {"prompts": args.prompts, "engine_threads": args.engine_threads, "prompt_tokens": args.prompt_tokens, "clients": c,
              "score_tokens_per_s": score_tps, "prefill_ceiling_tokens_per_s": ceiling, "prefill_ceiling_runs": ceiling_runs,
              "score_ratio": score_tps / ceiling, "score_ceiling_tokens_per_s": score_ceiling,
              "score_ceiling_runs": score_ceiling_runs, "score_to_score_ceiling": score_tps / score_ceiling,
              "score_ceiling_ratio": score_ceiling / ceiling, "engine_prefill_tokens_per_s": prefill_tps,
              "score_to_engine_prefill": score_tps / prefill_tps,
              "gen_alone_tokens_per_s": gen_alone, "gen_alone_runs": alone, **mix,
              "gen_mixed_ratio": mix["gen_tokens_per_s"] / gen_alone, "gen_fair_ratio": 1 - mix["score_share"]}
    print(f"scoring: {score_tps:.0f} prompt tok/s; prefill ceiling {ceiling:.0f} tok/s (runs "
          f"{ceiling_runs[0]:.0f}, {ceiling_runs[1]:.0f}); ratio {result['score_ratio']:.3f}; the engine's own prefill "
          f"{prefill_tps:.0f} tok/s: scoring / it {result['score_to_engine_prefill']:.3f}")
    print(f"scoring ceiling (every row's logits): {score_ceiling:.0f} tok/s (runs {score_ceiling_runs[0]:.0f}, "
          f"{score_ceiling_runs[1]:.0f}), {result['score_ceiling_ratio']:.3f} of the ceiling; scoring / it "
          f"{result['score_to_score_ceiling']:.3f}")
    print(f"generation: alone {gen_alone:.1f} tok/s (runs {alone[0]:.1f}, {alone[1]:.1f}), beside scoring "
          f"{mix['gen_tokens_per_s']:.1f} tok/s: ratio {result['gen_mixed_ratio']:.3f}; scoring's share of the "
          f"tokens {mix['score_share']:.3f}, so its fair ratio {result['gen_fair_ratio']:.3f}")
    save(result, args.json)


if __name__ == "__main__":
    main()
