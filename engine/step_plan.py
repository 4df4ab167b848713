"""One engine step as a value: what the scheduler decided, which the core then executes (vLLM v1:
``Scheduler.schedule() -> SchedulerOutput``, then ``execute_model``, then ``update_from_output``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.sequence import Sequence


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
    """What one step does, decided before anything touches llama.cpp.

    Attributes:
        preempted: running sequences sent back to waiting this step, youngest first, because
            the decoding ones would have outgrown the KV budget (their cells were freed then).
        admitted: sequences given a slot this step (their KV cells were bound at admission).
        moves: ``(sequence, from slot, to slot)`` closing gaps in the running slots, in order.
        rows: the batch, in ascending slot order (see :meth:`engine.scheduler.Scheduler.gap`).
        single_thread: the decode must run on one thread (backend profile:
            ``split_kv_after_tokens``).
    """

    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    moves: list[tuple[Sequence, int, int]] = field(default_factory=list)
    rows: list[PlannedRow] = field(default_factory=list)
    single_thread: bool = False

    @property
    def n_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.rows)
