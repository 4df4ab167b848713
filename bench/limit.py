"""The physical ceiling: B sequences decoded together in a bare ``llama_decode`` loop, no IPC.

    python -m bench.limit --batch 16 --prompt-tokens 32 --gen-tokens 128 [--json out.json]

Each of the B sequences gets a P-token prompt (all prefilled in one batch), then G greedy tokens
with end-of-generation tokens masked, one ``llama_decode`` per step over all B sequences, with
the engine's thread count and OpenMP environment. Prints generated tokens/s over the whole run
(prefill included, as a client sees it) and over the decode steps alone.
"""
from __future__ import annotations

import sys
import time


def prompt_tokens(batch: int, n: int, n_vocab: int) -> list[list[int]]:
    """Deterministic, distinct prompts: ``batch`` lists of ``n`` ordinary token ids."""
    return [[(1000 + 37 * b + 11 * i) % (n_vocab - 1000) + 500 for i in range(n)] for b in range(batch)]


def measure(model_path: str, batch: int, prompt: int, gen: int, threads: int) -> dict:
    """Run the ceiling loop once; returns figures in tokens/s and seconds."""
    import numpy as np

    from engine.batch import Batch
    from engine.model import Model

    n_batch = max(512, batch * prompt)
    model = Model(model_path, batch, max(256, prompt + gen + 1), n_batch, threads)
    eog = np.array(sorted(model.eog), dtype=np.int64)
    b = Batch(n_batch)
    prompts = prompt_tokens(batch, prompt, model.n_vocab)
    try:
        t0 = time.perf_counter()
        rows = [b.add(np.array(p, np.int32), 0, s, True) for s, p in enumerate(prompts)]
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
        model.close()
    return {"batch": batch, "prompt_tokens": prompt, "gen_tokens": gen, "threads": threads,
            "seconds": t2 - t0, "prefill_seconds": t1 - t0,
            "tokens_per_s": batch * gen / (t2 - t0),
            "decode_tokens_per_s": batch * (gen - 1) / (t2 - t1) if gen > 1 else 0.0}


def _greedy(logits, eog) -> int:
    logits = logits.copy()
    logits[eog] = -float("inf")
    return int(logits.argmax())


def main(argv=None) -> int:
    from bench.common import parser, save
    from engine.config import EngineConfig, default_model_path

    p = parser("python -m bench.limit", __doc__, "--batch")
    p.add_argument("--model", default=None)
    a = p.parse_args(argv)
    model = a.model or default_model_path()
    threads = a.engine_threads or EngineConfig(model_path=model).threads
    r = measure(model, a.batch, a.prompt_tokens, a.gen_tokens, threads)
    print(f"limit: B={a.batch} P={a.prompt_tokens} G={a.gen_tokens} threads={threads}: "
          f"{r['tokens_per_s']:.1f} generated tok/s ({r['decode_tokens_per_s']:.1f} in decode steps)")
    save(r, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
