"""The scheduler: which waiting sequences get the free KV slots, and what each step's batch holds
(docs/architecture.md, "Engine step"). :meth:`Scheduler.schedule` returns the step as a
:class:`engine.step_plan.StepPlan`.

Order in ``continuous``: priority class (``high`` > ``normal`` > ``low``), then tenant fair
share, then earliest deadline, then arrival: a deadline orders its own tenant's requests, never
another tenant's (ordered before fair share, a tenant that put a far deadline on every request
would starve the others of its class). Fair share follows
the Virtual Token Counter (:class:`engine.fair_share.TokenCounters`: the tokens each tenant is
served over its weight, the smallest first, a tenant that becomes backlogged lifted to the
smallest among the backlogged). Starvation is
impossible because waiting ages a class: every ``aging_s`` seconds its oldest sequence waits,
the class climbs one rank.

KV cells: the running sequences together hold at most ``kv_tokens`` cells (a prefilling one is
counted for its whole prefill from admission on). A waiting sequence is admitted only when a slot
is free and its prefill fits; when it does not, admission stops there (the head of the queue is
not overtaken by smaller prompts). When the decoding sequences would outgrow the budget, the
youngest running sequence of the lowest class is preempted (vLLM's recompute preemption): its
cells are freed (kept in the prefix cache when they fit), and it waits again ahead
of every sequence of its class never admitted, to prefill its prompt and the tokens it had
generated. A scoring sequence is never preempted (its prompt log-probabilities are already being
read); if only such sequences could make room, the step runs over the budget.

Fair slots (``continuous``): a waiting sequence whose tenant holds fewer than its weighted share
of the slots gets the slot of the youngest sequence of a tenant over its share, in the same step
(:meth:`Scheduler.preempt_for_share`); a sequence is preempted so at most
``MAX_SHARE_PREEMPTIONS`` times, its cells kept in the prefix cache, and it waits in its tenant's
fair-share turn.

Prefix cache (:class:`engine.prefix_cache.PrefixCache`, when given): an admitted sequence reuses
the longest cached or running prefix of its tenant worth copying, a preempted one's cells are kept,
and in ``continuous`` a sequence waits a step for a sibling prefilling the prefix they share. The
plan carries these as KV cell actions (:class:`engine.step_plan.StepPlan`); nothing here calls
llama.cpp.
"""
from __future__ import annotations

import bisect
import logging
import math

import numpy as np

from engine.fair_share import TokenCounters
from engine.llama.backend import CPU, Backend
from engine.llama.batch import lone_tokens
from engine.prefix_cache import PrefixCache
from engine.sequence import Sequence, SequenceStatus
from engine.step_plan import FreeCells, PlannedRow, StepPlan

log = logging.getLogger("engine")

#: Times a sequence may be preempted before it is no longer a fair-share victim: its answer is
#: delayed at most this many re-admissions (each a copy of its cached cells, not a recompute).
#: Once (a first try) let a flood's readmitted sequences pile up immune, and a light request
#: then waited for one of their answers to end.
MAX_SHARE_PREEMPTIONS = 4


