"""The model and its KV cache in llama.cpp (low-level API of llama-cpp-python)."""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Callable

import llama_cpp
import numpy as np

from engine.llama.backend import CPU, Backend, detect
from engine.llama.batch import Batch
from engine.llama.kv_pages import KvPages
from engine.llama.library import load_model
from engine.llama.weights import weights_path

if TYPE_CHECKING:
    from engine.config import EngineConfig


class DecodeError(RuntimeError):
    """``llama_decode`` returned non-zero (see llama.h: 1 = no KV slot, < 0 = error)."""


class Model:
    """One llama.cpp context with ``n_seq_max = max_slots + cache_streams`` sequences of
    ``max_seq_len`` cells each.

    The KV cache is allocated once here: ``n_ctx = n_seq_max * max_seq_len``; with a non-unified
    cache every sequence (slot id = ``seq_id``) owns a stream of ``max_seq_len`` cells (llama.cpp
    rounds a stream up to a multiple of 256 cells; the engine uses ``max_seq_len`` of them). Streams
    ``0 .. max_slots - 1`` hold running sequences, the ``cache_streams`` after them the prefix
    cache (:mod:`engine.prefix_cache`). Where the backend profile allows it
    (``Backend.kv_pages``), a stream's memory is what its sequence wrote
    (:mod:`engine.llama.kv_pages`); :attr:`pages` is None when the buffer was not found.
    ``path``: the GGUF to compute with (:meth:`from_config` resolves the configured weight
    format to it); ``backend``: the device profile.

    Raises:
        ConfigError: unreadable or non-GGUF file. RuntimeError: llama.cpp refused the model or
        could not allocate the context.
    """

    def __init__(self, path: str, max_slots: int, max_seq_len: int, n_batch: int, n_threads: int,
                 cache_streams: int = 0, backend: Backend = CPU):
        self.path, self.backend = path, backend
        self.model = load_model(self.path, n_gpu_layers=backend.n_gpu_layers)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = (max_slots + cache_streams) * max_seq_len
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = max_slots + cache_streams
        params.kv_unified = False  # one stream per sequence (see Scheduler.gap)
        # Flash attention: on the paths the deterministic profile keeps to (engine.llama.backend)
        # it computes each query row on its own, so outputs do not depend on the batch
        # (docs/architecture.md, "Prefix cache").
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
        self.pages = None
        if backend.kv_pages:
            # A stream's cells as llama.cpp sized it: max_seq_len rounded up to a multiple of 256
            # (``llama_context``'s ``n_ctx_seq``), not max_seq_len itself.
            self.pages = KvPages.locate(self.ctx, self.mem, self.model, llama_cpp.llama_n_ctx_seq(self.ctx),
                                        params.n_seq_max, self._decode_probe)
            if self.pages is not None:
                self.pages.release_all()

    def _decode_probe(self) -> None:
        """Decode one token into sequence 0 (for :meth:`KvPages.locate`)."""
        batch = Batch(1)
        batch.add(np.array([0], np.int32), 0, 0, False)
        self.decode(batch)

    @classmethod
    def from_config(cls, config: "EngineConfig", backend: Backend | None = None) -> "Model":
        """The model an engine with ``config`` computes with, on ``backend`` (default: the one
        llama.cpp reports, :func:`engine.llama.backend.detect`), its weights in the configured
        format (converted once if need be, :func:`engine.llama.weights.weights_path`)."""
        backend = backend or detect(deterministic=config.deterministic)
        path = weights_path(config.model_path, config.weights, backend=backend)
        return cls(path, config.max_slots, config.max_seq_len, config.n_batch, config.threads,
                   config.cache_streams, backend)

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

    def logits_rows(self, first: int, n: int) -> np.ndarray:
        """Float32 ``[n, n_vocab]`` logits of batch rows ``first .. first + n - 1``, each computed
        with logits (valid until the next decode). llama.cpp keeps outputs in batch order, so the
        rows are one view of its buffer; a copy is made if they are not contiguous there."""
        ptrs = [ctypes.cast(llama_cpp.llama_get_logits_ith(self.ctx, first + i), ctypes.c_void_p).value
                for i in (0, n - 1)]
        row_bytes = 4 * self.n_vocab
        if ptrs[1] - ptrs[0] == (n - 1) * row_bytes:
            return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, first), shape=(n, self.n_vocab))
        return np.stack([self.logits(first + i) for i in range(n)])

    def free_sequence(self, seq_id: int) -> None:
        """Drop every KV cell of ``seq_id`` and give its stream's memory back; other sequences'
        cells are untouched."""
        llama_cpp.llama_memory_seq_rm(self.mem, seq_id, -1, -1)
        if self.pages is not None:
            self.pages.release(seq_id)

    def copy_sequence(self, src: int, dst: int, n_tokens: int = -1) -> None:
        """Make ``dst`` hold the KV cells of ``src`` at positions ``< n_tokens`` (-1: all),
        replacing whatever ``dst`` held, now. Through llama.cpp's sequence state
        (``llama_state_seq_get_data`` / ``set_data``), which copies the cells ``src`` uses, not
        its whole stream as ``llama_memory_seq_cp`` does across streams: a stream has
        ``max_seq_len`` cells, and a copy of all of them would also make all of ``dst``'s
        memory resident.

        Raises:
            RuntimeError: llama.cpp could not restore the cells (no room in ``dst``'s stream).
        """
        size = llama_cpp.llama_state_seq_get_size(self.ctx, src)
        state = np.empty(size, np.uint8)
        ptr = state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        size = llama_cpp.llama_state_seq_get_data(self.ctx, ptr, size, src)
        self.free_sequence(dst)
        if not llama_cpp.llama_state_seq_set_data(self.ctx, ptr, size, dst):
            raise RuntimeError(f"llama.cpp could not copy the KV cells of sequence {src} to {dst}")
        if n_tokens >= 0:
            llama_cpp.llama_memory_seq_rm(self.mem, dst, n_tokens, -1)

    def move_sequence(self, src: int, dst: int) -> None:
        """Move every KV cell of ``src`` to the sequence ``dst`` (see :meth:`copy_sequence`)."""
        self.copy_sequence(src, dst)
        self.free_sequence(src)

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
