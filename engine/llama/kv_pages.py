"""KV cache memory by use on llama.cpp's CPU backend: the pages of streams that hold nothing are
handed back to the kernel (docs/architecture.md, "KV memory").

llama.cpp allocates a non-unified KV cache as one host buffer of ``n_stream`` equal streams and
writes zeros over all of it at start (``ggml_backend_buffer_clear`` in ``llama_kv_cache``), so
every cell is resident memory whether a sequence uses it or not. A stream of ``max_seq_len``
cells per slot would then cost ``slots * max_seq_len`` cells of memory. Instead, this module
finds the buffer, and ``madvise(MADV_DONTNEED)`` drops the pages of a stream once it holds no
sequence: the kernel then backs them with its shared zero page, so reading them costs no memory
and reads the zeros llama.cpp put there (masked cells are never used, and zeros are what it
cleared them to), and the first write to a page takes a fresh zeroed page. A stream's memory is
then the cells its sequence wrote, rounded up to pages (a page holds about ten cells' row of one
layer), and the engine's admission bounds the cells in use (:class:`engine.scheduler.Scheduler`).
Transparent huge pages are turned off for the buffer (``MADV_NOHUGEPAGE``): one cell written
would otherwise fill 2 MiB.

llama.cpp does not export the buffer's address. It is found by content: one token decoded into
sequence 0 writes one K row and one V row per layer, which ``llama_state_seq_get_data`` returns;
the row of layer 0's K is searched for in the process's anonymous mappings, and every other
layer's K and V rows must then sit where llama.cpp's layout puts them (``llama_kv_cache``: per
layer a K then a V tensor ``[row, kv_size, n_stream]``, allocated in that order and contiguous).
Anything else (another llama.cpp layout, a device buffer) leaves the pages alone and says so:
memory is then the whole buffer, as before.
"""
from __future__ import annotations

import ctypes
import logging
import mmap

import llama_cpp
import numpy as np

log = logging.getLogger("engine")

MADV_DONTNEED = 4
MADV_NOHUGEPAGE = 15
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


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


class KvPages:
    """The KV buffer of one context: where each stream's cells lie, and :meth:`release`.

    Args:
        base: address of layer 0's K tensor. row_bytes: ``[n_layer]`` bytes of one cell's K
            (= V) row of each layer. kv_size: cells per stream. n_stream: streams.
    """

    def __init__(self, base: int, row_bytes: list[int], kv_size: int, n_stream: int):
        self.kv_size, self.n_stream = kv_size, n_stream
        self.tensors = []  # (address, bytes of one stream) of every K and V tensor, in memory order
        at = base
        for row in row_bytes:
            for _ in "kv":
                self.tensors.append((at, row * kv_size))
                at += row * kv_size * n_stream
        self.end = at
        _madvise(base, self.end, MADV_NOHUGEPAGE)

    def release(self, stream: int) -> None:
        """Give back the pages of ``stream`` (it holds no cell llama.cpp will read as data).
        Pages shared with a neighbouring stream at either end are kept."""
        for at, stream_bytes in self.tensors:
            start = at + stream * stream_bytes
            _madvise(start, start + stream_bytes, MADV_DONTNEED)

    def release_all(self) -> None:
        for stream in range(self.n_stream):
            self.release(stream)

    @classmethod
    def locate(cls, ctx, mem, model, kv_size: int, n_stream: int, decode_probe) -> "KvPages | None":
        """Find the KV buffer of ``ctx`` (see the module docstring); None when it is not where
        llama.cpp's CPU layout puts it. ``decode_probe()`` decodes one token into sequence 0 of
        the empty cache; its cells are removed before this returns."""
        n_layer = llama_cpp.llama_model_n_layer(model)
        decode_probe()
        try:
            size = llama_cpp.llama_state_seq_get_size(ctx, 0)
            state = (ctypes.c_uint8 * size)()
            llama_cpp.llama_state_seq_get_data(ctx, state, size, 0)
            rows = _probe_rows(bytes(state), n_layer)
        finally:
            llama_cpp.llama_memory_seq_rm(mem, 0, -1, -1)
        if rows is None:
            return None
        row_bytes = [len(k) for k, _ in rows]
        total = sum(2 * r * kv_size * n_stream for r in row_bytes)
        for start, end in anonymous_mappings():
            if end - start < total:
                continue
            base = _find(start, end - total, rows[0][0])
            if base is not None and _layout_holds(base, rows, kv_size, n_stream):
                return cls(base, row_bytes, kv_size, n_stream)
        log.warning("KV buffer not found where llama.cpp's CPU layout puts it: its memory stays resident")
        return None


def _probe_rows(state: bytes, n_layer: int) -> list[tuple[bytes, bytes]] | None:
    """Each layer's ``(K row, V row)`` of the one cell in a sequence's state, or None when the
    state is not laid out as llama.cpp writes one cell (``llama_context::state_seq_get_data``
    and ``llama_kv_cache::state_write``: a magic and the sequence id, the stream count, the
    first stream's cell count, the cell's metadata, then ``v_trans``, the layer count, and per
    layer an int32 type, a uint64 row size and the row for K, then the same for V)."""
    u32 = lambda at: int.from_bytes(state[at:at + 4], "little")  # noqa: E731
    if len(state) < 16 or u32(12) != 1:
        return None
    for at in range(16, min(len(state) - 8, 64), 4):  # past the cell's metadata
        if u32(at) == 0 and u32(at + 4) == n_layer:  # v_trans 0 (flash attention), n_layer
            break
    else:
        return None
    at += 8
    rows = []
    for _ in range(2 * n_layer):
        size = int.from_bytes(state[at + 4:at + 12], "little")
        if not 0 < size <= len(state) - at - 12:
            return None
        rows.append(state[at + 12:at + 12 + size])
        at += 12 + size
    return list(zip(rows[:n_layer], rows[n_layer:]))


def _view(address: int, n: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_uint8 * n).from_address(address), np.uint8)


def _find(start: int, last: int, row: bytes) -> int | None:
    """The lowest 32-byte-aligned address in ``[start, last]`` holding ``row``, or None.
    First 64 bytes into each page (where glibc puts a large ``posix_memalign`` block of its own
    mapping), then at every aligned address."""
    if last < start:
        return None
    key = np.frombuffer(row[:8], np.uint64)[0]
    words = np.frombuffer((ctypes.c_uint64 * ((last - start) // 8 + 1)).from_address(start), np.uint64)
    for offset, step in ((64 // 8, PAGE // 8), (0, 32 // 8)):
        for h in np.flatnonzero(words[offset::step] == key):
            address = start + 8 * (offset + int(h) * step)
            if bytes(_view(address, len(row))) == row:
                return address
    return None


def _layout_holds(base: int, rows: list[tuple[bytes, bytes]], kv_size: int, n_stream: int) -> bool:
    """Whether every layer's K and V row of the probe sit at their tensors' first cell."""
    at = base
    for k, v in rows:
        for row in (k, v):
            if bytes(_view(at, len(row))) != row:
                return False
            at += len(row) * kv_size * n_stream
    return True
