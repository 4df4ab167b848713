"""The model and its KV cache in llama.cpp (low-level API of llama-cpp-python): the generation
context (:class:`Model`) and what every context of the engine shares (:class:`Context`)."""
from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING, Callable

import llama_cpp
import numpy as np

from engine.llama.backend import CPU, Backend, detect
from engine.llama.batch import Batch
from engine.llama.kv_pages import KvPages, LayoutRefused, resident_bytes
from engine.llama.library import load_model
from engine.llama.weights import weights_path

if TYPE_CHECKING:
    from engine.config import EngineConfig

log = logging.getLogger("engine")

#: Bytes of logits one decode may produce: llama.cpp keeps them twice, in its compute buffer and
#: in its output buffer, and neither shrinks once touched. 32 MiB: 170 rows of SmolLM2's 49,152
#: tokens, 32 of Gemma 3's 262,144 (1 MiB a row), whose 96 rows made a scoring request leave
#: 150 MB more resident for good (docs/architecture.md, "KV memory": logits rows).
LOGITS_BYTES = 32 << 20


def logits_rows(n_vocab: int, n_seq_max: int, n_batch: int) -> int:
    """Logits rows a decode may ask for: :data:`LOGITS_BYTES` of float32 rows of ``n_vocab``,
    at most ``n_batch``, and at least one per sequence of the context (each decoding sequence
    samples from one; llama.cpp's ``output_reserve`` asserts room for ``n_seq_max`` rows)."""
    return max(n_seq_max, min(n_batch, LOGITS_BYTES // (4 * n_vocab)))


def reuse_window(model) -> int | None:
    """How much of the cells a sequence holds another sequence can be given
    (:func:`engine.prefix_cache.reusable`): None where every layer attends to the whole context
    (a prefix of any length is whole); the sliding window's length in tokens where some layers
    see only that many (``llama_model_n_swa``: older cells are dropped, and a copy carries only
    the window); 0 for a recurrent or hybrid model, whose state is its last position's only."""
    if llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model):
        return 0
    return llama_cpp.llama_model_n_swa(model) or None


class DecodeError(RuntimeError):
    """``llama_decode`` returned non-zero (see llama.h: 1 = no KV slot, < 0 = error)."""


class Context:
    """What the engine's llama.cpp contexts share (:class:`Model`, generating;
    :class:`engine.llama.embedding.EmbeddingModel`, pooling embeddings): the model loaded from
    ``path`` on ``backend``, the context's compute threads, the progress hook of its decodes, the
    decode itself, and freeing both. A subclass creates ``self.ctx`` (:meth:`_context`) from
    :meth:`_params`.

    Raises:
        ConfigError: unreadable or non-GGUF file. RuntimeError: llama.cpp refused the model.
    """

    def __init__(self, path: str, n_threads: int, backend: Backend = CPU):
        self.path, self.backend = path, backend
        self.ctx = None
        self.model = load_model(self.path, n_gpu_layers=backend.n_gpu_layers)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_threads = n_threads
        self._progress = self._no_progress = llama_cpp.ggml_abort_callback()  # NULL: no hook
        self._reporting = False

    def _params(self, n_batch: int):
        """llama.cpp's context parameters every context of the engine takes: ``n_batch`` tokens
        a decode in one micro-batch, flash attention, the compute threads, no perf counters."""
        params = llama_cpp.llama_context_default_params()
        params.n_batch = params.n_ubatch = n_batch
        # Flash attention: on the paths the deterministic profile keeps to (engine.llama.backend)
        # it computes each query row on its own, so outputs do not depend on the batch
        # (docs/architecture.md, "Prefix cache"). It also keeps V untransposed (kv_pages).
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.n_threads = params.n_threads_batch = self.n_threads
        params.no_perf = True
        return params

    def _context(self, params):
        ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context (out of memory?)")
        return ctx

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

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            llama_cpp.llama_model_free(self.model)
            self.model = None


class Model(Context):
    """One llama.cpp context with ``n_seq_max = max_slots + cache_streams`` sequences of
    ``max_seq_len`` cells each.

    The KV cache is allocated once here: ``n_ctx = n_seq_max * max_seq_len``; with a non-unified
    cache every sequence (slot id = ``seq_id``) owns a stream of ``max_seq_len`` cells (llama.cpp
    rounds a stream up to a multiple of 256 cells; the engine uses ``max_seq_len`` of them). Streams
    ``0 .. max_slots - 1`` hold running sequences, the ``cache_streams`` after them the prefix
    cache (:mod:`engine.prefix_cache`). A model with sliding-window layers gets llama-server's
    sliding-window cache (``swa_full`` off): those layers keep ``n_swa + n_batch`` cells a
    stream, rounded up to 256, not ``max_seq_len``. Where the backend profile allows it
    (``Backend.kv_pages``), a stream's memory is what its sequence wrote
    (:mod:`engine.llama.kv_pages`, :attr:`pages`); where that module refuses the context's
    memory layout, the engine says so at WARNING level and recreates the context with llama.cpp's
    unified cache of ``kv_cells`` cells (:attr:`pages` None). ``path``: the GGUF to compute with
    (:meth:`from_config` resolves the configured weight format to it); ``backend``: the device
    profile; ``kv_cells``: cells the running sequences and the prefix cache hold together at most
    (the size of the unified cache, if it comes to that).

    Raises:
        ConfigError: unreadable or non-GGUF file. RuntimeError: llama.cpp refused the model or
        could not allocate the context.
    """

    def __init__(self, path: str, max_slots: int, max_seq_len: int, n_batch: int, n_threads: int,
                 cache_streams: int = 0, backend: Backend = CPU, kv_cells: int | None = None):
        super().__init__(path, n_threads, backend)
        n_seq_max = max_slots + cache_streams
        #: Logits rows one decode may ask for (:func:`logits_rows`); llama.cpp sizes its output
        #: buffer and the logits in its compute buffer to it.
        self.max_logits_rows = logits_rows(self.n_vocab, n_seq_max, n_batch)
        self.params = params = self._params(n_batch)
        params.n_ctx = n_seq_max * max_seq_len
        params.n_seq_max = n_seq_max
        params.n_outputs_max = self.max_logits_rows
        params.kv_unified = False  # one stream per sequence (see Scheduler.gap)
        params.swa_full = False  # llama-server's default: sliding-window layers keep the window only
        self.ctx = self._context(params)
        self.pages = None
        if backend.kv_pages:
            try:
                self.pages = KvPages.locate(self.ctx, llama_cpp.llama_get_memory(self.ctx), self.model, n_seq_max,
                                            n_batch, self._decode_probe)
                self.pages.release_all()
            except LayoutRefused as e:
                self._fall_back(str(e), kv_cells or n_seq_max * max_seq_len)
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.eog = frozenset(t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, t))
        #: How much of a copied sequence another one can reuse (PrefixCache.window): None with
        #: full attention; the sliding window's tokens; 0 for a recurrent or hybrid state.
        self.window = reuse_window(self.model)

    def _fall_back(self, reason: str, kv_cells: int) -> None:
        """Replace the context, whose KV memory :mod:`engine.llama.kv_pages` refused (``reason``),
        with one whose cache is llama.cpp's unified one of ``kv_cells`` cells (rounded up to 256),
        shared by every sequence, and log at WARNING level what it holds resident (the resident
        memory the new context added: llama.cpp clears its whole KV memory at start)."""
        llama_cpp.llama_free(self.ctx)
        self.ctx, self._reporting = None, False
        before = resident_bytes()
        self.params.kv_unified = True
        self.params.n_ctx = -(-kv_cells // 256) * 256
        self.ctx = self._context(self.params)
        log.warning("KV memory: llama.cpp's cache for this model is %s, whose unused memory the engine cannot give "
                    "back; using llama.cpp's unified cache of %d cells instead: %.0f MB resident", reason,
                    self.params.n_ctx, (resident_bytes() - before) / 1e6)

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
                   config.cache_streams, backend, config.kv_cache_tokens + config.prefix_cache_tokens + config.n_batch)

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

    def pos_min(self, seq_id: int) -> int:
        """Lowest KV position held by ``seq_id`` (of its sliding-window cells, where the model has
        some: llama.cpp's ``llama_memory_seq_pos_min``); -1 when it holds none."""
        return llama_cpp.llama_memory_seq_pos_min(self.mem, seq_id)

    def pos_max(self, seq_id: int) -> int:
        """Highest KV position held by ``seq_id``; -1 when it holds none."""
        return llama_cpp.llama_memory_seq_pos_max(self.mem, seq_id)

