"""KV cache memory by use on llama.cpp's CPU backend: the pages of streams that hold nothing are
handed back to the kernel (docs/architecture.md, "KV memory").

llama.cpp allocates a non-unified KV cache (``llama_kv_cache``) as one host buffer of ``n_stream``
equal streams and writes zeros over all of it at start (``ggml_backend_buffer_clear`` in its
constructor), so every cell is resident memory whether a sequence uses it or not. A stream of
``max_seq_len`` cells per slot would then cost ``slots * max_seq_len`` cells of memory. Instead,
this module finds the buffer, and ``madvise(MADV_DONTNEED)`` drops the pages of a stream once it
holds no sequence: the kernel then backs them with its shared zero page, so reading them costs no
memory and reads the zeros llama.cpp put there (masked cells are never used, and zeros are what
it cleared them to), and the first write to a page takes a fresh zeroed page. A stream's memory is
then the cells its sequence wrote, rounded up to pages, and the engine's admission bounds the
cells in use (:class:`engine.scheduler.Scheduler`). Transparent huge pages are turned off for the
buffer (``MADV_NOHUGEPAGE``): one cell written would otherwise fill 2 MiB.

The layouts it knows, as ``llama_model::create_memory`` (llama-model.cpp) builds them for a model
whose layers are all attention layers, with flash attention (V rows not transposed):

* **one cache** (full attention in every layer): one buffer; per layer a K then a V tensor
  ``[row, kv_size, n_stream]``, allocated in that order and contiguous, ``kv_size`` the
  context's ``n_ctx_seq`` cells a stream;
* **interleaved sliding-window attention** (``llama_kv_cache_iswa``: Gemma 2 and 3, every model
  whose GGUF sets ``sliding_window``; ``llama_model_n_swa`` > 0): two such caches, each its own
  buffer, the base one for the full-attention layers (``n_ctx_seq`` cells a stream) and the SWA
  one for the sliding-window layers (``GGML_PAD(min(n_ctx_seq, n_swa + n_ubatch), 256)`` cells a
  stream, llama-kv-cache-iswa.cpp, with ``swa_full`` off as :class:`engine.llama.model.Model`
  sets it). A stream of each is given back together.

Every other memory is refused (:class:`LayoutRefused`): recurrent and hybrid memories
(``llama_model_is_recurrent`` / ``is_hybrid``: a state per sequence, not cells), V transposed
(flash attention off), cells with extra position data (M-RoPE), caches without V (MLA) or of
other kinds (DSA, DSV4...): any sequence state that does not parse as exactly the caches above.
:class:`engine.llama.model.Model` then says so and falls back to a bounded cache.

Why the process's mappings are searched: llama.cpp (the version the bindings vendor) exports
neither the KV buffers' addresses nor a way to choose their allocation. The buffer type is
``ggml_backend_cpu_buffer_type()``, fixed in ``llama_kv_cache``'s constructor; the state API
(``llama_state_seq_*``) gives the cells' contents, not their place; the graph callback
(``cb_eval``), which would show the cache tensors, is fixed at context creation and then calls
into Python for every node of every decode. So the buffer is found by content: one token decoded
into sequence 0 writes one K row and one V row per layer of each cache, which
``llama_state_seq_get_data`` returns (:func:`parse_probe`); each cache's layer-0 K row is searched
for in the process's anonymous mappings, and every other row must then sit where the layout puts
it. A layout that does not hold there (a device buffer, another allocator) is refused too.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
from dataclasses import dataclass

import llama_cpp
import numpy as np

log = logging.getLogger("engine")

MADV_DONTNEED = 4
MADV_NOHUGEPAGE = 15
PAGE = mmap.PAGESIZE
#: ``io_magic`` at the start of a sequence's state (``llama_context::state_seq_get_data``).
STATE_MAGIC = 0xAF143CD8
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


class LayoutRefused(ValueError):
    """The context's KV memory is not a layout this module knows; the message says why (one line)."""


