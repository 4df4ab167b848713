"""Reading results: one :class:`Stream` per submitted sequence, and :func:`follow`, the one output
loop that waits on many streams and the client's socket together (as vLLM v1 has one output
loop for all requests, not a thread per request); an embedding's vector with
:meth:`Stream.embedding`, many inputs' with :func:`embeddings`."""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from engine.errors import (ClientDisconnected, ConstraintFailed, DeadlineExceeded, EngineUnavailable, InvalidRequest,
                           ShuttingDown)
from shm import ErrorCode, Finish, Lease
from shm.mailbox import Mailboxes

_ERROR_MESSAGES = {ErrorCode.ENGINE_DIED: "engine died while serving the request",
                   ErrorCode.DECODE: "engine failed to decode the request's batch"}
#: Seconds between checks of a stream nobody woke (the engine rings at every token, so this
#: only bounds how late a lost wake-up or an engine restart is noticed).
POLL_S = 1.0


@dataclass(frozen=True)
class Token:
    """One generated token: id, its log-probability and ``top`` ``[(id, logprob)]`` (if asked)."""

    id: int
    logprob: float | None = None
    top: tuple = ()


@dataclass(frozen=True)
class Timings:
    """``time.monotonic()`` seconds of one request (0 where not reached) and engine steps."""

    queued: float = 0.0
    admitted: float = 0.0
    prefill_done: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    step_admitted: int = 0
    step_finished: int = 0


