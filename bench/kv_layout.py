"""Attention cost of llama.cpp's unified KV cache (one cell pool for every sequence) against one
stream per sequence (the engine's layout), in a bare context on the engine's weights.

    python -m bench.kv_layout [--model PATH] [--cells 1024] [--threads 1]

On ``--model`` (default: the bundled SmolLM2-135M; a sliding-window model gets the engine's
window cache, ``swa_full`` off, in both layouts), 16 sequences hold ``--cells`` cells each; then, median of several: a 16-token decode step (one
token of each), a 512-token prefill chunk of a 17th sequence beside them, and a lone decode of
one sequence; the tokens added are removed after each; and the process's resident memory once the
16 sequences are in (``rss_mib``: the pages of the streams are not given back here, so a
non-unified cache is all resident). Run once per layout, in one process.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import llama_cpp
import numpy as np

from engine.config import default_model_path
from engine.llama.batch import Batch
from engine.llama.kv_pages import resident_bytes
from engine.llama.library import load_model
from engine.llama.weights import weights_path

SEQUENCES = 16


def measure(model, cells: int, unified: bool, threads: int) -> dict:
    """Milliseconds of each decode shape (module doc) with ``kv_unified`` = ``unified``."""
    params = llama_cpp.llama_context_default_params()
    params.n_seq_max = SEQUENCES + 1
    params.n_ctx = params.n_seq_max * (cells + 512)
    params.n_batch = params.n_ubatch = 512
    params.kv_unified = unified
    params.swa_full = False  # as engine.llama.model.Model
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    params.n_threads = params.n_threads_batch = threads
    params.no_perf = True
    ctx = llama_cpp.llama_init_from_model(model, params)
    mem = llama_cpp.llama_get_memory(ctx)
    batch, rng = Batch(512), np.random.default_rng(0)

    def timed(rows: list[tuple[np.ndarray, int, int]], keep: bool = False) -> float:
        """Decode ``rows`` (tokens, first position, sequence); ms. Their cells are removed after
        unless ``keep``."""
        batch.clear()
        for tokens, pos, seq in rows:
            batch.add(tokens, pos, seq, True)
        t = time.perf_counter()
        if llama_cpp.llama_decode(ctx, batch.as_struct()) != 0:
            raise RuntimeError("llama_decode failed")
        elapsed = (time.perf_counter() - t) * 1000
        for _, pos, seq in rows if not keep else ():
            llama_cpp.llama_memory_seq_rm(mem, seq, pos, -1)
        return elapsed

    for seq in range(SEQUENCES):
        for start in range(0, cells, 512):
            timed([(rng.integers(100, 40000, min(512, cells - start)).astype(np.int32), start, seq)], keep=True)
    resident = resident_bytes()
    one = np.array([5], np.int32)
    step = [timed([(one, cells, s) for s in range(SEQUENCES)]) for _ in range(7)]
    chunk = [timed([(rng.integers(100, 40000, 512).astype(np.int32), 0, SEQUENCES)]) for _ in range(3)]
    lone = [timed([(one, cells, 0)]) for _ in range(7)]
    llama_cpp.llama_free(ctx)
    return {"decode16_ms": statistics.median(step), "chunk512_ms": statistics.median(chunk),
            "lone_ms": statistics.median(lone), "rss_mib": resident / (1 << 20)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kv_layout", description=__doc__.split("\n")[0])
    p.add_argument("--cells", type=int, default=1024, help="cells each of the 16 sequences holds")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default=None, help="GGUF (default: the bundled SmolLM2-135M)")
    a = p.parse_args(argv)
    model = load_model(weights_path(a.model or default_model_path(), "auto"))
    for unified in (False, True):
        r = measure(model, a.cells, unified, a.threads)
        print(f"kv_unified={unified}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items()), flush=True)
    llama_cpp.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
