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

A copy carries what llama.cpp keeps of a sequence, and that is not every position on every model
(:func:`reusable`): where layers attend through a sliding window, a sequence longer than the
window gives only all its cells, never a shorter prefix; a recurrent state only all of it. A
prefix that cannot be given is prefilled, never reused wrong.

Only entries of the requesting tenant are ever candidates: a shared cache would let one tenant
learn another's prompts from time to first token (the side channel that vLLM's ``cache_salt``
closes). The cache is bounded by ``max_tokens`` tokens and by its streams, and evicts the least
recently used entry first.

The cache decides and the core acts: :meth:`PrefixCache.reuse`, :meth:`PrefixCache.keep` and
:meth:`PrefixCache.awaits` return decisions and KV cell actions (:mod:`engine.step_plan`) and
never call llama.cpp.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from engine.sequence import Sequence
from engine.step_plan import CellAction, CopyCells, FreeCells

#: Shortest prefix worth reusing: below it a copy saves too little prefill to matter.
MIN_REUSE_TOKENS = 8
#: A copy carries every cell its source holds (Model.copy_sequence), so a prefix is reused only
#: when it is at least this fraction of them. Measured on SmolLM2-135M, 2 threads: a copy costs
#: 0.018 ms a source cell (143 ms for 8,000), a lone prefill about 1.7 ms a token, so below
#: 1/64 the copy would stall the step for about what it saves (docs/architecture.md "KV memory").
COPY_CELLS_PER_REUSED_TOKEN = 64


def reusable(held: int, n: int, window: int | None) -> bool:
    """Whether a sequence whose cells hold the tokens ``[0, held)`` can give its first
    ``n <= held`` of them to another (a copy, then the cells from ``n`` on removed) so that the
    other computes what it would have computed from scratch.

    ``window`` is :attr:`engine.llama.model.Model.window`. None: every layer attends to the whole
    context and keeps every position, so any prefix. 0: a recurrent state is its last position's
    only, so all of it. ``w > 0``: sliding-window layers attend from position ``p`` to
    ``(p - w, p]`` (``llama_hparams::is_masked_swa``), and llama.cpp may drop a cell once no
    next position of its sequence sees it: after ``held`` tokens only ``[held + 1 - w, held)`` is
    sure to be there (``llama_kv_cache::find_slot``; the sequence state a copy goes through keeps
    ``[held - w, held)``, ``state_write``). Position ``n`` needs ``[n + 1 - w, n)``: all of
    ``[0, n)`` when ``n < w``. So a sequence shorter than the window gives any prefix, and a
    longer one only all its tokens (``n == held``). llama-server's rule asks the same of the
    cells it finds (``llama_memory_seq_pos_min``, tools/server/server-context.cpp).
    """
    return n == held or window is None or held < window


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


def worth_copying(n: int, cells: int) -> bool:
    """Whether copying a source of ``cells`` KV cells to give a prompt ``n`` tokens is worth it:
    at least :data:`MIN_REUSE_TOKENS`, and at least 1/:data:`COPY_CELLS_PER_REUSED_TOKEN` of the
    cells (a copy carries them all)."""
    return n >= MIN_REUSE_TOKENS and n >= cells // COPY_CELLS_PER_REUSED_TOKEN


