"""A request's sequences on their way into the engine (:class:`Submission`), each step once:

    prepare (every prompt checked and resolved: ``EngineClient.prepare``) -> admit (the tenant's
    rate limits) -> reserve (its spend: ``server/control/accounting.py``) -> submit (``n``
    sequences per prepared prompt) ... charge generated tokens -> close -> settle (the usage)

A request that can never run is refused before it costs quota; one refused later is refunded.
"""
from __future__ import annotations

import dataclasses
import socket
import time
from typing import TYPE_CHECKING

from engine.client import EngineClient
from engine.errors import InvalidRequest
from engine.request import EngineRequest, FieldNames, Priority, RequestKind, SamplingParams, reduce_seed
from engine.stream import Stream
from server.tenancy.ratelimit import RateLimiter
from server.tenancy.tenants import Tenant

if TYPE_CHECKING:  # injected by the front ends; the control plane imports the request schema
    from server.control.accounting import Accounting, Reservation

#: Generated tokens are charged to the tenant's token bucket every this many tokens or seconds,
#: whichever comes first, so a long answer keeps its tenant's bucket current with few calls.
CHARGE_EVERY_TOKENS, CHARGE_EVERY_S = 16, 0.1


def check_choices(engine: EngineClient, n_prompts: int, n: int, tenant: Tenant) -> int:
    """The number of choices (sequences) a request asks for, if the server and the tenant can
    hold them all at once.

    Raises:
        InvalidRequest: more than the capacity or the tenant's ``max_concurrent`` (param ``n``).
    """
    choices = n_prompts * n
    for limit, whose in ((engine.capacity, "this server's capacity"), (tenant.max_concurrent, "this tenant's limit")):
        if limit is not None and choices > limit:
            raise InvalidRequest(f"{choices} choices (n={n} for {n_prompts} prompts) exceed {whose} of {limit} "
                                 "concurrent sequences", "n" if n > 1 or n_prompts == 1 else "prompt")
    return choices


