"""The one module front ends use to talk to the engine (over :mod:`shm`).

Usage::

    client = EngineClient.attach(transport_name)
    stream = client.submit(prompt_ids, SamplingParams(max_new_tokens=32, temperature=0))
    for token in stream:          # Token(id, logprob, top) as the engine publishes them
        ...
    stream.finish_reason          # "stop" | "length" | "deadline" | "cancelled"

An embedding engine (``client.kind == "embed"``, vectors of ``client.n_embd`` values)::

    vector = client.embed(input_ids).embedding()     # float32 [n_embd], unit length
    vectors = embeddings([client.embed(ids) for ids in inputs], watch_socket)

Many streams are read together with :func:`engine.stream.follow` (an embedding's with
:func:`engine.stream.embeddings`). Errors are those of :mod:`engine.errors`.
"""
from __future__ import annotations

import dataclasses
import functools
import socket
from typing import Sequence as Seq

import numpy as np

from engine.errors import ClientDisconnected, EngineUnavailable, InvalidRequest, RateLimited, Saturated, ShuttingDown
from engine.request import EngineRequest, FieldNames, Priority, RequestKind, SamplingParams, extras_room
from engine.stream import Stream
from engine.supervisor import pid_alive
from shm.buckets import SharedBuckets
from shm.control import Snapshot
from shm.mailbox import TenantBusy
from shm.transport import Transport
from shm.wakeup import hung_up

#: Seconds without an engine step after which the engine counts as stalled (it steps at least
#: every 0.5 s, idle or not); the supervisor kills it after the same time.
STALL_S = 30.0


