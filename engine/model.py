"""The model and its KV cache in llama.cpp (low-level API of llama-cpp-python)."""
from __future__ import annotations

import functools
import hashlib
import os
import signal
from typing import Callable

import llama_cpp
import numpy as np

from engine.batch import Batch
from engine.config import check_model_file
from engine.weights import cache_dir, weights_path


class DecodeError(RuntimeError):
    """``llama_decode`` returned non-zero (see llama.h: 1 = no KV slot, < 0 = error)."""


@llama_cpp.llama_log_callback
def _log_errors_only(level, text, user_data):
    """llama.cpp log sink: keep warnings and errors (GGML_LOG_LEVEL_WARN=3, ERROR=4)."""
    if level in (3, 4):
        os.write(2, text)


def _cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def amx_faults(path: str) -> bool:
    """Whether this CPU advertises AMX but faults on it running ``path`` (:func:`_amx_probe`),
    remembered for the machine's boot in the cache folder, so engine starts pay the probe's
    second or two once. CPUs without the ``amx_int8`` flag skip it (no cost on AMD)."""
    if "amx_int8" not in _cpu_flags():
        return False
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return _amx_probe(path)
    key = hashlib.sha256(f"{boot}:{os.path.realpath(path)}:{os.path.getsize(path)}".encode()).hexdigest()[:16]
    marker = os.path.join(cache_dir(), f"amx-probe-{key}")
    try:
        with open(marker) as f:
            return f.read() == "faults"
    except OSError:
        pass
    faults = _amx_probe(path)
    try:
        with open(f"{marker}.{os.getpid()}", "w") as f:
            f.write("faults" if faults else "runs")
        os.replace(f"{marker}.{os.getpid()}", marker)
    except OSError:
        pass  # not remembered: the next start probes again
    return faults


def _amx_probe(path: str) -> bool:
    """Whether this CPU advertises AMX but faults on it, so llama.cpp's AMX kernels (an "extra
    buffer type" of its CPU backend, used for Q4_0, Q4_1, Q8_0 and K-quants) must not be used.

    Seen on Sapphire Rapids guests of Firecracker VMs: CPUID lists ``amx_int8`` and the kernel
    grants ``ARCH_REQ_XCOMP_PERM``, yet the first ``tilezero`` is an invalid opcode (SIGILL)
    inside ``llama_decode``. Nothing short of running a tile instruction tells, so a forked
    child loads ``path`` with the extra buffer types and decodes a few tokens; its death by
    SIGILL is the answer.
    """
    pid = os.fork()
    if pid == 0:  # the probe: any failure but the instruction fault counts as "no fault"
        try:
            model = _load(path, vocab_only=False, extra_buffers=True)
            params = llama_cpp.llama_context_default_params()
            params.n_ctx, params.n_batch, params.n_threads, params.n_threads_batch = 64, 64, 1, 1
            ctx = llama_cpp.llama_init_from_model(model, params)
            tokens = (llama_cpp.llama_token * 8)(*range(1, 9))
            llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tokens, 8))
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGILL


def load_model(path: str, vocab_only: bool = False):
    """Load a GGUF model; returns the ``llama_model *``. Weights go into llama.cpp's extra CPU
    buffer types (repacked or AMX layouts) unless :func:`amx_faults` says this CPU faults on
    them.

    Raises:
        ConfigError: unreadable or non-GGUF file. RuntimeError: llama.cpp refused it.
    """
    check_model_file(path)
    return _load(path, vocab_only, extra_buffers=vocab_only or not amx_faults(path))


def _load(path: str, vocab_only: bool, extra_buffers: bool):
    llama_cpp.llama_log_set(_log_errors_only, None)
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = vocab_only
    params.use_extra_bufts = extra_buffers
    params.use_mmap = True
    model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    return model


