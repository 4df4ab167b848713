"""The engine loop: one thread stepping continuous batching over llama.cpp (docs/architecture.md,
"Engine step").

One :meth:`EngineCore.step` is the phases of llama.cpp's server loop, in order::

    ingest -> expire -> admit -> compact -> batch -> decode -> sample + publish -> retire
"""
from __future__ import annotations

import logging
import time

import numpy as np

from engine.batch import Batch
from engine.config import EngineConfig
from engine.model import DecodeError, Model
from engine.request import EngineRequest
from engine.sampler import Sampler, logprobs
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from shm import ErrorCode, Finish, Published
from shm.transport import Transport
from shm.wakeup import Wakeups

log = logging.getLogger("engine")


class EngineCore:
    """Owns the scheduler and the batch; talks to the front ends only through the transport.

    Args:
        config: sizes and policy. transport: attached shared memory. model: loaded llama.cpp model.
    """

    def __init__(self, config: EngineConfig, transport: Transport, model: Model):
        self.config = config
        self.t = transport
        self.boxes = transport.mailboxes
        self.model = model
        self.sched = Scheduler(config.max_slots, config.policy, config.aging_s)
        self.batch = Batch(config.n_batch)
        self.stopping = False
        self.step_no = transport.control.step

    # -- loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        """Step until :meth:`stop`; block on the engine's FIFO only when fully idle."""
        while not self.stopping:
            if not self.sched.running and not self.sched.waiting:
                self.t.wakeups.wait([Wakeups.ENGINE], timeout=0.5)
            self.step()

    def stop(self) -> None:
        self.stopping = True

    def step(self) -> None:
        """One iteration: every phase once, at most one ``llama_decode``."""
        self.step_no += 1
        now = time.monotonic()
        self.ingest(now)
        self.expire(now)
        for seq in self.sched.admit(now):
            self.start(seq, now)
        self.compact()
        rows = self.fill_batch()
        if self.batch.n and self.decode():
            self.sample_and_publish(rows, time.monotonic())
        self.publish_control()

    def decode(self) -> bool:
        """One ``llama_decode``; on failure, the batch's sequences finish with an error."""
        try:
            self.model.decode(self.batch)
            return True
        except DecodeError as e:
            log.error("%s; failing the sequences of this batch", e)
            in_batch = set(self.batch.seq[:self.batch.n].tolist())
            for seq in [s for s in self.sched.running.values() if s.slot in in_batch]:
                self.retire(seq, Finish.ERROR, ErrorCode.DECODE)
            return False

    # -- phases -------------------------------------------------------------------------------
    def ingest(self, now: float) -> None:
        """Drain the request ring into the waiting queue; drop stale or malformed records."""
        self.t.wakeups.drain(Wakeups.ENGINE)
        for rec in self.t.ring.pop_all():
            if not self.boxes.is_queued(rec.mailbox, rec.lease):
                continue  # the lease was reclaimed or failed meanwhile
            request = EngineRequest.decode(rec.payload)
            n, m = len(request.prompt), request.sampling.max_new_tokens or 0
            # Defensive: the client checked the length; a corrupt record must not reach llama.cpp.
            if not (1 <= n < self.config.max_seq_len and m >= 1 and n + m <= self.config.max_seq_len):
                self.boxes.finish(rec.mailbox, rec.lease, Finish.ERROR, ErrorCode.BAD_REQUEST, self.step_no)
                continue
            self.sched.add(Sequence(rec.mailbox, rec.lease, request, now))

    def expire(self, now: float) -> None:
        """Finish sequences whose client cancelled or whose deadline passed."""
        for seq in list(self.sched.waiting):
            reason = self._expiry(seq, now)
            if reason:
                self.sched.drop_waiting(seq)
                self.boxes.finish(seq.mailbox, seq.lease, reason, step=self.step_no)
        for seq in list(self.sched.running.values()):
            reason = self._expiry(seq, now)
            if reason:
                self.retire(seq, reason)

    def _expiry(self, seq: Sequence, now: float) -> Finish:
        if self.boxes.cancelled(seq.mailbox, seq.lease):
            return Finish.CANCELLED
        if seq.request.deadline and now >= seq.request.deadline:
            return Finish.DEADLINE
        return Finish.NONE

    def start(self, seq: Sequence, now: float) -> None:
        """Bind an admitted sequence to its slot and build its sampler."""
        sampling = seq.request.sampling
        banned = self.model.eog if sampling.ignore_eos else frozenset()
        seq.sampler = Sampler(self.model.n_vocab, sampling, banned, seq.prompt)
        self.boxes.admit(seq.mailbox, seq.slot, self.step_no, now)

    def compact(self) -> None:
        """Close gaps in the running slots (admissions fill them first) by moving the highest
        sequence down, so the batch's sequence ids stay consecutive: one micro-batch."""
        while (gap := self.sched.gap()) is not None:
            seq, slot = gap
            self.model.move_sequence(seq.slot, slot)
            self.sched.move(seq, slot)
            self.boxes.move(seq.mailbox, slot)
            self.t.control.count_kv_move()

    def fill_batch(self) -> list[tuple[Sequence, int]]:
        """One token per decoding sequence, then prompt chunks (chunked prefill) in admission
        order, within ``n_batch`` tokens; rows are laid out in ascending slot order (see
        :meth:`compact`). Returns ``(sequence, logits row)`` for every sequence that samples
        after this decode."""
        room = self.batch.capacity
        plan = []  # (sequence, tokens, first position, samples after this decode)
        running = sorted(self.sched.running.values(), key=lambda s: s.order)
        for seq in running:
            if not seq.prefilling and room:
                plan.append((seq, np.array([seq.last_token], np.int32), len(seq.prompt) + seq.n_generated - 1, True))
                room -= 1
        for seq in running:
            if seq.prefilling and room:
                k = min(len(seq.prompt) - seq.n_prefilled, room)
                start, done = seq.n_prefilled, seq.n_prefilled + k == len(seq.prompt)
                plan.append((seq, seq.prompt[start:start + k], start, done))
                seq.n_prefilled += k
                self.sched.charge(seq, k)
                room -= k
        self.batch.clear()
        rows = []
        for seq, tokens, pos, samples in sorted(plan, key=lambda p: p[0].slot):
            row = self.batch.add(tokens, pos, seq.slot, samples)
            if samples:
                rows.append((seq, row))
        return rows

    def sample_and_publish(self, rows: list[tuple[Sequence, int]], now: float) -> None:
        """Sample one token per row, publish every token to its mailbox (one wake-up each), then
        retire the sequences that finished."""
        published, finished = [], []
        for seq, row in rows:
            tok = seq.sampler.sample(self.model.ctx, row)
            sampling, k = seq.request.sampling, seq.n_generated
            if k == 0:
                self.boxes.prefill_done(seq.mailbox, now)
            self.sched.charge(seq, 1)
            if tok in sampling.stop_ids or (tok in self.model.eog and not sampling.ignore_eos):
                finished.append((seq, Finish.STOP))
                continue
            lp = None if sampling.logprobs is None else logprobs(self.model.logits(row), tok, sampling.logprobs)
            published.append(Published(seq.mailbox, k, tok, lp))
            seq.n_generated, seq.last_token = k + 1, tok
            if seq.n_generated >= sampling.max_new_tokens:
                finished.append((seq, Finish.LENGTH))
        self.boxes.publish(published, now)
        for seq, reason in finished:
            self.retire(seq, reason)

    def retire(self, seq: Sequence, finish: Finish, error: ErrorCode = ErrorCode.NONE) -> None:
        """Free the sequence's KV cells and slot, and finish its mailbox."""
        self.model.free_sequence(seq.slot)
        self.sched.release(seq)
        if seq.sampler is not None:  # None if admission failed before the sampler was built
            seq.sampler.free()
        self.boxes.finish(seq.mailbox, seq.lease, finish, error, self.step_no)

    def publish_control(self) -> None:
        """Refresh the control block: step counter, queue sizes, slot table, KV occupancy."""
        slots = np.full(self.config.max_slots, -1, np.int32)
        for slot, seq in self.sched.running.items():
            slots[slot] = seq.mailbox
        kv = [self.model.pos_max(s) for s in range(self.config.max_slots)]
        self.t.control.publish(self.step_no, slots, kv, len(self.sched.waiting), len(self.sched.running))

    def shutdown(self, error: ErrorCode) -> None:
        """Finish every sequence with ``error`` (engine stopping)."""
        for seq in list(self.sched.running.values()):
            self.retire(seq, Finish.ERROR, error)
        for seq in list(self.sched.waiting):
            self.sched.drop_waiting(seq)
            self.boxes.finish(seq.mailbox, seq.lease, Finish.ERROR, error, self.step_no)