class EngineClient:
    """Submit token ids to the engine and read results; safe to share between threads.

    Args:
        transport: an attached or created :class:`shm.Transport`.
    """

    def __init__(self, transport: Transport):
        self.t = transport
        self.max_seq_len = transport.layout.max_seq_len
        self.max_extras_bytes = extras_room(transport.layout.record_bytes, self.max_seq_len)
        self.max_slots = transport.layout.max_slots
        #: What the engine serves: ``generate`` (text and scoring) or ``embed`` (one vector an
        #: input; ``EngineConfig.kind``), from the shared memory's layout.
        self.kind = "embed" if transport.layout.embed else "generate"

    @classmethod
    def attach(cls, name: str) -> "EngineClient":
        return cls(Transport.attach(name))

    def ready(self, stall_s: float = STALL_S) -> bool:
        """True when the engine has loaded the model, made progress within ``stall_s`` seconds,
        and its process exists (an engine killed with its master leaves no one to mark it dead in
        the control block)."""
        return self.t.control.ready(stall_s) and self.engine_alive()

    def draining(self) -> bool:
        """True once the server started draining (SIGTERM): no new request is taken."""
        return self.t.control.draining

    def accepting(self) -> bool:
        """Ready and not draining: a new request would be served (readiness)."""
        return self.ready() and not self.draining()

    @property
    def n_embd(self) -> int:
        """An embedding engine's vector dimension (``llama_model_n_embd_out``); 0 until its
        engine loaded the model, and for a generation engine."""
        return self.t.control.n_embd

    @property
    def capacity(self) -> int:
        """Sequences that can be in flight at once (running plus queued): the mailboxes."""
        return self.t.layout.n_mailboxes

    def prepare(self, prompt_ids: Seq[int], params: SamplingParams, kind: RequestKind = RequestKind.GENERATE,
                fields: FieldNames = FieldNames()) -> EngineRequest:
        """The request of one sequence, checked to fit this engine's records and with
        ``max_new_tokens`` resolved (:meth:`EngineRequest.resolved`), for :meth:`submit`.
        Submits nothing.

        Raises:
            InvalidRequest / PromptTooLong: the request does not fit, naming the field of
            ``fields`` at fault. InvalidRequest (``param`` ``model``): an embedding asked of a
            generation engine, or anything else of an embedding engine.
        """
        if (kind == RequestKind.EMBED) != (self.kind == "embed"):
            raise InvalidRequest("this model computes embeddings only" if self.kind == "embed" else
                                 "this model does not compute embeddings", "model")
        return EngineRequest(np.asarray(prompt_ids, dtype=np.int32), params, kind=kind).resolved(
            self.max_seq_len, self.max_extras_bytes, fields)

    def submit(self, request: EngineRequest | Seq[int], params: SamplingParams | None = None, *,
               priority: Priority = Priority.NORMAL, deadline_ms: float | None = None, tenant: int = 0,
               weight: float = 1.0, max_concurrent: int | None = None, watch_socket: socket.socket | None = None,
               kind: RequestKind = RequestKind.GENERATE, grammar_param: str | None = None,
               admitted: bool = False) -> Stream:
        """Queue one sequence.

        Args:
            request: what :meth:`prepare` made, or token ids (1..max_seq_len-1 of them;
                max_seq_len for an embedding) to prepare here with ``params`` and ``kind``.
            kind: generate, or score the prompt first (:class:`RequestKind`; the stream's
                :meth:`Stream.prompt_logprobs`), then generate ``max_new_tokens`` (0 allowed);
                or, of an embedding engine, embed the prompt (``max_new_tokens`` 0 or None; the
                stream's :meth:`Stream.embedding`; see :meth:`embed`).
            deadline_ms: milliseconds from now after which the engine gives up; None = none.
            tenant, weight: fair-share identity and weight (VTC).
            max_concurrent: most sequences ``tenant`` may have in flight on this node (None: no limit).
            watch_socket: the client's connection; if it closes, the sequence is cancelled.
            grammar_param: the request field the grammar came from, named by the stream's
                ``ConstraintFailed``.
            admitted: a later sequence of a request already under way (a choice after its
                first, an embedding request's input after its first): served while the server
                drains, as its first one is.
        Raises:
            InvalidRequest / PromptTooLong: token ids whose request does not fit (:meth:`prepare`).
            InvalidRequest: ``deadline_ms`` not a positive, finite number.
            ClientDisconnected: ``watch_socket`` is already closed. ShuttingDown: the server is
            draining (and the request not ``admitted``, or its engine already stopped).
            EngineUnavailable: the engine is not ready. Saturated: no free mailbox. RateLimited
            (``kind`` ``concurrency``): the tenant is at ``max_concurrent``.
        """
        if not isinstance(request, EngineRequest):
            request = self.prepare(request, params, kind)
        request = dataclasses.replace(request, priority=Priority(priority), tenant=tenant, weight=weight,
                                      deadline=EngineRequest.deadline_after(deadline_ms))
        if watch_socket is not None and hung_up(watch_socket):
            # A request read from a pipeline after its client left must not be decoded.
            raise ClientDisconnected("client closed the connection before its request was queued")
        if self.draining() and not admitted:
            raise ShuttingDown("the server is shutting down: retry on another replica")
        if not self.ready():
            if self.draining():  # the drain's timeout stopped the engine under a request under way
                raise ShuttingDown("the server is shutting down")
            raise EngineUnavailable("engine is not ready")
        try:
            lease = self.t.mailboxes.lease(tenant, max_concurrent)
        except TenantBusy:
            raise RateLimited(f"the tenant's sequences in flight are at its limit of {max_concurrent} (each of a "
                              "request's n choices is one)", 1.0, kind="concurrency") from None
        if lease is None:
            raise Saturated(retry_after=1)
        self.t.mailboxes.submit(lease, len(request.prompt),
                                functools.partial(request.encode, max_seq_len=self.max_seq_len))
        return Stream(self.t.mailboxes, lease, len(request.prompt), request.sampling.logprobs, watch_socket,
                      self.engine_alive, grammar_param, embeds=request.kind == RequestKind.EMBED)

    def embed(self, input_ids: Seq[int], *, fields: FieldNames = FieldNames(), **submit_kwargs) -> Stream:
        """Queue one input of an embedding engine: :meth:`submit` of ``input_ids`` (1 to
        ``max_seq_len`` token ids) as :attr:`RequestKind.EMBED`, nothing to generate.
        ``submit_kwargs``: :meth:`submit`'s keywords (priority, deadline_ms, tenant, weight,
        max_concurrent, watch_socket); ``fields``: the request's field names for refusals.
        Read its vector with :meth:`Stream.embedding`.

        Raises:
            as :meth:`submit` (InvalidRequest, ``param`` ``model``, from a generation engine).
        """
        request = self.prepare(input_ids, SamplingParams(max_new_tokens=0), RequestKind.EMBED, fields)
        return self.submit(request, **submit_kwargs)

    def engine_alive(self) -> bool:
        """The engine process named in the control block exists (False once it died, until a
        new one starts); read by a stream that waited a poll period for nothing
        (``Stream.check_engine``)."""
        return pid_alive(self.t.control.engine_pid)

    @property
    def buckets(self) -> SharedBuckets:
        """The token buckets this node's processes share (the rate limiter's local fallback)."""
        return self.t.buckets

    # -- inspection (tests, benchmarks, metrics) ------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The slot table as of the engine's last completed step (consistent: a seqlock)."""
        return self.t.control.snapshot()

    def step(self) -> int:
        """The engine's last completed step number."""
        return self.t.control.step

    def slot_mailboxes(self) -> list[int]:
        """Mailbox index held by each KV slot (-1: free), as of the engine's last step."""
        return self.snapshot().slot_mailbox

    def kv_pos_max(self) -> list[int]:
        """Highest KV position of each slot (-1: no cells), as of the engine's last step."""
        return self.snapshot().kv_pos_max

    def mailboxes_in_use(self) -> int:
        return self.t.mailboxes.in_use()

    def saturated(self) -> bool:
        """Every mailbox is leased: :meth:`submit` would raise Saturated now. A cheap, lock-free
        look (microseconds) for refusing before any parsing; :meth:`submit` decides for real."""
        return self.mailboxes_in_use() >= self.capacity

    def close(self) -> None:
        self.t.close()
