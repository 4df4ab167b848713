"""The backend profile: every choice of the engine that holds only on one kind of llama.cpp
device, in one object, so a GPU build changes this profile and nothing else.

On llama.cpp's CPU backend (the profile measured here, docs/architecture.md "Prefix cache" and
docs/performance.md "Threads", "Weights", "Prefill"):

* a sequence prefills up to 512 prompt tokens a step, llama-server's ``n_ubatch``: a step's
  weight pass is shared by as many rows as a micro-batch holds (``--n-batch`` bounds the step);
* a lone decode runs on every thread;
* compute threads adapt to other processes' use of the CPUs (:mod:`engine.threads`);
* ``--weights auto`` converts Q4_1 and Q5_1 files to Q8_0, which tinyBLAS multiplies in batches
  (:mod:`engine.llama.weights`);
* the KV cache is host memory, so the pages of streams that hold nothing go back to the kernel
  and its memory is the cells in use (:mod:`engine.llama.kv_pages`).

That fast path makes a token's KV cells and logits depend on the batch it was computed in:
CPU flash attention takes a tiled path for 64 or more query rows of one sequence
(``GGML_FA_TILE_Q``, ggml-cpu/ops.cpp) and a split-KV path for one query row over 512 or more
cells, and each sums in another order than the row-by-row path. :data:`CPU_DETERMINISTIC`
(``--deterministic``, vLLM's "batch invariance") keeps every decode on the row-by-row path: a
sequence prefills at most 63 tokens a step, and a single-token micro-batch of one sequence whose
KV view reaches 512 cells (the used cells rounded up to 256, so past 256 tokens) runs on one
thread. Greedy output is then identical with and without a prefix-cache hit and whatever the
batch; its price is measured in docs/performance.md, "Prefill".

The GPU profile offloads every layer, prefills 512 tokens of a sequence a step, keeps the thread
count fixed (the CPU threads only feed the device) and loads weights as they are; its KV cache
is device memory, all of it allocated. Its kernels
have other numerics and no deterministic profile: ``--deterministic`` is refused there. Nothing
here has run on a GPU yet (``tests/engine/test_backend.py`` checks the choice of profile with a faked
device report).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from engine.config import ConfigError
from engine.llama.library import supports_gpu_offload


@dataclass(frozen=True)
class Backend:
    """Device-specific choices of the engine.

    Attributes:
        name: ``"cpu"``, ``"cpu-deterministic"`` or ``"gpu"``.
        max_chunk_tokens: prompt tokens one sequence prefills per step (at most).
        split_kv_after_tokens: a lone single-token decode of a sequence past this many tokens
            runs on one thread; None: never.
        adaptive_threads: ``--engine-threads 0`` adapts the count to contention; otherwise 0
            means one thread per CPU, fixed.
        convert_unbatched: ``--weights auto`` converts files with no batched kernel (Q4_1, Q5_1).
        n_gpu_layers: layers offloaded to the device (``llama_model_params.n_gpu_layers``; -1 all).
        batch_invariant: greedy output does not depend on the batch or on a prefix-cache hit.
        kv_pages: the KV cache is host memory whose unused streams' pages are given back
            (:mod:`engine.llama.kv_pages`), so its memory is what the sequences use.
    """

    name: str
    max_chunk_tokens: int
    split_kv_after_tokens: int | None
    adaptive_threads: bool
    convert_unbatched: bool
    n_gpu_layers: int
    batch_invariant: bool = False
    kv_pages: bool = False


CPU = Backend("cpu", max_chunk_tokens=512, split_kv_after_tokens=None, adaptive_threads=True,
              convert_unbatched=True, n_gpu_layers=0, kv_pages=True)
CPU_DETERMINISTIC = dataclasses.replace(CPU, name="cpu-deterministic", max_chunk_tokens=63,
                                        split_kv_after_tokens=256, batch_invariant=True)
GPU = Backend("gpu", max_chunk_tokens=512, split_kv_after_tokens=None, adaptive_threads=False,
              convert_unbatched=False, n_gpu_layers=-1)


def detect(has_gpu: Callable[[], bool] = supports_gpu_offload, deterministic: bool = False) -> Backend:
    """The profile for the device this llama.cpp build reports: :data:`GPU` when it can offload
    layers to one, else :data:`CPU` (:data:`CPU_DETERMINISTIC` if ``deterministic``).
    ``has_gpu``: the report (tests give their own).

    Raises:
        ConfigError: ``deterministic`` asked of a GPU build (no batch-invariant profile there).
    """
    if has_gpu():
        if deterministic:
            raise ConfigError("--deterministic holds on llama.cpp's CPU backend only; this build offloads to a GPU")
        return GPU
    return CPU_DETERMINISTIC if deterministic else CPU
