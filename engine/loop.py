"""What every engine loop shares (docs/architecture.md, "Engine step"): the generation loop
(:class:`engine.core.EngineCore`) and the embedding loop (:class:`engine.embed_core.EmbedCore`)
each step over one llama.cpp context, and both

* wait on the engine's FIFO only when they have nothing to do, at most :data:`SAMPLE_S` at a time
  (the heartbeat the supervisor and ``/health`` read), sampling the CPUs' use meanwhile for the
  thread count (:mod:`engine.threads`);
* ingest the request ring into :class:`engine.sequence.Sequence` values, finishing with
  ``BAD_REQUEST`` what the loop cannot serve (a corrupt record, a kind it does not serve);
* end sequences that waited past their deadline or whose client cancelled;
* decode on the adaptive thread count, with the progress hook on decodes expected to be long;
* write the step log and the step metrics.
"""
from __future__ import annotations

import time

from engine.config import EngineConfig
from engine.llama.backend import Backend
from engine.llama.batch import Batch
from engine.request import EngineRequest
from engine.sequence import Sequence
from engine.steplog import StepLog
from engine.threads import SAMPLE_S, AdaptiveThreads
from shm import ErrorCode, Finish
from shm.transport import Transport
from shm.wakeup import Wakeups

#: Decodes expected to last at least this long report progress from inside llama.cpp (a heartbeat
#: per graph node, Model.on_progress), so the supervisor's watchdog does not take a long step
#: under contention for a hung engine. Shorter decodes skip the hook, whose 0.15 ms a decode would
#: cost up to 1-2 % of a small decode's time; their heartbeat is the step's end. Expected time,
#: not a token count: one thread beside a busy neighbour took 0.33 s for 63 tokens (a CI failure).
PROGRESS_HOOK_S = 0.05


def adaptive_threads(config: EngineConfig, backend: Backend) -> AdaptiveThreads | None:
    """The adaptive thread count for an engine (``n_threads`` 0, where the backend computes on
    the CPUs; engine/threads.py), or None. Made before the model loads, so its first sample spans
    the load and can decide alone."""
    return AdaptiveThreads(config.threads) if config.n_threads == 0 and backend.adaptive_threads else None


