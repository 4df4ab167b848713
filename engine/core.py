"""The engine loop: one thread stepping continuous batching over llama.cpp (docs/architecture.md,
"Engine step").

One :meth:`EngineCore.step` is the phases of llama.cpp's server loop, in order, with the
middle planned as a value (vLLM v1's ``schedule() -> execute_model() -> update_from_output()``)::

    ingest -> expire -> schedule (preempt, admit + reuse a cached prefix, compact, plan the batch)
           -> execute (KV cell copies and frees, mailboxes, moves, batch, decode)
           -> sample -> finish rule -> publish -> retire (+ keep the cells in the prefix cache)

where schedule may first preempt the youngest sequences when the decodes would outgrow the KV
budget, or to give a tenant below its fair share of the slots one of an over-share tenant's
(their cells kept in the prefix cache when they fit; they wait to prefill again).
Schedule only decides (:class:`engine.step_plan.StepPlan`); execute is the first phase that
touches llama.cpp. The finish rule is :func:`engine.finish.finish_of`. What it shares with the
embedding loop (waiting, ingesting, expiry, the decode's threads and progress hook, the step log)
is :class:`engine.loop.EngineLoop`'s.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time

import numpy as np

from engine.config import EngineConfig
from engine.finish import finish_of
from engine.llama.batch import Batch
from engine.llama.grammar import Grammars
from engine.llama.model import DecodeError, Model
from engine.llama.logprobs import LogProbs
from engine.llama.sampler import Sampler
from engine.loop import EngineLoop
from engine.prefix_cache import PrefixCache
from engine.request import EngineRequest, RequestKind
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.step_plan import CellAction, CopyCells, StepPlan
from engine.threads import AdaptiveThreads
from shm import ErrorCode, Finish, Published
from shm.transport import Transport

log = logging.getLogger("engine")

#: Longest the loop waits, when only sequences whose grammar is compiling are left, before it
#: looks at its FIFO again.
COMPILE_WAIT_S = 0.005


class EngineCore(EngineLoop):
    """Owns the scheduler and the batch; talks to the front ends only through the transport.

    Args:
        config: sizes and policy. transport: attached shared memory. model: loaded llama.cpp
        model; its backend profile sets the prefill chunk and the one-thread rule
        (:mod:`engine.llama.backend`). adaptive: the adaptive thread count (None: the
        configured count), made by :func:`engine.loop.adaptive_threads` before the model loaded.
    """

    def __init__(self, config: EngineConfig, transport: Transport, model: Model,
                 adaptive: AdaptiveThreads | None = None):
        super().__init__(config, transport, model, adaptive)
        self.backend = model.backend
        self.cache = PrefixCache(config.max_slots, config.cache_streams, config.prefix_cache_tokens, model.window) \
            if config.cache_streams else None
        self.sched = Scheduler(config.max_slots, config.policy, config.aging_s, config.n_batch, self.backend,
                               config.kv_cache_tokens, self.cache, model.max_logits_rows)
        self.batch = Batch(config.n_batch)
        self.logprobs = LogProbs(model.n_vocab, threads=min(2, config.threads or 2))
        self.grammars = Grammars(model.vocab, model.eog, model.n_vocab)

    # -- loop ---------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.sched.running or self.sched.waiting)

    def wait(self) -> None:
        """:meth:`EngineLoop.wait`; and when only sequences whose grammar is compiling wait,
        wait for a compile (at most :data:`COMPILE_WAIT_S`), not spin."""
        if not self.has_work():
            super().wait()
        elif not self.sched.running and all(seq.compiling for seq in self.sched.waiting):
            concurrent.futures.wait([seq.grammar for seq in self.sched.waiting], COMPILE_WAIT_S,
                                    concurrent.futures.FIRST_COMPLETED)

    def step(self) -> None:
        """One iteration: schedule, execute, sample and publish, retire; at most one decode."""
        self.step_no += 1
        now = time.monotonic()
        self.ingest(now)
        self.expire(now)
        plan = self.sched.schedule(now)
        rows, scored = self.execute(plan, now)
        decoded = time.monotonic()
        for seq, reason, error in self.score(scored, decoded) + self.sample_and_publish(rows, decoded):
            self.retire(seq, reason, error)
        self.publish_control()
        self.log_step(now, [(s.mailbox, s.lease) for s, _ in rows])

    def execute(self, plan: StepPlan,
                now: float) -> tuple[list[tuple[Sequence, int]], list[tuple[Sequence, int, int, int]]]:
        """Apply ``plan`` (made at ``now``) to llama.cpp and the mailboxes, in its order: its KV
        cell actions; its preempted sequences' mailboxes lose their slot; its admitted sequences
        get a sampler on their first admission and their mailbox its slot; its slot moves; then
        its batch in one decode.

        Returns:
            ``(sequence, logits row)`` for every sequence that samples after the decode, and
            ``(sequence, first logits row, first position, tokens)`` for every scoring chunk;
            both empty when nothing was decoded or the decode failed (its sequences then
            finished).
        """
        self.apply(plan.cells)
        for seq in plan.preempted:
            self.boxes.move(seq.mailbox, -1)  # its mailbox stays running, with no slot
            self.t.control.count_preemption()
        for seq in plan.admitted:
            self.start(seq, now)
        for seq, src, dst in plan.moves:
            self.model.move_sequence(src, dst)
            self.boxes.move(seq.mailbox, dst)
            self.t.control.count_kv_move()
        self.batch.clear()
        rows = [(r, self.batch.add(r.tokens, r.pos, r.seq.slot, r.samples, r.scores)) for r in plan.rows]
        if not self.batch.n or not self.decode_batch(plan.single_thread):
            return [], []
        return ([(r.seq, row) for r, row in rows if r.samples],
                [(r.seq, row - len(r.tokens) + 1, r.pos, len(r.tokens)) for r, row in rows if r.scores])

    def decode_batch(self, one_thread: bool = False) -> bool:
        """One ``llama_decode`` of the batch (:meth:`EngineLoop.decode`, on one thread if asked);
        on failure, the batch's sequences finish with an error."""
        try:
            self.decode(self.batch, one_thread)
            return True
        except DecodeError as e:
            log.error("%s; failing the sequences of this batch", e)
            in_batch = set(self.batch.seq[:self.batch.n].tolist())
            for seq in [s for s in self.sched.running.values() if s.slot in in_batch]:
                self.retire(seq, Finish.ERROR, ErrorCode.DECODE)
            return False

    # -- phases -------------------------------------------------------------------------------
    def queue(self, seq: Sequence) -> None:
        """Into the scheduler's waiting queue, its grammar (if any) compiling meanwhile."""
        if seq.request.sampling.grammar is not None:
            seq.grammar = self.grammars.compile(seq.request.tenant, seq.request.sampling.grammar)
        self.sched.add(seq)

    def servable(self, request: EngineRequest) -> bool:
        """Defensive: the client checked the request; a corrupt record must not reach llama.cpp
        (a length beyond the slot, a biased token outside the vocabulary, a grammar that is not
        text), nor an embedding (an embedding engine's). Only a scoring request may generate
        nothing."""
        n, m = len(request.prompt), request.sampling.max_new_tokens or 0
        least = 0 if request.kind == RequestKind.SCORE else 1
        return (request.kind != RequestKind.EMBED
                and 1 <= n < self.config.max_seq_len and m >= least and n + m <= self.config.max_seq_len
                and all(0 <= t < self.model.n_vocab for t, _ in request.sampling.logit_bias)
                and isinstance(request.sampling.grammar, (str, type(None))))

    def expire(self, now: float) -> None:
        """Finish sequences whose client cancelled or whose deadline passed, and waiting ones
        whose grammar did not compile (the front end checks grammars, so only a corrupt record)."""
        for seq in list(self.sched.waiting):
            reason, error = self.expiry(seq, now), ErrorCode.NONE
            if not reason and seq.grammar is not None and seq.grammar.done() and self.grammars.failed(seq.grammar):
                reason, error = Finish.ERROR, ErrorCode.BAD_REQUEST
            if reason:
                self.sched.drop_waiting(seq)
                self.end(seq, reason, error)
        for seq in list(self.sched.running.values()):
            reason = self.expiry(seq, now)
            if reason:
                self.retire(seq, reason)
                if reason == Finish.CANCELLED:
                    self.cancelled.append((seq.mailbox, seq.lease))

    def start(self, seq: Sequence, now: float) -> None:
        """Tell an admitted sequence's mailbox its slot; on its first admission, build its
        sampler first (with its own copy of its compiled grammar). A preempted sequence keeps
        its sampler, grammar state and what its mailbox says of its first admission."""
        if seq.sampler is not None:
            self.boxes.move(seq.mailbox, seq.slot)
            return
        sampling = seq.request.sampling
        banned = self.model.eog if sampling.ignore_eos else frozenset()
        constraint = self.grammars.constraint(seq.grammar) if seq.grammar is not None else None
        seq.sampler = Sampler(self.model.n_vocab, sampling, banned, seq.prompt, constraint)
        self.boxes.admit(seq.mailbox, seq.slot, self.step_no, now, seq.n_cached)

    def apply(self, actions: list[CellAction]) -> None:
        """Copy and free KV cells as decided (:mod:`engine.step_plan`), in order."""
        for action in actions:
            if isinstance(action, CopyCells):
                self.model.copy_sequence(action.src, action.dst, action.n_tokens)
            else:
                self.model.free_sequence(action.seq_id)

    def score(self, chunks: list[tuple[Sequence, int, int, int]],
              now: float) -> list[tuple[Sequence, Finish, ErrorCode]]:
        """Publish the log-probability of every prompt token that a scoring chunk's logits
        predict: row ``i`` of a chunk starting at position ``pos`` gives token ``pos + i + 1``
        (with the request's top ``logprobs`` alternatives), through the same
        :class:`engine.llama.logprobs.LogProbs` as generated tokens. Published before this
        step's tokens, so a reader that sees a sequence's first token sees its whole prompt.

        Returns:
            the scoring sequences whose prompt is now scored and that the finish rule ends
            (they generate nothing: ``max_new_tokens`` 0), for :meth:`retire`.
        """
        finished = []
        for seq, first, pos, k in chunks:
            prompt, sampling = seq.prompt, seq.request.sampling
            m = min(k, len(prompt) - 1 - pos)  # the prompt's last row predicts no prompt token
            if m > 0:
                lp, ids, top = self.logprobs.rows(self.model.logits_rows(first, m), prompt[pos + 1:pos + 1 + m],
                                                  sampling.logprobs or 0)
                self.boxes.publish_prompt_logprobs(seq.mailbox, pos, lp, ids, top)
            if pos + k == len(prompt):
                verdict = finish_of(seq, None, self.model.eog, now)
                if verdict.finish:
                    self.boxes.prefill_done(seq.mailbox, now)
                    finished.append((seq, verdict.finish, verdict.error))
        return finished

    def sample_and_publish(self, rows: list[tuple[Sequence, int]],
                           now: float) -> list[tuple[Sequence, Finish, ErrorCode]]:
        """Sample one token per row, judge it by the finish rule (:func:`engine.finish.finish_of`),
        and publish every token it lets through to its mailbox (one wake-up each).

        Returns:
            the sequences that finished, with their reason and error code, for :meth:`retire`.
        """
        published, finished = [], []
        for seq, row in rows:
            tok = seq.sampler.sample(self.model.ctx, row)
            verdict, k = finish_of(seq, tok, self.model.eog, now), seq.n_generated
            if verdict.served:
                if k == 0:
                    self.boxes.prefill_done(seq.mailbox, now)
                self.sched.charge(seq, 1)
            if verdict.error == ErrorCode.CONSTRAINT:
                log.warning("sequence in mailbox %d: its grammar failed: %s", seq.mailbox, seq.sampler.constraint.error)
            if verdict.published:
                logprobs = seq.request.sampling.logprobs
                lp = None if logprobs is None else self.logprobs.one(self.model.logits(row), tok, logprobs)
                published.append(Published(seq.mailbox, k, tok, lp))
                seq.generated(tok)
            if verdict.finish:
                finished.append((seq, verdict.finish, verdict.error))
        self.boxes.publish(published, now)
        return finished

    def retire(self, seq: Sequence, finish: Finish, error: ErrorCode = ErrorCode.NONE) -> None:
        """Keep the sequence's KV cells in the prefix cache (unless its decode failed), free its
        slot, and finish its mailbox."""
        if self.cache is not None and finish != Finish.ERROR and seq.n_past:
            self.apply(self.cache.keep(seq))
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
        cached = (len(self.cache.entries), self.cache.n_tokens, [self.model.pos_max(s) for s in self.cache.streams]) \
            if self.cache is not None else (0, 0, [])
        self.t.control.publish(self.step_no, slots, kv, len(self.sched.waiting), *cached, kv_cells=self.sched.kv_cells)

    def shutdown(self, error: ErrorCode) -> None:
        """Finish every sequence with ``error`` (engine stopping), then stop compiling grammars:
        the clients hear first, since closing waits for a grammar being compiled."""
        for seq in list(self.sched.running.values()):
            self.retire(seq, Finish.ERROR, error)
        for seq in list(self.sched.waiting):
            self.sched.drop_waiting(seq)
            self.boxes.finish(seq.mailbox, seq.lease, Finish.ERROR, error, self.step_no)
        self.grammars.close()
        self.logprobs.close()
