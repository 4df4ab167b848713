"""One sequence: a request's prompt, sampling state and progress inside the engine."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from engine.request import EngineRequest, RequestKind

_order = itertools.count()


class SequenceStatus(IntEnum):
    """Where a sequence is in its life, in order (vLLM v1's ``RequestStatus``; llama.cpp's
    server calls these slot states). Only the :class:`engine.scheduler.Scheduler` moves it."""

    WAITING = 0  #: queued, no slot
    PREFILL = 1  #: holds a slot; prompt chunks are being fed (``n_prefilled < len(prompt)``)
    DECODE = 2  #: the whole prompt is in the KV cache; one token a step
    FINISHED = 3  #: retired or dropped; its slot is free


@dataclass(eq=False)
class Sequence:
    """A request as the engine sees it (token ids only).

    Life cycle: :class:`SequenceStatus` WAITING -> PREFILL -> DECODE -> FINISHED (or WAITING ->
    FINISHED when cancelled or expired before admission). A preempted sequence goes back to
    WAITING with its tokens so far and prefills them all again when it is readmitted
    (:attr:`prefill_tokens`), as vLLM's recompute preemption does.

    Attributes:
        mailbox, lease: where results go; a lease mismatch means the request is stale.
        request: what was asked (prompt, sampling settings, priority, deadline, tenant).
        arrival: ``time.monotonic()`` seconds when the engine ingested it.
        slot: KV slot / llama ``seq_id`` while running, -1 otherwise.
        n_prefilled: prompt tokens already in the KV cache (reused ones included).
        n_cached: prompt tokens whose KV cells were reused from the prefix cache, not prefilled.
        n_past: tokens in the slot's KV cells, positions ``0 .. n_past - 1``; they are
            ``history[:n_past]``.
        history: int32 ``[len(prompt) + max_new_tokens]``, the prompt then each generated token
            (made at admission).
        last_token: token to feed at the next decode step.
        grammar: ``concurrent.futures.Future`` of the request's compiled grammar while it is
            compiled and then (None: unconstrained); the sampler's constraint copies it.
        status: see :class:`SequenceStatus`.
        preemptions: times it was preempted.
        resumes_first: its last preemption was for the KV budget, so it waits ahead of the
            sequences of its class never admitted; after a fair-share preemption it waits in its
            tenant's fair-share turn (:meth:`engine.scheduler.Scheduler.preempt_for_share`).
    """

    mailbox: int
    lease: int
    request: EngineRequest
    arrival: float
    order: int = field(default_factory=lambda: next(_order))
    slot: int = -1
    n_prefilled: int = 0
    n_cached: int = 0
    n_past: int = 0
    n_generated: int = 0
    last_token: int = -1
    history: np.ndarray | None = None
    sampler: object = None
    grammar: object = None  # a Future of its compiled grammar (engine.llama.grammar.Grammars), if any
    status: SequenceStatus = SequenceStatus.WAITING
    preemptions: int = 0
    resumes_first: bool = False

    @property
    def prompt(self) -> np.ndarray:
        return self.request.prompt

    @property
    def scoring(self) -> bool:
        """A scoring request: every prompt position's log-probability is published."""
        return self.request.kind == RequestKind.SCORE

    @property
    def compiling(self) -> bool:
        """Its grammar is still being compiled (it cannot be admitted yet)."""
        return self.grammar is not None and not self.grammar.done()

    @property
    def generates(self) -> bool:
        """Tokens are still to be generated (``n_generated < max_new_tokens``): the end of its
        prefill samples one. False from the start for a scoring request that generates none."""
        return self.n_generated < (self.request.sampling.max_new_tokens or 0)

    @property
    def prefilling(self) -> bool:
        return self.status == SequenceStatus.PREFILL

    @property
    def prefill_tokens(self) -> np.ndarray:
        """The tokens to prefill: the prompt, and after a preemption every generated token too
        (the last one's logits give the next token, as its decode would have)."""
        if not self.n_generated:
            return self.request.prompt
        return self.history[:len(self.request.prompt) + self.n_generated]

    @property
    def kv_cells(self) -> int:
        """KV cells this sequence holds or, while it prefills, is promised (its whole prefill)."""
        if self.status == SequenceStatus.PREFILL:
            return max(self.n_past, len(self.prefill_tokens))
        return self.n_past

    def preempted(self, resumes_first: bool) -> None:
        """Back to waiting with no KV cells (the scheduler requeues it), ahead of its class's
        sequences never admitted when ``resumes_first``."""
        self.status = SequenceStatus.WAITING
        self.slot, self.n_prefilled, self.n_past = -1, 0, 0
        self.preemptions += 1
        self.resumes_first = resumes_first

    def start_history(self) -> None:
        """Allocate :attr:`history` holding the prompt (at admission)."""
        n = len(self.request.prompt)
        self.history = np.empty(n + (self.request.sampling.max_new_tokens or 0), np.int32)
        self.history[:n] = self.request.prompt

    def generated(self, token: int) -> None:
        """Record the next generated token (it is fed at the next step)."""
        self.history[len(self.request.prompt) + self.n_generated] = token
        self.n_generated += 1
        self.last_token = token

    def kv_tokens(self) -> np.ndarray:
        """The tokens whose KV cells the slot holds (a view of :attr:`history`)."""
        return self.history[:self.n_past]
