"""A ``llama_batch`` whose arrays are numpy-owned, so filling it is slicing, not a Python loop."""
from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np


class Batch:
    """Up to ``capacity`` tokens, each belonging to exactly one sequence.

    llama.cpp reads ``token[i]``, ``pos[i]``, ``seq_id[i][0]`` (``n_seq_id[i] == 1``) and
    ``logits[i]`` (1 = compute logits for this row) for ``i < n_tokens``; see ``llama_batch`` in
    llama.h. Rows with logits are numbered in order and addressed by ``llama_get_logits_ith``.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.seq = np.zeros(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        self._n_seq_id = np.ones(capacity, np.int32)
        seq_ptr = self.seq.ctypes.data
        self._seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * capacity)(
            *[ctypes.cast(seq_ptr + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(capacity)])
        self.struct = llama_cpp.llama_batch()
        self.struct.token = self.token.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.embd = None
        self.struct.pos = self.pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.n_seq_id = self._n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)))
        self.struct.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.n = 0
        self.n_seqs = 0  # sequences with tokens in the batch (each adds its tokens at once)

    def clear(self) -> None:
        self.n = self.n_seqs = 0

    @property
    def room(self) -> int:
        return self.capacity - self.n

    def add(self, tokens: np.ndarray, start_pos: int, seq_id: int, want_logits_last: bool,
            all_logits: bool = False) -> int:
        """Append ``tokens`` at positions ``start_pos..`` of ``seq_id``, with logits for the last
        one (``want_logits_last``) or for every one (``all_logits``: a scoring sequence's prompt).

        Returns:
            the row index of the last token (its logits index if ``want_logits_last``); the
            chunk's rows are ``returned - len(tokens) + 1 ..`` returned.
        Raises:
            ValueError: the batch has no room.
        """
        k = len(tokens)
        if k > self.room:
            raise ValueError("batch overflow")
        a, b = self.n, self.n + k
        self.token[a:b] = tokens
        self.pos[a:b] = np.arange(start_pos, start_pos + k, dtype=np.int32)
        self.seq[a:b] = seq_id
        self.logits[a:b] = 1 if all_logits else 0
        if not all_logits:
            self.logits[b - 1] = 1 if want_logits_last else 0
        self.n_seqs += 1
        self.n = b
        return b - 1

    def as_struct(self) -> llama_cpp.llama_batch:
        self.struct.n_tokens = self.n
        return self.struct


def lone_tokens(tokens_per_seq: dict[int, int], n_ubatch: int) -> list[int]:
    """Sequences that llama.cpp will decode as a micro-batch of their one token alone.

    Mirrors ``llama_batch_allocr::split_equal(n_ubatch, sequential=true)`` (llama-batch.cpp),
    which a non-unified KV cache uses: each micro-batch takes the run of consecutive sequence
    ids starting at the lowest one with tokens left, and the same number of tokens from each,
    as many as the shortest has and ``n_ubatch`` allows.

    Args:
        tokens_per_seq: tokens each sequence (``seq_id``) has in the batch.
        n_ubatch: llama.cpp's micro-batch size.
    Returns:
        the ``seq_id`` of every single-sequence, single-token micro-batch.
    """
    left = {s: n for s, n in tokens_per_seq.items() if n > 0}
    lone = []
    while left:
        run = [min(left)]
        while run[-1] + 1 in left:
            run.append(run[-1] + 1)
        n = min(min(left[s] for s in run), max(1, n_ubatch // len(run)))
        if len(run) == 1 and n == 1:
            lone.append(run[0])
        for s in run:
            left[s] -= n
            if not left[s]:
                del left[s]
    return lone
