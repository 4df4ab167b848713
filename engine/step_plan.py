"""One engine step as a value: what the scheduler decided, which the core then executes (vLLM v1:
``Scheduler.schedule() -> SchedulerOutput``, then ``execute_model``, then ``update_from_output``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.sequence import Sequence


@dataclass(frozen=True)
class CopyCells:
    """Make llama ``seq_id`` ``dst`` hold the KV cells of ``src`` at positions ``< n_tokens``
    (-1: all of them), replacing whatever ``dst`` held (:meth:`engine.llama.model.Model.copy_sequence`)."""

    src: int
    dst: int
    n_tokens: int = -1


@dataclass(frozen=True)
class FreeCells:
    """Free every KV cell of llama ``seq_id`` (:meth:`engine.llama.model.Model.free_sequence`)."""

    seq_id: int


#: One change to the KV cells, decided by the scheduler or the prefix cache, applied by the core.
CellAction = CopyCells | FreeCells


@dataclass
class PlannedRow:
    """One sequence's tokens in this step's batch.

    Attributes:
        seq: the sequence. tokens: int32 ``[k]`` token ids fed (a prompt chunk, or the last
        sampled token). pos: position of ``tokens[0]``. samples: a token is sampled from the
        logits of the last one (a decode, or the chunk that ends the prompt). scores: logits
        of every token are read (a scoring sequence's prompt chunk: each row gives the next
        prompt token's log-probability).
    """

    seq: Sequence
    tokens: np.ndarray
    pos: int
    samples: bool
    scores: bool = False


@dataclass
class StepPlan:
    """What one step does, decided before anything touches llama.cpp or a mailbox;
    :meth:`engine.core.EngineCore.execute` applies it in the order of its attributes.

    Attributes:
        cells: KV cell actions, in the order they were decided: for each preempted sequence,
            its cells kept in the prefix cache (the evicted streams freed, then its slot copied
            into a cache stream) and its slot freed; then, for each admitted sequence, the
            prefix it reuses copied into its slot. Slot ids are those at decision time, before
            :attr:`moves`.
        preempted: running sequences sent back to waiting this step: first, youngest first, those
            the decoding ones would have outgrown the KV budget with, then those whose slots went
            to tenants below their fair share of the slots; their mailboxes lose their slot.
        admitted: sequences given a slot this step, in admission order (a preempted one may be
            readmitted in the same step); a sequence's reused prefix is already counted in its
            ``n_cached``, ``n_prefilled`` and ``n_past``.
        moves: ``(sequence, from slot, to slot)`` closing gaps in the running slots, in order.
        rows: the batch, in ascending slot order (see :meth:`engine.scheduler.Scheduler.gap`).
        single_thread: the decode must run on one thread (backend profile:
            ``split_kv_after_tokens``).
    """

    cells: list[CellAction] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    moves: list[tuple[Sequence, int, int]] = field(default_factory=list)
    rows: list[PlannedRow] = field(default_factory=list)
    single_thread: bool = False

    @property
    def n_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)