class Stream:
    """The tokens of one submitted sequence, in order, as the engine publishes them.

    Iterate it (then read ``finish_reason``: ``stop | length | deadline | cancelled``, and, once
    closed, ``n_cached``: prompt tokens reused from the prefix cache), or read
    many streams together with :func:`follow`. It must be consumed or closed (``with``):
    closing an unfinished stream cancels the sequence, waits for the engine to finish it (one
    step) and returns the mailbox.

    An embedding's stream (``embeds``) has no tokens: read its vector with :meth:`embedding`
    (or many streams' with :func:`embeddings`).

    Args:
        mailboxes: the transport's mailboxes. lease: the mailbox holding the results.
        n_logprobs: top-k asked for, or None. watch_socket: the client's connection, for
            :meth:`__iter__` (a hang-up cancels). grammar_param: the request field the
            sequence's grammar came from (named by ``ConstraintFailed``). embeds: the request is
            an embedding (``RequestKind.EMBED``).
    """

    def __init__(self, mailboxes: Mailboxes, lease: Lease, n_prompt: int, n_logprobs: int | None,
                 watch_socket: socket.socket | None = None, engine_alive: Callable[[], bool] | None = None,
                 grammar_param: str | None = None, embeds: bool = False):
        self.mailboxes, self.lease, self.engine_alive = mailboxes, lease, engine_alive
        self.grammar_param, self.embeds = grammar_param, embeds
        self.n_prompt, self.n_logprobs, self.watch_socket = n_prompt, n_logprobs, watch_socket
        self.n_generated = 0
        self.n_cached = 0
        self.finished = False
        self.finish_reason: str | None = None
        self._timings: Timings | None = None

    def poll(self) -> list[Token]:
        """The tokens published since the last call; sets ``finished`` and ``finish_reason``
        once the engine is done.

        Raises:
            EngineUnavailable: the engine died or stopped. InvalidRequest: the engine refused
            the request. ConstraintFailed: the sequence's grammar failed.
        """
        n, done = self.mailboxes.read_new(self.lease)
        tokens = []
        if not self.embeds:  # an embedding's counter counts its vector's values, not tokens
            tokens = [Token(*self.mailboxes.token(self.lease, k, self.n_logprobs)) for k in range(self.n_generated, n)]
            self.n_generated = n
        if done:
            self.finished = True
            outcome = self.mailboxes.outcome(self.lease)
            if outcome.finish == Finish.ERROR:
                if outcome.error == ErrorCode.BAD_REQUEST:
                    raise InvalidRequest("engine rejected the request")
                if outcome.error == ErrorCode.CONSTRAINT:
                    raise ConstraintFailed("the output's grammar allowed no token the sampler could pick; "
                                           "the sequence was ended rather than continued unconstrained",
                                           self.grammar_param)
                if outcome.error == ErrorCode.SHUTDOWN:
                    raise ShuttingDown("the server is shutting down")
                raise EngineUnavailable(_ERROR_MESSAGES.get(outcome.error, "engine stopped"))
            self.finish_reason = outcome.finish.name.lower()
        return tokens

    @property
    def missed_deadline(self) -> bool:
        """Its deadline passed before its first token: the request is ``DEADLINE_EXCEEDED`` (a
        choice with tokens answers with them, ``finish_reason: deadline``)."""
        return self.finish_reason == "deadline" and self.n_generated == 0

    def __iter__(self) -> Iterator[Token]:
        """Tokens as they come; closes the stream at the end.

        Raises:
            DeadlineExceeded: the deadline passed before the first token.
            ClientDisconnected: ``watch_socket`` hung up (the sequence was cancelled).
        """
        try:
            for _, tokens in follow([self], self.watch_socket):
                yield from tokens
            if self.missed_deadline:
                raise DeadlineExceeded("deadline passed before the first token")
        finally:
            self.close()

    def prompt_logprobs(self, prompt: list[int]) -> list[Token]:
        """A scoring request's ``prompt`` (its token ids), scored: one :class:`Token` per prompt
        token, the first with logprob None (nothing predicts it), each other with its
        log-probability and top ``n_logprobs`` alternatives as far as the engine has published
        them (all of them once the first token arrived or the sequence finished normally; a
        position not reached, after a cancel or a deadline, has logprob None). Read before
        :meth:`close`."""
        entries = self.mailboxes.prompt_logprobs(self.lease, self.n_logprobs or 0)
        return [Token(prompt[0])] + [Token(t, *e) for t, e in zip(prompt[1:], entries)] + \
            [Token(t) for t in prompt[1 + len(entries):]]

    def embedding(self) -> np.ndarray:
        """An embedding's vector, once the engine computed it: float32 ``[n_embd]``, unit length
        (a copy). Waits for it (with the client's socket watched), then closes the stream.

        Raises:
            DeadlineExceeded: the deadline passed first. ClientDisconnected: ``watch_socket``
            hung up, or the request was cancelled. EngineUnavailable, ShuttingDown,
            InvalidRequest: as :meth:`poll` (the engine died or stopped; it refused the request,
            as an embedding engine refuses a request that is not an embedding).
            TypeError: not an embedding's stream.
        """
        return embeddings([self], self.watch_socket)[0]

    def _vector(self) -> np.ndarray:
        """The finished embedding's vector (:meth:`embedding`), read before :meth:`close`."""
        if self.finish_reason == "deadline":
            raise DeadlineExceeded("deadline passed before the embedding was computed")
        if self.finish_reason == "cancelled":
            raise ClientDisconnected("the embedding was cancelled before it was computed")
        return self.mailboxes.vector(self.lease)

    def timings(self) -> Timings:
        """Timestamps of this request (kept from the mailbox when the stream closed)."""
        if self._timings is not None:
            return self._timings
        o = self.mailboxes.outcome(self.lease)
        return Timings(o.t_queued, o.t_admitted, o.t_prefill_done, o.t_first_token, o.t_finished,
                       o.step_admitted, o.step_finished)

    def check_engine(self) -> None:
        """Fail this sequence (``EngineUnavailable`` at the next :meth:`poll`) if the engine
        process holding it is gone. The supervisor fails a dead engine's sequences within a sweep;
        an engine whose master died alone ends them itself (``PR_SET_PDEATHSIG`` sends it SIGTERM);
        but when both were killed no one is left to, and the front ends, which outlive the master
        for a moment, must end their streams themselves (with an error event, not a cut
        connection). Only this sequence's own lease is failed: it was submitted to the engine
        whose pid is read."""
        if self.engine_alive is not None and not self.engine_alive():
            self.mailboxes.fail(self.lease, ErrorCode.ENGINE_DIED)

    def cancel(self) -> None:
        """Ask the engine to stop this sequence (it finishes it within one step)."""
        self.mailboxes.cancel(self.lease)

    def close(self, timeout: float = 30.0) -> None:
        """Cancel if unfinished, wait until the engine finished it, and return the mailbox."""
        if self._timings is not None:
            return
        boxes = self.mailboxes
        if not boxes.read_new(self.lease)[1]:
            self.cancel()
            end = time.monotonic() + timeout
            while not boxes.read_new(self.lease)[1] and time.monotonic() < end:
                boxes.wait([self.lease], 0.1)
        # Kept before the release: the mailbox may be leased again right after it.
        self._timings = self.timings()
        self.n_cached = boxes.outcome(self.lease).n_cached
        boxes.release(self.lease)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def follow(streams: list[Stream], watch_socket: socket.socket | None = None,
           idle_s: float | None = None) -> Iterator[tuple[int, list[Token]]]:
    """The output loop: yield ``(k, new tokens of streams[k])`` as the engine publishes them,
    until every stream is finished (``streams[k].finished``; the last yield of a stream may hold
    no token). One ``poll(2)`` waits on every unfinished stream's wake-up and the client socket.
    With ``idle_s``, ``(-1, [])`` is yielded whenever that many seconds passed without a yield.

    Closes nothing: the caller closes the streams (which cancels the unfinished ones).

    Raises:
        ClientDisconnected: ``watch_socket`` hung up; every unfinished stream was cancelled.
        EngineUnavailable, InvalidRequest: from :meth:`Stream.poll`.
    """
    if not streams:
        return
    mailboxes = streams[0].mailboxes
    fd = watch_socket.fileno() if watch_socket is not None else None
    open_ = {s.lease.index: k for k, s in enumerate(streams) if not s.finished}
    due = set(open_)  # check each once first: tokens may be there before any wake-up is seen
    last = time.monotonic()
    while open_:
        for index in sorted(due & open_.keys()):
            k = open_[index]
            tokens = streams[k].poll()
            if streams[k].finished:
                del open_[index]
            if tokens or streams[k].finished:
                last = time.monotonic()
                yield k, tokens
        if not open_:
            return
        timeout = POLL_S
        if idle_s is not None:
            idle = time.monotonic() - last
            if idle >= idle_s:
                last = time.monotonic()
                yield -1, []
                idle = 0.0
            timeout = min(POLL_S, idle_s - idle)
        due, hung_up = mailboxes.wait([streams[k].lease for k in open_.values()], timeout, fd)
        if hung_up:
            # POLLRDHUP: the client closed (or shut down) its side. Even if it pipelined another
            # request first, nobody is left to read these answers.
            for k in open_.values():
                streams[k].cancel()
            raise ClientDisconnected("client closed the connection")
        if not due:  # timed out: look at everything (a restart, a lost wake-up, an engine gone)
            for k in open_.values():
                streams[k].check_engine()
            due = set(open_)


def embeddings(streams: list[Stream], watch_socket: socket.socket | None = None) -> list[np.ndarray]:
    """Every embedding stream's vector, in order (float32 ``[n_embd]`` each, unit length): waits
    for them all in one output loop (:func:`follow`, watching ``watch_socket``), then closes
    every stream (which cancels the unfinished ones, when one failed).

    Raises:
        as :meth:`Stream.embedding`, for the first stream that failed.
    """
    if not all(s.embeds for s in streams):
        raise TypeError("not an embedding's stream: its request's kind is not EMBED")
    try:
        for _ in follow(streams, watch_socket):
            pass
        return [s._vector() for s in streams]  # noqa: SLF001 - this module's own
    finally:
        for s in streams:
            s.close()