class Scheduler:
    """Waiting queue, slot table, per-tenant virtual counters, and the plan of each step.

    Args:
        max_slots: number of KV slots (slot id = llama ``seq_id``).
        policy: ``continuous`` (admit whenever a slot is free), ``static`` (admit only into an
            empty batch) or ``fifo`` (one sequence at a time, arrival order).
        aging_s: seconds of waiting per priority-class promotion.
        n_batch: tokens one step's batch holds (decode tokens + prefill chunks).
        backend: the device profile (its prefill chunk and one-thread rule).
        kv_tokens: KV cells the running sequences may hold together (None: no bound but the
            slots'); at least the longest sequence, so one always fits.
        cache: the prefix cache (None: no reuse).
        logits_rows: logits rows one step's batch may ask for (None: ``n_batch``), at least
            ``max_slots``: each sampling sequence takes one, and a scoring sequence's chunk is
            cut to what is left (:attr:`engine.llama.model.Model.max_logits_rows`).
    """

    def __init__(self, max_slots: int, policy: str, aging_s: float, n_batch: int = 512, backend: Backend = CPU,
                 kv_tokens: int | None = None, cache: PrefixCache | None = None, logits_rows: int | None = None):
        self.kv_tokens = math.inf if kv_tokens is None else kv_tokens
        self.logits_rows = n_batch if logits_rows is None else logits_rows
        self.cache = cache
        # Waiting for a sibling's prefill (PrefixCache.awaits) suits continuous batching only:
        # static and fifo would run the sibling alone.
        self.awaits_prefixes = cache is not None and policy == "continuous"
        self.policy = policy
        self.aging_s = aging_s
        self.n_batch, self.backend = n_batch, backend
        self.waiting: list[Sequence] = []
        self.running: dict[int, Sequence] = {}
        self.free_slots = list(range(max_slots))  # kept sorted: the lowest is taken first
        self.counters = TokenCounters()

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; lift its tenant's counter if the tenant was idle (VTC)."""
        self.counters.lift(seq.request.tenant, (s.request.tenant for s in self._backlogged()))
        self.waiting.append(seq)

    def _backlogged(self):
        yield from self.waiting
        yield from self.running.values()

    def charge(self, seq: Sequence, n_tokens: int) -> None:
        """Account ``n_tokens`` of service (prefilled or generated) to the sequence's tenant."""
        self.counters.charge(seq.request.tenant, n_tokens, seq.request.weight)

    def class_ranks(self, now: float) -> dict[int, int]:
        """Each waiting priority class's rank (:func:`class_ranks`). A whole class ages, not
        single requests, so inside a class the order stays fair share: an aged request of a
        flooding tenant never overtakes a light tenant's fresh request of the same class."""
        return class_ranks(self.waiting, now, self.aging_s)

    def key(self, seq: Sequence, ranks: dict[int, int], below: set[int]) -> tuple:
        """Sort key of a waiting sequence (``ranks`` from :meth:`class_ranks`, ``below`` from
        :meth:`below_share`): smaller is admitted first. Inside a class, a tenant below its share
        of the slots goes before one at or above it, then the smaller counter: a tenant queued
        behind a flood starts at the flood's counter (the lift), and the tie must not hand the
        flood back the slot :meth:`preempt_for_share` freed."""
        r = seq.request
        return (ranks[r.priority], not seq.resumes_first, r.tenant not in below, self.counters[r.tenant],
                r.deadline or math.inf, seq.order)

    @property
    def kv_cells(self) -> int:
        """KV cells the running sequences hold or are promised (:attr:`Sequence.kv_cells`)."""
        return sum(seq.kv_cells for seq in self.running.values())

    def _kv_cells_after_decode(self) -> int:
        return self.kv_cells + sum(1 for s in self.running.values() if s.status == SequenceStatus.DECODE)

    def schedule(self, now: float) -> StepPlan:
        """Plan one step: preempt what the decodes would outgrow, then for the slots' fair share
        (:meth:`preempt_for_share`; their cells freed, kept in the prefix cache first), admit
        waiting sequences (:meth:`admit`), each reusing what prefix it can (:meth:`start`),
        close gaps in the running slots, then fill the batch: one token
        per decoding sequence, then prefill chunks of at most ``backend.max_chunk_tokens`` in
        admission order, within ``n_batch`` tokens (chunked prefill; each first-time token
        charged to its tenant's counter). Moves the sequences' state as planned; the KV cells
        and mailboxes are the core's to change, as the plan says."""
        plan = StepPlan()
        plan.preempted = self.preempt_for_growth(plan) + self.preempt_for_share(now, plan)
        plan.admitted = self.admit(now)
        for seq in plan.admitted:
            self.start(seq, plan)
        while (gap := self.gap()) is not None:
            seq, slot = gap
            plan.moves.append((seq, seq.slot, slot))
            self.move(seq, slot)
        room, outputs = self.n_batch, self.logits_rows
        running = sorted(self.running.values(), key=lambda s: s.order)
        for seq in running:
            if seq.status == SequenceStatus.DECODE and room:
                n = len(seq.prompt) + seq.n_generated - 1
                plan.rows.append(PlannedRow(seq, np.array([seq.last_token], np.int32), n, True))
                room -= 1
                outputs -= 1
        prefilling = [seq for seq in running if seq.status == SequenceStatus.PREFILL]
        for i, seq in enumerate(prefilling):
            if not room:
                break
            tokens = seq.prefill_tokens
            k = min(len(tokens) - seq.n_prefilled, room, self.backend.max_chunk_tokens)
            if seq.scoring:  # a row of logits a token; the sequences after it may sample one each
                k = min(k, outputs - (len(prefilling) - i - 1))
                if k <= 0:
                    continue
            start = seq.n_prefilled
            seq.n_prefilled += k
            done = seq.n_prefilled == len(tokens)
            plan.rows.append(PlannedRow(seq, tokens[start:start + k], start, done and seq.generates, seq.scoring))
            outputs -= k if seq.scoring else int(done and seq.generates)
            if done:
                seq.status = SequenceStatus.DECODE
            if not seq.preemptions:  # a recompute is the server's choice, not the tenant's service
                self.charge(seq, k)
            room -= k
        plan.rows.sort(key=lambda r: r.seq.slot)
        for row in plan.rows:
            row.seq.n_past = row.pos + len(row.tokens)
        plan.single_thread = self._single_thread(plan)
        return plan

    def _single_thread(self, plan: StepPlan) -> bool:
        """Whether a sequence past ``backend.split_kv_after_tokens`` decodes a micro-batch of
        its one token alone (the backend's split-KV rule)."""
        limit = self.backend.split_kv_after_tokens
        if limit is None:
            return False
        lone = lone_tokens({r.seq.slot: len(r.tokens) for r in plan.rows}, self.n_batch)
        return any(self.running[slot].n_past > limit for slot in lone)

    def admit(self, now: float) -> list[Sequence]:
        """Move waiting sequences into free slots as the policy allows; returns the admitted.
        A sequence held (:meth:`holds`, asked in admission order, after the sequences before it
        were admitted) stays waiting this step and keeps its turn."""
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
            ranks, below = self.class_ranks(now), self.below_share(self.slot_shares(), self.held())
            order = sorted(self.waiting, key=lambda s: self.key(s, ranks, below))
        admitted, cells = [], self._kv_cells_after_decode()
        for seq in order:
            if len(admitted) == room:
                break
            if self.holds(seq):  # sees the sequences admitted before it in this loop
                continue
            if cells + len(seq.prefill_tokens) > self.kv_tokens:
                break  # it waits for cells, and no later sequence overtakes it
            cells += len(seq.prefill_tokens)
            self.waiting.remove(seq)
            seq.slot = self.free_slots.pop(0)
            seq.status = SequenceStatus.PREFILL
            self.running[seq.slot] = seq
            admitted.append(seq)
        return admitted

    def holds(self, seq: Sequence) -> bool:
        """Whether a waiting sequence stays waiting this step, keeping its turn: its grammar is
        compiling, or it awaits a sibling's prefill (:meth:`PrefixCache.awaits`)."""
        return seq.compiling or (self.awaits_prefixes and self.cache.awaits(seq, self.running.values()))

    def start(self, seq: Sequence, plan: StepPlan) -> None:
        """Ready a sequence just admitted: its history on its first admission, and the copy of
        the cached prefix it reuses into ``plan.cells`` (none for a scoring sequence, which needs
        every position's logits), counted as prefilled."""
        if seq.history is None:
            seq.start_history()
        if self.cache is None or seq.scoring:
            return
        copy = self.cache.reuse(seq, self.running.values())
        if copy is not None:
            plan.cells.append(copy)
            seq.n_prefilled = seq.n_past = seq.n_cached = copy.n_tokens

    def preempt_for_growth(self, plan: StepPlan) -> list[Sequence]:
        """Preempt running sequences, youngest of the lowest class first, until this step's
        decodes fit in ``kv_tokens`` (:meth:`preempt`; each waits again ahead of its class's
        sequences never admitted). Returns the preempted."""
        preempted = []
        while self._kv_cells_after_decode() > self.kv_tokens:
            candidates = [s for s in self.running.values() if not s.scoring]
            if len(self.running) < 2 or not candidates:
                break
            seq = max(candidates, key=lambda s: (s.request.priority, s.order))
            self.preempt(seq, plan, resumes_first=True, why="the KV budget")
            preempted.append(seq)
        return preempted

    def slot_shares(self) -> dict[int, float]:
        """Each backlogged tenant's fair share of the slots: ``max_slots * weight / (sum of the
        backlogged tenants' weights)``, in slots (not rounded)."""
        weights = {s.request.tenant: max(s.request.weight, 1e-6) for s in self._backlogged()}
        total, slots = sum(weights.values()), len(self.running) + len(self.free_slots)
        return {tenant: slots * w / total for tenant, w in weights.items()}

    def held(self) -> dict[int, int]:
        """Slots each tenant's running sequences hold."""
        held: dict[int, int] = {}
        for seq in self.running.values():
            held[seq.request.tenant] = held.get(seq.request.tenant, 0) + 1
        return held

    @staticmethod
    def below_share(shares: dict[int, float], held: dict[int, int]) -> set[int]:
        """The backlogged tenants holding fewer slots (``held``, :meth:`held`) than their share
        (``shares``, :meth:`slot_shares`)."""
        return {tenant for tenant, share in shares.items() if held.get(tenant, 0) < share}

    def preempt_for_share(self, now: float, plan: StepPlan) -> list[Sequence]:
        """Free slots for waiting sequences whose tenant holds fewer than its fair share of the
        slots (:meth:`slot_shares`) while another tenant holds more: the slots that fair share
        orders the queue by, made fair too (VTC, Sheng et al., OSDI 2024, orders admission; a
        queue alone leaves a flooding tenant every slot until its answers end).

        The waiting sequences are walked in admission order (:meth:`key`), each taking a free
        slot while there is one; then the next one, if taking a slot keeps its tenant within its
        share, gets the slot of a victim: the youngest running sequence of the lowest class, of
        the tenant furthest over its share, that stays at or over its share without it. Never a
        sequence of a higher class than the waiting one (vLLM's priority preemption), a scoring
        one, or one preempted ``MAX_SHARE_PREEMPTIONS`` times already, which bounds the
        churn, and a swap leaves the two tenants where neither may take the slot back. The walk
        stops at the first sequence that gets no slot (no later one overtakes it). A victim's
        cells are kept in the prefix cache (:meth:`preempt`) and it waits in its tenant's
        fair-share turn. Only in ``continuous``. Returns the preempted."""
        if self.policy != "continuous" or not self.waiting:
            return []
        share, held = self.slot_shares(), self.held()
        below = self.below_share(share, held)
        free, ranks, preempted = len(self.free_slots), self.class_ranks(now), []
        for seq in sorted(self.waiting, key=lambda s: self.key(s, ranks, below)):
            if self.holds(seq):
                continue
            tenant = seq.request.tenant
            if not free:
                if held.get(tenant, 0) + 1 > share[tenant]:
                    break
                victims = [s for s in self.running.values()
                           if not s.scoring and s.preemptions < MAX_SHARE_PREEMPTIONS
                           and s.request.priority >= seq.request.priority
                           and held[s.request.tenant] - 1 >= share[s.request.tenant]]
                if not victims:
                    break
                victim = max(victims, key=lambda s: (s.request.priority,
                                                     held[s.request.tenant] / share[s.request.tenant], s.order))
                self.preempt(victim, plan, resumes_first=False, why="a tenant below its fair share of the slots")
                held[victim.request.tenant] -= 1
                preempted.append(victim)
                free += 1
            free -= 1
            held[tenant] = held.get(tenant, 0) + 1
        return preempted

    def preempt(self, seq: Sequence, plan: StepPlan, resumes_first: bool, why: str) -> None:
        """Preempt one running sequence (vLLM's recompute preemption): its cells kept in the
        prefix cache and freed (``plan.cells``), its slot freed, and it waits again."""
        if self.cache is not None and seq.n_past:
            plan.cells += self.cache.keep(seq)
        plan.cells.append(FreeCells(seq.slot))
        log.info("preempted the sequence in mailbox %d (%d KV cells) for %s", seq.mailbox, seq.n_past, why)
        del self.running[seq.slot]
        bisect.insort(self.free_slots, seq.slot)
        seq.preempted(resumes_first)
        self.waiting.append(seq)

    def drop_waiting(self, seq: Sequence) -> None:
        """Remove a sequence that ends before admission (cancelled, expired, engine stopping)."""
        self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def release(self, seq: Sequence) -> None:
        """Give a retired sequence's slot back."""
        del self.running[seq.slot]
        bisect.insort(self.free_slots, seq.slot)
        seq.slot = -1
        seq.status = SequenceStatus.FINISHED

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


def class_ranks(waiting: list[Sequence], now: float, aging_s: float) -> dict[int, int]:
    """Each priority class of ``waiting``'s rank at ``now``: the class, raised by one for every
    ``aging_s`` seconds its oldest waiting sequence has waited (so ``low`` never starves)."""
    oldest: dict[int, float] = {}
    for seq in waiting:
        p = seq.request.priority
        oldest[p] = min(oldest.get(p, seq.arrival), seq.arrival)
    return {p: max(0, p - int((now - t) / aging_s)) for p, t in oldest.items()}
