"""Weight formats side by side: speed of the bare ``llama_decode`` loop and agreement with the
model file's own weights (engine/llama/weights.py explains the choice of Q8_0).

    python -m bench.weights [--formats file,q8_0,bf16,f16] [--text README.md] [--json out.json]

Per format: the ceiling (``bench.limit``, P = 66, G = 78, the policy benchmark's mean shape) at
B = 1 and B = 16, generated tokens/s; then, teacher-forcing the first 1,000 tokens of ``--text``
(63-token chunks, as the engine prefills), the perplexity, and against the file's own weights
the mean and p99 KL divergence of the next-token distributions (nats) and how often the most
likely next token agrees.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log_probs(model_path: str, weights: str, tokens: np.ndarray) -> np.ndarray:
    """Log-softmax of the logits at every position of ``tokens``, shape ``[n, n_vocab]``."""
    from engine.llama.batch import Batch
    from engine.llama.model import Model
    from engine.llama.weights import weights_path

    n = len(tokens)
    model = Model(weights_path(model_path, weights), 1, -(-(n + 1) // 256) * 256, 64, len(os.sched_getaffinity(0)))
    batch, out = Batch(64), []
    try:
        for start in range(0, n, 63):
            chunk = tokens[start:start + 63]
            batch.clear()
            batch.add(chunk, start, 0, False)
            batch.logits[:len(chunk)] = 1  # every row's logits
            model.decode(batch)
            out += [model.logits(i).astype(np.float64) for i in range(len(chunk))]
    finally:
        model.close()
    x = np.array(out)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def main(argv=None) -> int:
    from bench.common import limit, save
    from engine.config import default_model_path
    from engine.llama.tokenizer import Tokenizer

    p = argparse.ArgumentParser(prog="python -m bench.weights", description=__doc__.split("\n")[0])
    p.add_argument("--formats", default="file,q8_0,bf16,f16")
    p.add_argument("--text", default=os.path.join(ROOT, "README.md"))
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    model = default_model_path()
    tokens = np.array(Tokenizer(model).encode(open(a.text).read(), add_bos=True)[:1000], np.int32)
    reference = log_probs(model, "file", tokens)
    rows = np.arange(len(tokens) - 1)
    result = {}
    print("| weights | B = 1 tok/s | B = 16 tok/s | perplexity | KL mean / p99 | top-1 agrees |")
    print("|---|---|---|---|---|---|")
    for fmt in a.formats.split(","):
        lp = reference if fmt == "file" else log_probs(model, fmt, tokens)
        kl = (np.exp(reference) * (reference - lp)).sum(axis=1)
        r = {"b1_tok_per_s": limit(1, 66, 78, weights=fmt)["tokens_per_s"],
             "b16_tok_per_s": limit(16, 66, 78, weights=fmt)["tokens_per_s"],
             "perplexity": float(np.exp(-lp[rows, tokens[1:]].mean())),
             "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
             "top1_agrees": float((reference.argmax(1) == lp.argmax(1)).mean())}
        result[fmt] = r
        print(f"| {fmt} | {r['b1_tok_per_s']:.1f} | {r['b16_tok_per_s']:.1f} | {r['perplexity']:.2f} | "
              f"{r['kl_mean']:.4f} / {r['kl_p99']:.4f} | {100 * r['top1_agrees']:.1f} % |", flush=True)
    save(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