@dataclass
class PrefixCache:
    """Which cache stream holds which tokens of which tenant, and when a sequence reuses or
    keeps cells; knows nothing of llama.cpp (the engine core copies the cells as this class
    decides).

    Args:
        first_stream: the first cache stream's ``seq_id`` (= ``max_slots``).
        n_streams: cache streams (each holds one entry of at most ``max_seq_len`` tokens).
        max_tokens: most tokens held by all entries together.
        window: which prefixes of the cells a sequence holds can be reused (:func:`reusable`;
            :attr:`engine.llama.model.Model.window`).
    """

    first_stream: int
    n_streams: int
    max_tokens: int
    window: int | None = None
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
        """The entry of ``tenant`` that gives ``prompt`` the longest prefix, and that length
        (``(None, 0)`` when none gives a token): its common prefix with the prompt, but never the
        prompt's last token (its logits give the next token), where the entry can give that
        many (:func:`reusable`). Touches the entry it returns, if asked."""
        best, best_n = None, 0
        for entry in self.entries.values():
            if entry.tenant == tenant:
                n = self._given(len(entry.tokens), common_prefix(entry.tokens, prompt), prompt)
                if n > best_n:
                    best, best_n = entry, n
        if best is not None and touch:
            best.used = next(self._clock)
        return best, best_n

    def _given(self, held: int, shared: int, prompt: np.ndarray) -> int:
        """Tokens of ``prompt`` that a source holding ``held`` cells, ``shared`` of them its
        prefix, gives it: ``shared`` but the prompt's last token, or 0 where :func:`reusable`
        says the source cannot give that many."""
        n = min(shared, len(prompt) - 1)
        return n if n > 0 and reusable(held, n, self.window) else 0

    def insert(self, tenant: int, tokens: np.ndarray) -> tuple[int | None, list[int]]:
        """Make room for ``tokens`` of ``tenant`` and record them.

        An entry of the same tenant that starts with ``tokens`` and can give them all
        (:func:`reusable`) already covers them: nothing is stored (it is touched). Entries of the tenant that ``tokens`` extend are dropped, so a
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
            if shared == n and reusable(len(entry.tokens), n, self.window):
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

    def keep(self, seq: Sequence) -> list[CellAction]:
        """Keep the cells of a sequence leaving its slot (its prompt and generated tokens,
        :meth:`Sequence.kv_tokens`), as :meth:`insert` decides.

        Returns:
            the cell actions, in order: free each evicted stream (but the one reused), then
            copy the slot into the new entry's stream; empty when nothing is stored.
        """
        stream, evicted = self.insert(seq.request.tenant, seq.kv_tokens())
        actions: list[CellAction] = [FreeCells(s) for s in evicted if s != stream]  # a copy replaces what dst held
        if stream is not None:
            actions.append(CopyCells(seq.slot, stream))
        return actions

    def reuse(self, seq: Sequence, running: Iterable[Sequence]) -> CopyCells | None:
        """The copy that gives a sequence just given a slot the longest prefix of its prefill
        (its prompt, and after a preemption its generated tokens) that its tenant's entries or
        running sequences can give it (:meth:`lookup`: never the last token, and only what
        :func:`reusable` allows), or None when none is worth it: under :data:`MIN_REUSE_TOKENS`,
        or under 1/:data:`COPY_CELLS_PER_REUSED_TOKEN` of the cells its source holds (a copy
        carries them all). Touches the entry it looks up.

        Args:
            running: the running sequences, with the cells each holds once the actions
                decided before this one are applied (``n_past`` and ``kv_tokens()``).
        """
        tenant, prompt = seq.request.tenant, seq.prefill_tokens
        entry, n = self.lookup(tenant, prompt)
        source, cells = (entry.stream, len(entry.tokens)) if entry is not None else (-1, 0)
        for other in running:
            if other is not seq and other.request.tenant == tenant and other.n_past > n:
                k = self._given(other.n_past, common_prefix(other.kv_tokens(), prompt), prompt)
                if k > n:
                    source, cells, n = other.slot, other.n_past, k
        if not worth_copying(n, cells):
            return None
        return CopyCells(source, seq.slot, n)

    def awaits(self, seq: Sequence, running: Iterable[Sequence]) -> bool:
        """Whether ``seq`` should wait a step for a running sequence of its tenant that is
        prefilling a prefix they share, at least :data:`MIN_REUSE_TOKENS` of which it has still
        to prefill, and is already at least as far into it as ``seq`` would start (what a copy
        from the cache would give it: :func:`worth_copying`): admitted now, ``seq`` would prefill
        the same tokens beside it, in the same steps' token budget, so no sooner; admitted once
        they are in the KV cache, it copies them.
        Sixteen requests with one new system prompt then prefill it once, not sixteen times.

        Where the model keeps only a window of a sequence (``window`` not None), only for another
        whose prefill is shorter than the window: a longer one could give only all it holds
        (:func:`reusable`), and its prefill steps rarely stop where the shared prefix does, so
        waiting for it would mostly cost a step for nothing."""
        if seq.scoring:
            return False  # it reuses nothing (Scheduler.schedule)
        resident = None
        for other in running:
            if self.window is not None and len(other.prefill_tokens) >= self.window:
                continue
            if other.prefilling and other.request.tenant == seq.request.tenant:
                shared = common_prefix(other.prompt, seq.prompt)
                if shared - other.n_past < MIN_REUSE_TOKENS:
                    continue  # too little left to gain to be worth a step's wait
                if resident is None:  # what a copy from the cache would give it (reuse)
                    entry, n = self.lookup(seq.request.tenant, seq.prompt, touch=False)
                    resident = n if entry is not None and worth_copying(n, len(entry.tokens)) else 0
                if other.n_past >= resident:
                    return True
        return False