class Submission:
    """One request's sequences for ``tenant``: submitted by :meth:`start`, charged while they
    generate (:meth:`charge`), released by :meth:`close`.

    Args:
        engine: the engine client. tenant: who asks. limiter: its rate limits (None: none).

    Attributes:
        streams: the submitted sequences, in submission order.
        rate_buckets: the tenant's buckets at admission, ``{"requests" | "tokens": (limit,
            remaining, reset seconds)}`` (empty: no limits), for ``x-ratelimit-*`` headers.
    """

    def __init__(self, engine: EngineClient, tenant: Tenant, limiter: RateLimiter | None,
                 accounting: Accounting | None = None):
        self.engine, self.tenant, self.limiter, self.accounting = engine, tenant, limiter, accounting
        #: The spend reserved at admission (None: no accounting, or not admitted).
        self.reservation: Reservation | None = None
        self.streams: list[Stream] = []
        #: Prepared sequences not submitted yet (``start``'s ``window``), for :meth:`submit_next`.
        self.pending: list[EngineRequest] = []
        self.rate_buckets: dict = {}
        self._admitted: int | None = None  # prompt tokens taken with the request, refunded on a refusal
        self._uncharged, self._charged_at = 0, time.monotonic()

    def start(self, prompts: list[list[int]], n: int, sampling: SamplingParams, kind: RequestKind,
              fields: FieldNames, priority: Priority, deadline_ms: float | None = None,
              watch_socket: socket.socket | None = None, submits: bool = True, window: int | None = None) -> None:
        """Prepare every prompt, admit the request (one request, the prompt tokens of every
        choice it submits), then submit ``n`` sequences per prompt (none unless ``submits``:
        the prompts are only checked; with ``n`` 1, the first ``window`` prompts only, the
        others by :meth:`submit_next`, so a request of more inputs than the engine's mailboxes
        runs through them as they free).

        Raises:
            InvalidRequest, PromptTooLong: a prompt does not fit (naming the field of
            ``fields`` at fault). RateLimited: over the tenant's quota or concurrency limit
            (``QuotaExceeded``: its spend limit or token quota). ControlUnavailable: the spend
            could not be reserved.
            Saturated, EngineUnavailable: no room or no engine. Nothing stays submitted, and a
            refused request is refunded to its tenant's buckets.
        """
        try:
            prepared = self.prepare(prompts, sampling, kind, fields)
            self.admit(n * sum(len(p) for p in prompts) if submits else 0)
            if self.accounting is not None:
                self.reservation = self.accounting.reserve(
                    self.tenant, sum(len(p) for p in prompts),
                    n * sum(r.sampling.max_new_tokens for r in prepared) if submits else 0)
            if submits:
                self.pending = prepared[window:] if window is not None else []
                deadline = None if deadline_ms is None else time.monotonic() + deadline_ms / 1000
                self._later = (priority, deadline, watch_socket, fields.grammar)
                self.submit(prepared[:window] if window is not None else prepared, n, priority, deadline_ms,
                            watch_socket, fields.grammar)
        except BaseException:
            self.close()  # nothing stays submitted
            if self._admitted is not None:
                self.limiter.refund(self.tenant, self._admitted)
            if self.reservation is not None:
                self.reservation.release()
            raise

    def prepare(self, prompts: list[list[int]], sampling: SamplingParams, kind: RequestKind,
                fields: FieldNames) -> list[EngineRequest]:
        """Each prompt's engine request, resolved once (``EngineClient.prepare``); raises as it."""
        return [self.engine.prepare(prompt, sampling, kind, fields) for prompt in prompts]

    def admit(self, cost: int) -> None:
        """Take one request and ``cost`` tokens from the tenant's quota. Raises RateLimited."""
        if self.limiter is not None:
            self.rate_buckets = self.limiter.admit(self.tenant, cost).buckets
            self._admitted = cost

    def submit(self, prepared: list[EngineRequest], n: int, priority: Priority, deadline_ms: float | None,
               watch_socket: socket.socket | None, grammar_param: str | None, admitted: bool = False) -> None:
        """``n`` sequences of each prepared request into :attr:`streams`; the tenant's priority
        caps the request's, its index and weight go to the engine's fair share
        (:meth:`Tenant.share`). The request is under way once its first sequence is in: the
        others are served while the server drains (``admitted``), so a drain that begins between
        two of them cannot refuse a request whose first sequences run. Raises as
        ``EngineClient.submit``."""
        share = self.tenant.share(priority)
        for prompt in prepared:
            for j in range(n):
                request, seed = prompt, prompt.sampling.seed
                if seed is not None and j:  # one seed would make every choice the same
                    request = dataclasses.replace(prompt, sampling=dataclasses.replace(
                        prompt.sampling, seed=reduce_seed(seed + j)))
                self.streams.append(self.engine.submit(request, deadline_ms=deadline_ms, watch_socket=watch_socket,
                                                       grammar_param=grammar_param,
                                                       admitted=admitted or bool(self.streams),
                                                       **share._asdict()))

    def submit_next(self) -> None:
        """Submit the first of :attr:`pending` (one sequence): with what is left of the request's
        deadline, and while the server drains (the request was admitted before). Raises as
        ``EngineClient.submit`` (Saturated: no mailbox free now; it stays pending)."""
        priority, deadline, watch_socket, grammar_param = self._later
        left_ms = None if deadline is None else max(0.001, (deadline - time.monotonic()) * 1000)
        self.submit(self.pending[:1], 1, priority, left_ms, watch_socket, grammar_param, admitted=True)
        del self.pending[0]

    def charge(self, tokens: int, final: bool = False) -> None:
        """Charge generated tokens to the tenant's token bucket, aggregated (see
        :data:`CHARGE_EVERY_TOKENS`)."""
        if self.limiter is None or self.tenant.tokens_per_second is None:
            return
        self._uncharged += tokens
        now = time.monotonic()
        if self._uncharged and (final or self._uncharged >= CHARGE_EVERY_TOKENS
                                or now - self._charged_at >= CHARGE_EVERY_S):
            self.limiter.charge(self.tenant, self._uncharged)
            self._uncharged, self._charged_at = 0, now

    def close(self) -> None:
        """Cancel every unfinished sequence, then wait for each and release it, and charge what
        is left to charge (idempotent)."""
        for s in self.streams:
            if not s.finished:
                s.cancel()
        for s in self.streams:
            s.close()
        self.charge(0, final=True)
