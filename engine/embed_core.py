"""The embedding loop: one thread batching whole inputs into one ``llama_decode`` a step, each
pooled into one unit vector (docs/architecture.md, "Embedding step"), as llama-server serves
``--embeddings`` (tools/server/server-context.cpp: every token of an embedding's prompt an output,
``send_embedding`` reading ``llama_get_embeddings_seq`` and normalizing it)::

    ingest -> expire -> pack (whole inputs, by priority class, tenant fair share, deadline, arrival)
           -> admit -> decode
           -> read, normalize and publish each vector -> finish -> clear the KV cache

Continuous batching: what waits is packed into the next step that has room, and a step holds
nothing over to the next (its inputs finish with it), so every step starts with an empty batch
and an empty cache. What it shares with the generation loop is :class:`engine.loop.EngineLoop`'s.
"""
from __future__ import annotations

import logging
import math
import time

import numpy as np

from engine.config import EngineConfig
from engine.fair_share import TokenCounters
from engine.llama.batch import Batch
from engine.llama.embedding import EmbeddingModel
from engine.llama.model import DecodeError
from engine.loop import EngineLoop
from engine.request import EngineRequest, RequestKind
from engine.scheduler import class_ranks
from engine.sequence import Sequence
from engine.threads import AdaptiveThreads
from shm import ErrorCode, Finish
from shm.transport import Transport

log = logging.getLogger("engine")


class EmbedCore(EngineLoop):
    """The embedding engine's loop: same surface as :class:`engine.core.EngineCore`
    (:meth:`run`, :meth:`stop`, :meth:`step`, :meth:`shutdown`), over an
    :class:`engine.llama.embedding.EmbeddingModel`. Serves :attr:`RequestKind.EMBED` requests
    only; it publishes its vector dimension in the control block (``n_embd``) at start.

    Args:
        config: sizes (kind ``embed``: ``n_batch`` tokens and ``max_slots`` inputs a step; an
            input of up to ``max_seq_len`` tokens; ``aging_s``). transport: attached shared
            memory. model: the loaded embedding context. adaptive: the adaptive thread count
            (None: the configured count).
    """

    def __init__(self, config: EngineConfig, transport: Transport, model: EmbeddingModel,
                 adaptive: AdaptiveThreads | None = None):
        super().__init__(config, transport, model, adaptive)
        self.waiting: list[Sequence] = []
        self.counters = TokenCounters()  # each tenant's tokens embedded over its weight (VTC)
        self.batch = Batch(max(config.n_batch, config.max_seq_len))  # one input longer than n_batch alone
        transport.control.set_n_embd(model.n_embd)

    def has_work(self) -> bool:
        return bool(self.waiting)

    def step(self) -> None:
        """One iteration: ingest, expire, pack, decode, publish; at most one decode, after which
        no input is left running."""
        self.step_no += 1
        now = time.monotonic()
        self.ingest(now)
        self.expire(now)
        packed = self.pack(now)
        if packed:
            self.execute(packed, now)
        self.publish_control()
        self.log_step(now, [(seq.mailbox, seq.lease) for seq in packed])

    # -- phases -------------------------------------------------------------------------------
    def servable(self, request: EngineRequest) -> bool:
        """Defensive: an embedding (:attr:`RequestKind.EMBED`, nothing to generate) of 1 to
        ``max_seq_len`` tokens, each inside the vocabulary."""
        prompt = request.prompt
        return (request.kind == RequestKind.EMBED and not request.sampling.max_new_tokens
                and 1 <= len(prompt) <= self.config.max_seq_len
                and int(prompt.min()) >= 0 and int(prompt.max()) < self.model.n_vocab)

    def queue(self, seq: Sequence) -> None:
        """Queue an input; its tenant, if it had none waiting, is lifted
        (:meth:`engine.fair_share.TokenCounters.lift`)."""
        self.counters.lift(seq.request.tenant, (s.request.tenant for s in self.waiting))
        self.waiting.append(seq)

    def expire(self, now: float) -> None:
        """Finish waiting inputs whose client cancelled or whose deadline passed."""
        for seq in list(self.waiting):
            reason = self.expiry(seq, now)
            if reason:
                self.waiting.remove(seq)
                self.end(seq, reason)

    def pack(self, now: float) -> list[Sequence]:
        """Take this step's inputs out of the waiting queue, one at a time, each time the first in
        the generation scheduler's order (``engine/scheduler.py``): priority class (a class raised
        one rank for every ``aging_s`` its oldest input has waited:
        :func:`engine.scheduler.class_ranks`), then the tenant's fair-share counter (charged each
        input's tokens over its weight as it is packed, so tenants take turns within a step),
        then deadline, then arrival; each whole input that fits the ``n_batch`` tokens left, up
        to ``max_slots`` inputs. An input that does not fit lets the next in that order in; an
        empty batch holds any input (one longer than ``n_batch``, up to ``max_seq_len``, alone),
        so the first in order always goes."""
        rank = class_ranks(self.waiting, now, self.config.aging_s)
        room, packed, left = self.config.n_batch, [], list(self.waiting)
        while left and len(packed) < self.config.max_slots and room > 0:
            fits = [s for s in left if len(s.prompt) <= room or not packed]
            if not fits:
                break
            seq = min(fits, key=lambda s: (rank[s.request.priority], self.counters[s.request.tenant],
                                           s.request.deadline or math.inf, s.order))
            left.remove(seq)
            packed.append(seq)
            room -= len(seq.prompt)
            self.counters.charge(seq.request.tenant, len(seq.prompt), seq.request.weight)
        for seq in packed:
            self.waiting.remove(seq)
        return packed

    def execute(self, packed: list[Sequence], now: float) -> None:
        """Admit ``packed`` (sequence ``i`` of the batch is slot ``i``), decode them in one batch
        with every token an output, then publish each input's unit vector to its mailbox and
        finish it (``stop``); empty the KV cache. A failed decode finishes them with
        ``ErrorCode.DECODE``."""
        self.batch.clear()
        for slot, seq in enumerate(packed):
            seq.slot = slot
            self.boxes.admit(seq.mailbox, slot, self.step_no, now)
            self.batch.add(seq.prompt, 0, slot, False, all_logits=True)
        try:
            self.decode(self.batch)
        except DecodeError as e:
            log.error("%s; failing the inputs of this batch", e)
            self.model.clear()
            for seq in packed:
                self.end(seq, Finish.ERROR, ErrorCode.DECODE)
            return
        done = time.monotonic()
        vectors = [self.model.embedding(seq.slot) for seq in packed]
        self.model.clear()
        for seq, vector in zip(packed, vectors):
            if vector is None:  # llama.cpp pooled nothing for it: never with whole inputs
                log.error("llama.cpp returned no embedding for the input in mailbox %d", seq.mailbox)
                self.end(seq, Finish.ERROR, ErrorCode.DECODE)
                continue
            self.boxes.prefill_done(seq.mailbox, done)
            self.boxes.publish_vector(seq.mailbox, vector, done)
            self.end(seq, Finish.STOP)

    def publish_control(self) -> None:
        """Refresh the control block: step counter, heartbeat, waiting inputs. No slot holds an
        input or a KV cell between steps."""
        n = self.config.max_slots
        self.t.control.publish(self.step_no, np.full(n, -1, np.int32), np.full(n, -1, np.int32), len(self.waiting))

    def shutdown(self, error: ErrorCode) -> None:
        """Finish every waiting input with ``error`` (engine stopping)."""
        for seq in self.waiting:
            self.end(seq, Finish.ERROR, error)
        self.waiting = []
