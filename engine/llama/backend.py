"""The backend profile: every choice of the engine that holds only on one kind of llama.cpp
device, in one object, so a GPU build changes this profile and nothing else.

On llama.cpp's CPU backend (the profile measured here, docs/architecture.md "Prefix cache" and
docs/performance.md "Threads", "Weights"):

* a sequence prefills at most 63 prompt tokens a step: CPU flash attention takes a tiled path
  for 64 or more query rows of one sequence (``GGML_FA_TILE_Q``, ggml-cpu/ops.cpp) whose sums
  differ from its row-by-row path, so a prompt's KV cells would depend on its chunking and a
  reused prefix would change greedy output;
* a single-token micro-batch of one sequence whose KV view reaches 512 cells takes the split-KV
  flash-attention path, which sums in another order unless it runs on one thread; the view is
  the used cells rounded up to 256, so past 256 tokens such a decode runs on one thread;
* compute threads adapt to other processes' use of the CPUs (:mod:`engine.threads`);
* ``--weights auto`` converts Q4_1 and Q5_1 files to Q8_0, which tinyBLAS multiplies in batches
  (:mod:`engine.llama.weights`).

The GPU profile offloads every layer, prefills 512 tokens of a sequence a step (llama-server's
``n_ubatch``), keeps the thread count fixed (the CPU threads only feed the device) and loads
weights as they are. Its kernels have other numerics: bit-identical output with and without a
prefix-cache hit is promised on the CPU profile only. Nothing here has run on a GPU yet
(``tests/test_units.py`` checks the choice of profile with a faked device report).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine.llama.library import supports_gpu_offload


@dataclass(frozen=True)
class Backend:
    """Device-specific choices of the engine.

    Attributes:
        name: ``"cpu"`` or ``"gpu"``.
        max_chunk_tokens: prompt tokens one sequence prefills per step (at most).
        split_kv_after_tokens: a lone single-token decode of a sequence past this many tokens
            runs on one thread; None: never.
        adaptive_threads: ``--engine-threads 0`` adapts the count to contention; otherwise 0
            means one thread per CPU, fixed.
        convert_unbatched: ``--weights auto`` converts files with no batched kernel (Q4_1, Q5_1).
        n_gpu_layers: layers offloaded to the device (``llama_model_params.n_gpu_layers``; -1 all).
    """

    name: str
    max_chunk_tokens: int
    split_kv_after_tokens: int | None
    adaptive_threads: bool
    convert_unbatched: bool
    n_gpu_layers: int


CPU = Backend("cpu", max_chunk_tokens=63, split_kv_after_tokens=256, adaptive_threads=True,
              convert_unbatched=True, n_gpu_layers=0)
GPU = Backend("gpu", max_chunk_tokens=512, split_kv_after_tokens=None, adaptive_threads=False,
              convert_unbatched=False, n_gpu_layers=-1)


def detect(has_gpu: Callable[[], bool] = supports_gpu_offload) -> Backend:
    """The profile for the device this llama.cpp build reports: :data:`GPU` when it can offload
    layers to one, else :data:`CPU`. ``has_gpu``: the report (tests give their own)."""
    return GPU if has_gpu() else CPU
