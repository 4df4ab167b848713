"""Admission policy: which waiting sequences get the free KV slots (docs/architecture.md, "Engine step").

Order in ``continuous``: priority class (``high`` > ``normal`` > ``low``), then earliest
deadline, then tenant fair share, then arrival. Fair share follows the Virtual Token Counter of
Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024): each tenant's counter
grows by the tokens it is served divided by its weight, the tenant with the smallest counter
goes first, and a tenant that becomes backlogged is lifted to the smallest counter among the
backlogged so it cannot bank credit while idle. Starvation is impossible because waiting ages a
class: every ``aging_s`` seconds its oldest sequence waits, the class climbs one rank.
"""
from __future__ import annotations

import bisect
import math
from typing import Callable

from engine.sequence import Sequence


class Scheduler:
    """Waiting queue, slot table and per-tenant virtual counters.

    Args:
        max_slots: number of KV slots (slot id = llama ``seq_id``).
        policy: ``continuous`` (admit whenever a slot is free), ``static`` (admit only into an
            empty batch) or ``fifo`` (one sequence at a time, arrival order).
        aging_s: seconds of waiting per priority-class promotion.
    """

    def __init__(self, max_slots: int, policy: str, aging_s: float):
        self.policy = policy
        self.aging_s = aging_s
        self.waiting: list[Sequence] = []
        self.running: dict[int, Sequence] = {}
        self.free_slots = list(range(max_slots))  # kept sorted: the lowest is taken first
        self.counters: dict[int, float] = {}

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; lift its tenant's counter if the tenant was idle (VTC)."""
        if not any(s.request.tenant == seq.request.tenant for s in self._backlogged()):
            active = [self.counters[s.request.tenant] for s in self._backlogged()]
            floor = min(active) if active else 0.0
            self.counters[seq.request.tenant] = max(self.counters.get(seq.request.tenant, 0.0), floor)
        self.waiting.append(seq)

    def _backlogged(self):
        yield from self.waiting
        yield from self.running.values()

    def charge(self, seq: Sequence, n_tokens: int) -> None:
        """Account ``n_tokens`` of service (prefilled or generated) to the sequence's tenant."""
        tenant = seq.request.tenant
        self.counters[tenant] = self.counters.get(tenant, 0.0) + n_tokens / max(seq.request.weight, 1e-6)

    def class_ranks(self, now: float) -> dict[int, int]:
        """Each waiting priority class's rank: the class, raised by one for every ``aging_s``
        its oldest waiting sequence has waited. A whole class ages, not single requests, so
        inside a class the order stays fair share: an aged request of a flooding tenant never
        overtakes a light tenant's fresh request of the same class."""
        oldest: dict[int, float] = {}
        for seq in self.waiting:
            p = seq.request.priority
            oldest[p] = min(oldest.get(p, seq.arrival), seq.arrival)
        return {p: max(0, p - int((now - t) / self.aging_s)) for p, t in oldest.items()}

    def key(self, seq: Sequence, ranks: dict[int, int]) -> tuple:
        """Sort key of a waiting sequence (``ranks`` from :meth:`class_ranks`): smaller is
        admitted first."""
        r = seq.request
        return (ranks[r.priority], r.deadline or math.inf, self.counters.get(r.tenant, 0.0), seq.order)

    def admit(self, now: float, hold: Callable[[Sequence], bool] = lambda seq: False) -> list[Sequence]:
        """Move waiting sequences into free slots as the policy allows; returns the admitted.
        A sequence for which ``hold`` is true (asked in admission order, after the sequences
        before it were admitted) stays waiting this step and keeps its turn."""
        if not self.waiting or not self.free_slots:
            return []
        if self.policy == "fifo":
            if self.running:
                return []
            room = 1
            order = sorted(self.waiting, key=lambda s: s.order)
        else:
            if self.policy == "static" and self.running:
                return []
            room = len(self.free_slots)
            ranks = self.class_ranks(now)
            order = sorted(self.waiting, key=lambda s: self.key(s, ranks))
        admitted = []
        for seq in order:
            if len(admitted) == room:
                break
            if hold(seq):  # sees the sequences admitted before it in this loop
                continue
            self.waiting.remove(seq)
            seq.slot = self.free_slots.pop(0)
            self.running[seq.slot] = seq
            admitted.append(seq)
        return admitted

    def drop_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)

    def release(self, seq: Sequence) -> None:
        """Give a retired sequence's slot back."""
        del self.running[seq.slot]
        bisect.insort(self.free_slots, seq.slot)
        seq.slot = -1

    def gap(self) -> tuple[Sequence, int] | None:
        """The highest running sequence and the lowest free slot below it, if any.

        llama.cpp decodes a batch over a multi-stream (non-unified) KV cache in one micro-batch
        only when its sequence ids are consecutive (``split_equal(..., sequential=true)`` in
        llama-batch.cpp); every gap in the running slots costs another pass over the weights.
        """
        if not self.running or not self.free_slots:
            return None
        top = max(self.running)
        if self.free_slots[0] > top:
            return None
        return self.running[top], self.free_slots[0]

    def move(self, seq: Sequence, slot: int) -> None:
        """Rebind a running sequence to the free ``slot`` (its KV cells were copied there)."""
        del self.running[seq.slot]
        self.free_slots.remove(slot)
        bisect.insort(self.free_slots, seq.slot)
        seq.slot = slot
        self.running[slot] = seq