class EngineLoop:
    """The loop's shared state and phases; a subclass gives :meth:`step`, :meth:`has_work`,
    :meth:`servable` and :meth:`queue`.

    Args:
        config: sizes and policy. transport: attached shared memory. model: the loaded llama.cpp
        context (:class:`engine.llama.model.Context`). adaptive: the adaptive thread count (None:
        the configured count), made before the model loaded (:func:`adaptive_threads`).
    """

    def __init__(self, config: EngineConfig, transport: Transport, model, adaptive: AdaptiveThreads | None = None):
        self.config = config
        self.t = transport
        self.boxes = transport.mailboxes
        self.model = model
        self.stopping = False
        self.step_no = transport.control.step
        self.adaptive = adaptive
        model.on_progress(transport.control.beat)
        # Seconds per batch token of the last decode: predicts the next one's length (None: no
        # decode yet, so the first reports progress). A poor guess costs 0.15 ms, or a long
        # decode that beats only at its end, once: the next guess uses its rate.
        self.s_per_token: float | None = None
        self.step_log = StepLog(config.step_log) if config.step_log else None
        self.cancelled: list[tuple[int, int]] = []  # (mailbox, lease) cancelled this step, for the step log
        self.observe_step = None
        if config.metrics:  # imported only then: prometheus-client reads its mode at import
            from engine.metrics import step_observer
            self.observe_step = step_observer(config.name)

    # -- loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        """Step until :meth:`stop`; block on the engine's FIFO only when there is nothing to do."""
        while not self.stopping:
            self.wait()
            self.step()

    def stop(self) -> None:
        self.stopping = True

    def step(self) -> None:
        raise NotImplementedError

    def has_work(self) -> bool:
        """Sequences are waiting or running."""
        raise NotImplementedError

    def wait(self) -> None:
        """Before a step: with nothing to do, wait for the engine's FIFO (a request, a cancel)
        for at most :data:`SAMPLE_S`; a wait that times out samples the CPUs' use, so the next
        decode starts on the right thread count."""
        if not self.has_work():
            woken, _ = self.t.wakeups.wait([Wakeups.ENGINE], timeout=SAMPLE_S)
            if not woken and self.adaptive is not None:
                self.adaptive.threads()

    # -- phases -------------------------------------------------------------------------------
    def ingest(self, now: float) -> None:
        """Drain the request ring: each current record's request to :meth:`queue` as a new
        sequence; stale records dropped; a malformed one, or one :meth:`servable` refuses,
        finished with ``BAD_REQUEST``."""
        self.t.wakeups.drain(Wakeups.ENGINE)
        for rec in self.t.ring.pop_all():
            if not self.boxes.is_queued(rec.mailbox, rec.lease):
                continue  # the lease was reclaimed or failed meanwhile
            try:
                request = EngineRequest.decode(rec.payload, self.config.max_seq_len)
            except ValueError:  # a corrupt variable section, an unknown kind or priority
                request = None
            if request is None or not self.servable(request):
                self.boxes.finish(rec.mailbox, rec.lease, Finish.ERROR, ErrorCode.BAD_REQUEST, self.step_no)
                continue
            self.queue(Sequence(rec.mailbox, rec.lease, request, now))

    def servable(self, request: EngineRequest) -> bool:
        """Defensive: whether this loop can serve ``request`` (the client checked it; a corrupt
        record, or a request of a kind this engine does not serve, must not reach llama.cpp)."""
        raise NotImplementedError

    def queue(self, seq: Sequence) -> None:
        """Take a new, servable sequence into the waiting queue."""
        raise NotImplementedError

    def expiry(self, seq: Sequence, now: float) -> Finish:
        """``CANCELLED`` when its client cancelled (or its lease is gone), ``DEADLINE`` when its
        deadline passed, else ``NONE``."""
        if self.boxes.cancelled(seq.mailbox, seq.lease):
            return Finish.CANCELLED
        if seq.request.deadline and now >= seq.request.deadline:
            return Finish.DEADLINE
        return Finish.NONE

    def end(self, seq: Sequence, finish: Finish, error: ErrorCode = ErrorCode.NONE) -> None:
        """Finish ``seq``'s mailbox (DONE) with ``finish`` and ``error``; a cancel is noted for
        the step log."""
        self.boxes.finish(seq.mailbox, seq.lease, finish, error, self.step_no)
        if finish == Finish.CANCELLED:
            self.cancelled.append((seq.mailbox, seq.lease))

    def decode(self, batch: Batch, one_thread: bool = False) -> None:
        """One ``llama_decode`` of ``batch``: on one thread if asked, else on the adaptive (or
        configured) count; with the progress hook when it is expected to last
        :data:`PROGRESS_HOOK_S` or more; then the step metrics.

        Raises:
            DecodeError: llama.cpp refused the batch (its sequences are the caller's to fail).
        """
        self.model.set_threads(1 if one_thread else self.adaptive.threads() if self.adaptive else self.config.threads)
        n, start = batch.n, time.monotonic()
        self.model.decode(batch, report_progress=self.s_per_token is None or n * self.s_per_token >= PROGRESS_HOOK_S)
        self.s_per_token = (time.monotonic() - start) / n
        if self.observe_step is not None:
            self.observe_step(batch.n_seqs, batch.n)

    def log_step(self, now: float, decoded: list[tuple[int, int]]) -> None:
        """The step's record in the step log (if any): ``decoded`` ``(mailbox, lease)`` pairs and
        this step's cancels, which are then forgotten."""
        if self.step_log is not None:
            self.step_log.write(self.step_no, now, decoded, self.cancelled)
        self.cancelled = []
