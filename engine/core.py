"""The engine loop: one thread stepping continuous batching over llama.cpp (DESIGN.md §2).

One :meth:`EngineCore.step` is the phases of llama.cpp's server loop, in order::

    ingest -> expire -> admit -> batch -> decode -> sample + publish -> retire
"""
from __future__ import annotations

import logging
import time

import numpy as np

from engine.batch import Batch
from engine.config import EngineConfig
from engine.model import DecodeError, Model
from engine.sampler import Sampler, logprobs
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from shm.layout import (DONE, ERR_BAD_REQUEST, ERR_DECODE, ERR_NONE, FINISH_CANCELLED,
                        FINISH_DEADLINE, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, QUEUED, RUNNING)
from shm.ring import RequestRing
from shm.transport import Transport
from shm.wakeup import Doorbells

log = logging.getLogger("engine")


class EngineCore:
    """Owns the scheduler and the batch; talks to the front ends only through the transport.

    Args:
        config: sizes and policy. transport: attached shared memory. model: loaded llama.cpp model.
    """

    def __init__(self, config: EngineConfig, transport: Transport, model: Model):
        self.config = config
        self.t = transport
        self.model = model
        self.ring = RequestRing(transport)
        self.sched = Scheduler(config.max_slots, config.policy, config.aging_s)
        self.batch = Batch(config.n_batch)
        self.stopping = False
        self.step_no = int(transport.control["step"][0])

    # -- loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        """Step until :meth:`stop`; block on the engine's FIFO only when fully idle."""
        while not self.stopping:
            if not self.sched.running and not self.sched.waiting:
                self.t.bells.wait(Doorbells.ENGINE, timeout=0.5)
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
                self.retire(seq, FINISH_ERROR, ERR_DECODE)
            return False

    # -- phases -------------------------------------------------------------------------------
    def ingest(self, now: float) -> None:
        """Drain the request ring into the waiting queue; drop stale or malformed records."""
        self.t.bells.drain(Doorbells.ENGINE)
        boxes = self.t.mailboxes
        for rec in self.ring.pop_all():
            i = int(rec["mailbox"])
            if int(boxes["generation"][i]) != int(rec["generation"]) or int(boxes["state"][i]) != QUEUED:
                continue  # the lease was reclaimed or failed meanwhile
            n, m = int(rec["n_prompt"]), int(rec["max_new_tokens"])
            if not (1 <= n <= self.config.max_seq_len - 1 and m >= 1 and n + m <= self.config.max_seq_len):
                self._finish_mailbox(i, int(rec["generation"]), FINISH_ERROR, ERR_BAD_REQUEST)
                continue
            self.sched.add(Sequence.from_record(rec, now))

    def expire(self, now: float) -> None:
        """Finish sequences whose client cancelled or whose deadline passed."""
        boxes = self.t.mailboxes
        for seq in list(self.sched.waiting):
            reason = self._expiry(seq, boxes, now)
            if reason:
                self.sched.drop_waiting(seq)
                self._finish_mailbox(seq.mailbox, seq.generation, reason)
        for seq in list(self.sched.running.values()):
            reason = self._expiry(seq, boxes, now)
            if reason:
                self.retire(seq, reason)

    @staticmethod
    def _expiry(seq: Sequence, boxes: np.ndarray, now: float) -> int:
        if boxes["cancel"][seq.mailbox] or int(boxes["generation"][seq.mailbox]) != seq.generation:
            return FINISH_CANCELLED
        if seq.deadline and now >= seq.deadline:
            return FINISH_DEADLINE
        return 0

    def start(self, seq: Sequence, now: float) -> None:
        """Bind an admitted sequence to its slot and build its sampler."""
        banned = self.model.eog if seq.ignore_eos else frozenset()
        seq.sampler = Sampler(self.model.n_vocab, seq.sampling, banned, seq.prompt)
        box = self.t.mailboxes[seq.mailbox]
        box["slot"] = seq.slot
        box["t_admitted"] = now
        box["step_admitted"] = self.step_no
        box["state"] = RUNNING

    def compact(self) -> None:
        """Close gaps in the running slots (admissions fill them first) by moving the highest
        sequence down, so the batch's sequence ids stay consecutive: one micro-batch."""
        while (gap := self.sched.gap()) is not None:
            seq, slot = gap
            self.model.move_sequence(seq.slot, slot)
            self.sched.move(seq, slot)
            self.t.mailboxes["slot"][seq.mailbox] = slot
            self.t.control["kv_moves"][0] += 1

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
        """Sample one token per row, write it to the sequence's mailbox, wake its reader, and
        retire the sequences that finished."""
        t = self.t
        woken = []
        for seq, row in rows:
            tok = seq.sampler.sample(self.model.ctx, row)
            i, k = seq.mailbox, seq.n_generated
            box = t.mailboxes[i]
            if k == 0:
                box["t_prefill_done"] = now
            self.sched.charge(seq, 1)
            if tok in seq.stop_ids or (tok in self.model.eog and not seq.ignore_eos):
                self.retire(seq, FINISH_STOP)
                continue
            if seq.n_logprobs >= 0:
                lp, top_ids, top_lp = logprobs(self.model.logits(row), tok, seq.n_logprobs)
                t.logprobs[i, k] = lp
                t.top_ids[i, k, :len(top_ids)] = top_ids
                t.top_logprobs[i, k, :len(top_lp)] = top_lp
            t.tokens[i, k] = tok  # data first ...
            if k == 0:
                box["t_first_token"] = now
            seq.n_generated = k + 1
            seq.last_token = tok
            box["n_tokens"] = k + 1  # ... then the counter ...
            if seq.n_generated >= seq.max_new_tokens:
                self.retire(seq, FINISH_LENGTH)
            else:
                woken.append(i)
        for i in woken:
            t.bells.ring(i)  # ... then the wake-up

    def retire(self, seq: Sequence, finish: int, error: int = ERR_NONE) -> None:
        """Free the sequence's KV cells and slot, and finish its mailbox."""
        self.model.free_sequence(seq.slot)
        self.sched.release(seq)
        if seq.sampler is not None:  # None if admission failed before the sampler was built
            seq.sampler.free()
        self._finish_mailbox(seq.mailbox, seq.generation, finish, error)

    def _finish_mailbox(self, i: int, generation: int, finish: int, error: int = ERR_NONE) -> None:
        box = self.t.mailboxes[i]
        if int(box["generation"]) != generation:
            return  # reclaimed: someone else owns it now
        box["finish"] = finish
        box["error"] = error
        box["t_finished"] = time.monotonic()
        box["step_finished"] = self.step_no
        box["state"] = DONE
        self.t.bells.ring(i)

    def publish_control(self) -> None:
        """Refresh the control block: step counter, queue sizes, slot table, KV occupancy."""
        c = self.t.control[0]
        slots = np.full(self.config.max_slots, -1, np.int32)
        for slot, seq in self.sched.running.items():
            slots[slot] = seq.mailbox
        kv = [self.model.pos_max(s) for s in range(self.config.max_slots)]
        c["publishing"] = 1
        c["heartbeat"] = time.monotonic()  # the engine steps at least every 0.5 s, idle or not
        c["n_waiting"] = len(self.sched.waiting)
        c["n_running"] = len(self.sched.running)
        c["slot_mailbox"] = slots
        c["slot_kv_pos_max"] = kv
        c["step"] = self.step_no
        c["publishing"] = 0

    def shutdown(self, error: int) -> None:
        """Finish every sequence with ``error`` (engine stopping)."""
        for seq in list(self.sched.running.values()):
            self.retire(seq, FINISH_ERROR, error)
        for seq in list(self.sched.waiting):
            self.sched.drop_waiting(seq)
            self._finish_mailbox(seq.mailbox, seq.generation, FINISH_ERROR, error)
