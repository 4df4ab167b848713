"""The physical ceiling: B sequences decoded together in a bare ``llama_decode`` loop, no IPC.

    python -m bench.limit --batch 16 --prompt-tokens 32 --gen-tokens 128 [--json out.json]
    python -m bench.limit --batch 16 --mix requests.json [--json out.json]

Each of the B sequences gets a P-token prompt (all prefilled in one batch; ``--all-logits``: with
the logits of every prompt row, scoring's ceiling), then G greedy tokens
with end-of-generation tokens masked, one ``llama_decode`` per step over all B sequences, with
the engine's thread count, weights and OpenMP environment. Prints generated tokens/s over the
whole run (prefill included, as a client sees it) and over the decode steps alone.

``--mix`` replays a list of requests instead (a JSON list of ``[prompt token ids, tokens to
generate]``) over B lanes, closed loop as a load driver with B connections would: a lane that
finishes takes the list's next request at once, every new prompt is prefilled whole in one
``llama_decode`` (no chunking), then one token is decoded for every lane. That is the most a
server could make of this exact work at batch B (:func:`measure_mix`).
"""
from __future__ import annotations

import json
import os
import sys
import time


def prompt_tokens(batch: int, n: int, n_vocab: int) -> list[list[int]]:
    """Deterministic, distinct prompts: ``batch`` lists of ``n`` ordinary token ids."""
    return [[(1000 + 37 * b + 11 * i) % (n_vocab - 1000) + 500 for i in range(n)] for b in range(batch)]


def measure(model_path: str, batch: int, prompt: int, gen: int, threads: int, weights: str = "auto",
            all_logits: bool = False) -> dict:
    """Run the ceiling loop once; returns figures in tokens/s and seconds. ``all_logits``: the
    prefill computes the logits of every prompt row, as scoring a prompt needs (the output
    matrix for each row rather than each sequence's last), and nothing more."""
    import numpy as np

    from engine.llama.batch import Batch
    from engine.llama.model import Model
    from engine.llama.weights import weights_path

    n_batch = max(512, batch * prompt)
    model = Model(weights_path(model_path, weights), batch, max(256, prompt + gen + 1), n_batch, threads)
    eog = np.array(sorted(model.eog), dtype=np.int64)
    b = Batch(n_batch)
    prompts = prompt_tokens(batch, prompt, model.n_vocab)
    try:
        t0 = time.perf_counter()
        rows = [b.add(np.array(p, np.int32), 0, s, True, all_logits) for s, p in enumerate(prompts)]
        model.decode(b)
        last = [_greedy(model.logits(r), eog) for r in rows]
        t1 = time.perf_counter()
        for step in range(1, gen):
            b.clear()
            rows = [b.add(np.array([last[s]], np.int32), prompt + step - 1, s, True) for s in range(batch)]
            model.decode(b)
            last = [_greedy(model.logits(r), eog) for r in rows]
        t2 = time.perf_counter()
    finally:
        path = model.path
        model.close()
    return {"batch": batch, "prompt_tokens": prompt, "gen_tokens": gen, "threads": threads, "weights": weights,
            "all_logits": all_logits,
            "weights_file": os.path.basename(path),
            "seconds": t2 - t0, "prefill_seconds": t1 - t0,
            "tokens_per_s": batch * gen / (t2 - t0),
            "decode_tokens_per_s": batch * (gen - 1) / (t2 - t1) if gen > 1 else 0.0}