def _madvise(start: int, end: int, advice: int) -> None:
    """``madvise`` the whole pages inside ``[start, end)`` (bytes of this process)."""
    a, b = -(-start // PAGE) * PAGE, end // PAGE * PAGE
    if b > a and _libc.madvise(a, b - a, advice) != 0:
        raise OSError(ctypes.get_errno(), f"madvise({advice}) failed")


def anonymous_mappings(path: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """``(start, end)`` of this process's readable anonymous mappings (heap included)."""
    out = []
    with open(path) as f:
        for line in f:
            fields = line.split()
            if fields[1].startswith("r") and (len(fields) < 6 or fields[5] == "[heap]"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                out.append((start, end))
    return out


def resident_bytes(path: str = "/proc/self/status") -> int:
    """This process's resident memory (``VmRSS``), bytes."""
    with open(path) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass(frozen=True)
class CacheLayout:
    """One ``llama_kv_cache`` of a context.

    Attributes:
        name: ``"base"`` (full attention) or ``"swa"`` (sliding window).
        row_bytes: ``[n_layer]`` bytes of one cell's K (= V) row of each of its layers.
        kv_size: cells per stream. n_stream: streams (one per sequence).
    """

    name: str
    row_bytes: tuple[int, ...]
    kv_size: int
    n_stream: int

    @property
    def cell_bytes(self) -> int:
        """Bytes of one cell, K and V of every layer."""
        return 2 * sum(self.row_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole buffer."""
        return self.cell_bytes * self.kv_size * self.n_stream


class KvBuffer:
    """A cache's buffer, found at ``base`` (the address of layer 0's K tensor)."""

    def __init__(self, base: int, layout: CacheLayout):
        self.layout = layout
        self.tensors = []  # (address, bytes of one stream) of every K and V tensor, in memory order
        at = base
        for row in layout.row_bytes:
            for _ in "kv":
                self.tensors.append((at, row * layout.kv_size))
                at += row * layout.kv_size * layout.n_stream
        self.start, self.end = base, at
        _madvise(base, self.end, MADV_NOHUGEPAGE)

    def release(self, stream: int) -> None:
        """Give back the pages of ``stream``. Pages shared with a neighbouring stream at either
        end are kept."""
        for at, stream_bytes in self.tensors:
            start = at + stream * stream_bytes
            _madvise(start, start + stream_bytes, MADV_DONTNEED)


class KvPages:
    """The KV buffers of one context (one per cache of its layout) and :meth:`release`."""

    def __init__(self, buffers: list[KvBuffer]):
        self.buffers = buffers
        self.n_stream = buffers[0].layout.n_stream

    @property
    def layouts(self) -> list[CacheLayout]:
        return [b.layout for b in self.buffers]

    def release(self, stream: int) -> None:
        """Give back the pages of ``stream`` in every cache (it holds no cell llama.cpp will read
        as data)."""
        for buffer in self.buffers:
            buffer.release(stream)

    def release_all(self) -> None:
        for stream in range(self.n_stream):
            self.release(stream)

    @classmethod
    def locate(cls, ctx, mem, model, n_stream: int, n_ubatch: int, decode_probe) -> "KvPages":
        """Find the KV buffers of ``ctx`` (see the module docstring). ``decode_probe()`` decodes
        one token into sequence 0 of the empty cache; its cells are removed before this returns.

        Raises:
            LayoutRefused: the memory is not a layout this module knows, or not where it puts it.
        """
        if llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model):
            kind = "recurrent" if llama_cpp.llama_model_is_recurrent(model) else "hybrid"
            raise LayoutRefused(f"a {kind} memory (a state per sequence, not KV cells)")
        n_ctx_seq, n_swa = llama_cpp.llama_n_ctx_seq(ctx), llama_cpp.llama_model_n_swa(model)
        kv_sizes = [n_ctx_seq] if n_swa == 0 else [n_ctx_seq, swa_cells(n_ctx_seq, n_swa, n_ubatch)]
        decode_probe()
        try:
            size = llama_cpp.llama_state_seq_get_size(ctx, 0)
            state = (ctypes.c_uint8 * size)()
            llama_cpp.llama_state_seq_get_data(ctx, state, size, 0)
            caches = parse_probe(bytes(state))
        finally:
            llama_cpp.llama_memory_seq_rm(mem, 0, -1, -1)
        if len(caches) != len(kv_sizes):
            raise LayoutRefused(f"{len(caches)} KV caches where {len(kv_sizes)} were expected "
                                f"(sliding window {n_swa})")
        buffers = []
        for name, kv_size, (streams, rows) in zip(("base", "swa"), kv_sizes, caches):
            if streams != n_stream:
                raise LayoutRefused(f"{streams} streams in the {name} cache where {n_stream} were expected")
            layout = CacheLayout(name, tuple(len(k) for k, _ in rows), kv_size, n_stream)
            base = _search(rows, layout, [(b.start, b.end) for b in buffers])
            if base is None:
                raise LayoutRefused(f"the {name} cache's buffer is not where llama.cpp's CPU layout puts it")
            buffers.append(KvBuffer(base, layout))
        return cls(buffers)


def swa_cells(n_ctx_seq: int, n_swa: int, n_ubatch: int) -> int:
    """Cells a stream of the sliding-window cache has, non-unified and ``swa_full`` off
    (``llama_kv_cache_iswa``: ``GGML_PAD(min(size_base, n_swa + n_ubatch), 256)``)."""
    return -(-min(n_ctx_seq, n_swa + n_ubatch) // 256) * 256


class _Reader:
    """Little-endian fields of a byte string, read in order; a short read raises LayoutRefused."""

    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.data):
            raise LayoutRefused("the sequence state ends early")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def u32(self) -> int:
        return int.from_bytes(self.take(4), "little")

    def i32(self) -> int:
        return int.from_bytes(self.take(4), "little", signed=True)

    def u64(self) -> int:
        return int.from_bytes(self.take(8), "little")


def parse_probe(state: bytes) -> list[tuple[int, list[tuple[bytes, bytes]]]]:
    """The caches of a sequence state that holds one cell (position 0 of sequence 0):
    ``[(n_stream, [(K row, V row) of each layer])]``, in the order llama.cpp writes them (base,
    then SWA).

    The state is ``llama_context::state_seq_get_data``'s: the magic and the sequence id, then each
    cache's ``llama_kv_cache::state_write``: the stream count; per stream the cell count (1 in
    stream 0, 0 in the others) and, for the cell, its metadata (position, one sequence id) and
    data: ``v_trans``, the layer count, per layer an int32 type, a uint64 row size and the K
    row, then the same for V.

    Raises:
        LayoutRefused: anything else (V transposed, cell extras, no V, a trailing part...).
    """
    r = _Reader(state)
    if r.u32() != STATE_MAGIC or r.i32() != 0:
        raise LayoutRefused("the sequence state has no known header")
    caches = []
    while r.at < len(state):
        n_stream = r.u32()
        if not 1 <= n_stream <= 256:
            raise LayoutRefused(f"a KV cache of {n_stream} streams")
        rows = None
        for s in range(n_stream):
            cells = r.u32()
            if cells != (1 if s == 0 else 0):
                raise LayoutRefused(f"{cells} cells in stream {s} of a one-cell sequence")
            if cells:
                rows = _cell(r)
        caches.append((n_stream, rows))
    if not caches:
        raise LayoutRefused("the sequence state holds no KV cache")
    return caches


def _cell(r: _Reader) -> list[tuple[bytes, bytes]]:
    """One cell's metadata and rows (see :func:`parse_probe`)."""
    if (r.i32(), r.u32(), r.i32()) != (0, 1, 0):  # position 0, one sequence id: 0
        raise LayoutRefused("the cell's metadata is not a position and a sequence id")
    v_trans, n_layer = r.u32(), r.u32()
    if v_trans != 0:
        raise LayoutRefused("V is transposed (flash attention off)")
    if not 1 <= n_layer <= 4096:
        raise LayoutRefused(f"a KV cache of {n_layer} layers")
    rows = []
    for _ in range(2 * n_layer):
        r.i32()  # ggml type
        rows.append(r.take(r.u64()))
    k, v = rows[:n_layer], rows[n_layer:]
    if any(len(a) != len(b) or not a for a, b in zip(k, v)):
        raise LayoutRefused("K and V rows of different sizes")
    return list(zip(k, v))


def _view(address: int, n: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_uint8 * n).from_address(address), np.uint8)


def _search(rows: list[tuple[bytes, bytes]], layout: CacheLayout, found: list[tuple[int, int]]) -> int | None:
    """The address of the buffer holding ``rows`` laid out as ``layout``, outside the ranges
    ``found``; None when no mapping holds it."""
    for start, end in anonymous_mappings():
        if end - start < layout.nbytes:
            continue
        for base in _candidates(start, end - layout.nbytes, rows[0][0]):
            if _layout_holds(base, rows, layout) and not any(a <= base < b for a, b in found):
                return base
    return None


def _candidates(start: int, last: int, row: bytes):
    """The 32-byte-aligned addresses in ``[start, last]`` (``start`` page-aligned) holding ``row``:
    first those 64 bytes into a page (where glibc puts a large ``posix_memalign`` block of its own
    mapping), then every other, each in ascending order."""
    if last < start:
        return
    key = np.frombuffer(row[:8], np.uint64)[0]
    words = np.frombuffer((ctypes.c_uint64 * ((last - start) // 8 + 1)).from_address(start), np.uint64)
    seen = set()
    for offset, step in ((64 // 8, PAGE // 8), (0, 32 // 8)):
        for h in np.flatnonzero(words[offset::step] == key):
            address = start + 8 * (offset + int(h) * step)
            if address not in seen and bytes(_view(address, len(row))) == row:
                seen.add(address)
                yield address


def _layout_holds(base: int, rows: list[tuple[bytes, bytes]], layout: CacheLayout) -> bool:
    """Whether every layer's K and V row of the probe sit at their tensors' first cell."""
    at = base
    for k, v in rows:
        for row in (k, v):
            if bytes(_view(at, len(row))) != row:
                return False
            at += len(row) * layout.kv_size * layout.n_stream
    return True
