"""Prefix cache: the KV cells of finished sequences, kept for reuse, scoped per tenant
(docs/architecture.md, "Prefix cache").

The KV cache has ``max_slots`` streams for running sequences (slot id = llama ``seq_id``) and
``n_streams`` more, numbered from ``first_stream``, that only hold cache entries. An entry is the
token ids whose KV a stream holds, at positions ``0 .. len(tokens) - 1``, and the tenant whose
request produced them. A retiring sequence's stream is copied into a cache stream; a new
sequence whose prompt starts with an entry's tokens gets that stream copied into its slot and
prefills only the rest. Entries live in their own streams, not in free slots, because the
running slots are kept consecutive (one micro-batch per decode; ``Scheduler.gap``), which moves
sequences over whatever a free slot holds.

Only entries of the requesting tenant are ever candidates: a shared cache would let one tenant
learn another's prompts from time to first token (the side channel that vLLM's ``cache_salt``
closes). The cache is bounded by ``max_tokens`` tokens and by its streams, and evicts the least
recently used entry first.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int32 token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass(eq=False)
class Entry:
    """One cached prefix: the cells of ``stream`` hold ``tokens`` (KV positions ``0..len-1``).

    Attributes:
        stream: llama ``seq_id`` of a cache stream. tenant: the 62-bit tenant identity whose
        request produced the cells. tokens: int32 ``[n]``. used: LRU clock of the last use.
    """

    stream: int
    tenant: int
    tokens: np.ndarray
    used: int = 0


@dataclass
class PrefixCache:
    """Which cache stream holds which tokens of which tenant; knows nothing of llama.cpp (the
    engine core copies the cells as this class decides).

    Args:
        first_stream: the first cache stream's ``seq_id`` (= ``max_slots``).
        n_streams: cache streams (each holds one entry of at most ``max_seq_len`` tokens).
        max_tokens: most tokens held by all entries together.
    """

    first_stream: int
    n_streams: int
    max_tokens: int
    entries: dict[int, Entry] = field(default_factory=dict)  # stream -> entry
    _clock: itertools.count = field(default_factory=itertools.count)

    @property
    def streams(self) -> range:
        """Every cache stream's ``seq_id``."""
        return range(self.first_stream, self.first_stream + self.n_streams)

    @property
    def n_tokens(self) -> int:
        """Tokens held by every entry together."""
        return sum(len(e.tokens) for e in self.entries.values())

    def lookup(self, tenant: int, prompt: np.ndarray, touch: bool = True) -> tuple[Entry | None, int]:
        """The entry of ``tenant`` sharing the longest prefix with ``prompt``, and that length
        (``(None, 0)`` when none shares a token). Touches the entry it returns, if asked."""
        best, best_n = None, 0
        for entry in self.entries.values():
            if entry.tenant == tenant:
                n = common_prefix(entry.tokens, prompt)
                if n > best_n:
                    best, best_n = entry, n
        if best is not None and touch:
            best.used = next(self._clock)
        return best, best_n

    def insert(self, tenant: int, tokens: np.ndarray) -> tuple[int | None, list[int]]:
        """Make room for ``tokens`` of ``tenant`` and record them.

        An entry of the same tenant that starts with ``tokens`` already covers them: nothing is
        stored (it is touched). Entries of the tenant that ``tokens`` extend are dropped, so a
        conversation keeps one entry, its latest turn. Then least recently used entries are
        evicted until a stream is free and the tokens fit in ``max_tokens``.

        Returns:
            ``(stream to copy the cells into, or None to store nothing; streams evicted)``.
        """
        n = len(tokens)
        if n == 0 or n > self.max_tokens or self.n_streams == 0:
            return None, []
        dropped = []
        for entry in list(self.entries.values()):
            if entry.tenant != tenant:
                continue
            shared = common_prefix(entry.tokens, tokens)
            if shared == n:
                entry.used = next(self._clock)
                return None, []
            if shared == len(entry.tokens):
                dropped.append(self._drop(entry))
        while len(self.entries) >= self.n_streams or self.n_tokens + n > self.max_tokens:
            dropped.append(self._drop(min(self.entries.values(), key=lambda e: e.used)))
        stream = min(set(self.streams) - self.entries.keys())
        self.entries[stream] = Entry(stream, tenant, tokens.copy(), next(self._clock))
        return stream, dropped

    def _drop(self, entry: Entry) -> int:
        del self.entries[entry.stream]
        return entry.stream