def measure_mix(model_path: str, batch: int, requests: list[tuple[list[int], int]], threads: int,
                weights: str = "auto") -> dict:
    """Replay ``requests`` (prompt token ids, tokens to generate) over ``batch`` lanes (see the
    module). Returns generated tokens/s over the time every lane was busy (until the list ran
    out: ``tokens_per_s``, as :func:`bench.policies.summarize` counts) and over the whole run."""
    import numpy as np

    from engine.llama.batch import Batch
    from engine.llama.model import Model
    from engine.llama.weights import weights_path

    longest = max(len(p) + g for p, g in requests)
    n_batch = max(512, sum(sorted(len(p) for p, _ in requests)[-batch:]))
    cells = -(-(longest + 1) // 256) * 256  # llama.cpp rounds n_ctx to 256 cells
    model = Model(weights_path(model_path, weights), batch, cells, n_batch, threads)
    eog = np.array(sorted(model.eog), dtype=np.int64)
    b = Batch(n_batch)
    queue = list(reversed(requests))
    lanes: list[list | None] = [None] * batch  # [next position, tokens left, last token] per lane
    generated, busy_tokens, busy_s = 0, 0, None

    def sampled(s: int, row: int) -> None:
        nonlocal generated
        lane = lanes[s]
        lane[2] = _greedy(model.logits(row), eog)
        lane[1] -= 1
        generated += 1
        if lane[1] == 0:
            lanes[s] = None

    try:
        t0 = time.perf_counter()
        while queue or any(lanes):
            if busy_s is None and not queue and None in lanes:  # a lane found the list empty
                busy_s, busy_tokens = time.perf_counter() - t0, generated
            b.clear()
            rows = {}
            for s in range(batch):
                if lanes[s] is None and queue:
                    prompt, gen = queue.pop()
                    model.free_sequence(s)
                    rows[s] = b.add(np.array(prompt, np.int32), 0, s, True)
                    lanes[s] = [len(prompt), gen, None]
            if rows:  # every new prompt whole, in one decode
                model.decode(b)
                for s, row in rows.items():
                    sampled(s, row)
            b.clear()
            rows = {s: b.add(np.array([lane[2]], np.int32), lane[0], s, True)
                    for s, lane in enumerate(lanes) if lane is not None}
            if rows:
                model.decode(b)
                for s, row in rows.items():
                    lanes[s][0] += 1
                    sampled(s, row)
        total_s = time.perf_counter() - t0
    finally:
        path = model.path
        model.close()
    return {"batch": batch, "requests": len(requests), "threads": threads, "weights": weights,
            "weights_file": os.path.basename(path), "generated": generated, "busy_s": busy_s, "seconds": total_s,
            "tokens_per_s": busy_tokens / busy_s if busy_s else 0.0, "whole_run_tokens_per_s": generated / total_s}


def _greedy(logits, eog) -> int:
    logits = logits.copy()
    logits[eog] = -float("inf")
    return int(logits.argmax())


def main(argv=None) -> int:
    from bench.common import parser, save
    from engine.config import EngineConfig, default_model_path

    p = parser("python -m bench.limit", __doc__, "--batch")
    p.add_argument("--model", default=None)
    p.add_argument("--weights", default="auto", help="weight format, as the server's --weights")
    p.add_argument("--mix", default=None, help="JSON list of [prompt token ids, tokens to generate] to replay")
    p.add_argument("--all-logits", action="store_true", help="the prefill computes every prompt row's logits")
    a = p.parse_args(argv)
    model = a.model or default_model_path()
    threads = a.engine_threads or EngineConfig(model_path=model).threads
    if a.mix:
        with open(a.mix) as f:
            requests = [(list(prompt), int(gen)) for prompt, gen in json.load(f)]
        r = measure_mix(model, a.batch, requests, threads, a.weights)
        print(f"limit: B={a.batch}, {len(requests)} requests replayed, threads={threads}: "
              f"{r['tokens_per_s']:.1f} generated tok/s while every lane was busy "
              f"({r['whole_run_tokens_per_s']:.1f} over the whole run)")
    else:
        r = measure(model, a.batch, a.prompt_tokens, a.gen_tokens, threads, a.weights, a.all_logits)
        print(f"limit: B={a.batch} P={a.prompt_tokens} G={a.gen_tokens} threads={threads}: "
              f"{r['tokens_per_s']:.1f} generated tok/s ({r['decode_tokens_per_s']:.1f} in decode steps)")
    save(r, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