class Model:
    """One llama.cpp context with ``n_seq_max = max_slots + cache_streams`` sequences of
    ``max_seq_len`` cells each.

    The KV cache is allocated once here: ``n_ctx = n_seq_max * max_seq_len``; with a non-unified
    cache every sequence (slot id = ``seq_id``) owns a stream of ``max_seq_len`` cells. Streams
    ``0 .. max_slots - 1`` hold running sequences, the ``cache_streams`` after them the prefix
    cache (:mod:`engine.prefix_cache`). ``weights``: the format computed with
    (:mod:`engine.weights`).
    """

    def __init__(self, path: str, max_slots: int, max_seq_len: int, n_batch: int, n_threads: int,
                 cache_streams: int = 0, weights: str = "auto"):
        check_model_file(path)
        self.path = weights_path(path, weights)  # the file, or a copy llama.cpp multiplies in batches
        self.model = load_model(self.path)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = (max_slots + cache_streams) * max_seq_len
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = max_slots + cache_streams
        params.kv_unified = False  # one stream per sequence (see Scheduler.gap)
        # Flash attention computes each query row on its own on the paths the engine keeps to
        # (engine.core.MAX_CHUNK_TOKENS): outputs do not depend on the batch (docs/architecture.md).
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.n_threads = params.n_threads_batch = self.n_threads = n_threads
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context (out of memory?)")
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self._progress = self._no_progress = llama_cpp.ggml_abort_callback()  # NULL: no hook
        self._reporting = False
        self.eog = frozenset(t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t))

    def set_threads(self, n_threads: int) -> None:
        """Compute threads of the next decodes (``llama_set_n_threads``; a no-op if unchanged)."""
        if n_threads != self.n_threads:
            llama_cpp.llama_set_n_threads(self.ctx, n_threads, n_threads)
            self.n_threads = n_threads

    def on_progress(self, beat: Callable[[], None]) -> None:
        """Have decodes asked to report progress call ``beat()`` after every node of llama.cpp's
        compute graph: through its abort callback, which ggml's CPU backend calls from its first
        thread after each node (``ggml_graph_compute_thread``); ours never aborts. About 0.3 us
        a call from C into Python, some 500 calls a decode of SmolLM2-135M."""
        self._progress = llama_cpp.ggml_abort_callback(lambda _data: beat() or False)  # kept: C holds it
        self._reporting = None  # (re)install at the next decode

    def decode(self, batch: Batch, report_progress: bool = False) -> None:
        """Run ``batch`` (``llama_decode``); ``report_progress``: call the :meth:`on_progress`
        hook while it runs.

        Raises:
            DecodeError: llama.cpp returned non-zero.
        """
        if report_progress != self._reporting:
            llama_cpp.llama_set_abort_callback(self.ctx, self._progress if report_progress else self._no_progress,
                                               None)
            self._reporting = report_progress
        rc = llama_cpp.llama_decode(self.ctx, batch.as_struct())
        if rc != 0:
            raise DecodeError(f"llama_decode returned {rc}")

    def logits(self, row: int) -> np.ndarray:
        """Float32 view ``[n_vocab]`` of the logits of batch row ``row`` (valid until next decode)."""
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, row)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def free_sequence(self, seq_id: int) -> None:
        """Drop every KV cell of ``seq_id``; other sequences' cells are untouched."""
        llama_cpp.llama_memory_seq_rm(self.mem, seq_id, -1, -1)

    def copy_sequence(self, src: int, dst: int, n_tokens: int = -1) -> None:
        """Make ``dst`` hold the KV cells of ``src`` at positions ``< n_tokens`` (-1: all),
        replacing whatever ``dst`` held. Across streams of a non-unified cache llama.cpp copies
        the whole stream (``llama_kv_cache::seq_cp`` supports no range there), applied at the
        next decode in the order asked; the cells past ``n_tokens`` are then dropped."""
        llama_cpp.llama_memory_seq_cp(self.mem, src, dst, -1, -1)
        if n_tokens >= 0:
            llama_cpp.llama_memory_seq_rm(self.mem, dst, n_tokens, -1)

    def move_sequence(self, src: int, dst: int) -> None:
        """Move every KV cell of ``src`` to the sequence ``dst`` (see :meth:`copy_sequence`)."""
        self.copy_sequence(src, dst)
        llama_cpp.llama_memory_seq_rm(self.mem, src, -1, -1)

    def pos_max(self, seq_id: int) -> int:
        """Highest KV position held by ``seq_id``; -1 when it holds none."""
        return llama_cpp.llama_memory_seq_pos_max(self.mem, seq_id)

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            llama_cpp.llama_model_free(self.model)
            self.model = None
