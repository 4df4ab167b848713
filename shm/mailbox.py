"""Result mailboxes: leased by a front-end thread, written by the engine, read by that thread.

State machine of one mailbox (``state``, :class:`shm.layout.MailboxState`)::

    FREE --lease--> LEASED --submit--> QUEUED --admit--> RUNNING --finish--> DONE --release--> FREE
                                          |                                   ^
                                          +------------ finish ---------------+

Only the lease holder moves LEASED->QUEUED and DONE->FREE; only the engine (or, when the engine
died, its supervisor) moves QUEUED/RUNNING->DONE. ``lease`` grows at every lease, so a record or
a reader that names an older lease is recognised as stale and ignored.

Publication rule, kept by the verbs of this module and nowhere else: the writer stores **the
data, then the counter (``n_tokens``) or the state, then wakes** the reader's FIFO; the reader
**drains its FIFO, then reads the state, then the counter, then only the data the counter
covers**. The wake-up's ``write(2)`` and the reader's ``poll(2)``/``read(2)`` are system calls
and act as full barriers; between them x86-64 keeps stores in program order (TSO), so a
counter a reader sees never runs ahead of its data. Data behind a counter is never rewritten
while the counter covers it: a mailbox holds the whole sequence (no wrap-around).

Prompt log-probabilities (a scoring request) use the same per-position arrays from their far
end: prompt entry ``i``, the log-probability of prompt token ``i + 1`` given those before it
(the first token has none), is stored at index ``max_seq_len - 1 - i``. A sequence of ``n``
prompt tokens (``n - 1`` entries) generates at most ``max_seq_len - n`` tokens, so generated
tokens (from index 0) and prompt entries never share an index, and the segment needs no room of
its own for them. Their counter is ``n_prompt_logprobs``, under the same rule.

An embedding engine's answer is one vector (float32, ``n_embd <= max_seq_len`` values) in the
mailbox's ``logprobs`` row from index 0, its length in ``n_tokens``, under the same rule
(:meth:`Mailboxes.publish_vector`, :meth:`Mailboxes.vector`); its ``tokens`` row stays unused.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Iterable, NamedTuple

import numpy as np

from shm.layout import ErrorCode, Finish, MailboxState
from shm.lock import FlockLock
from shm.ring import RequestRing
from shm.wakeup import Wakeups

FREE, LEASED, QUEUED, RUNNING, DONE = MailboxState


class TenantBusy(Exception):
    """The tenant already holds its maximum of mailboxes (its concurrency limit)."""


class Lease(NamedTuple):
    """A mailbox held by one front-end thread: its index and the lease number."""

    index: int
    number: int


class Published(NamedTuple):
    """One token for :meth:`Mailboxes.publish`: mailbox ``index``, token position ``k``, token
    id, and its logprob with the top ids/logprobs (``None`` when not asked)."""

    index: int
    k: int
    token: int
    logprobs: tuple[float, np.ndarray, np.ndarray] | None


class Outcome(NamedTuple):
    """A DONE mailbox's result and timestamps (``time.monotonic()`` seconds, 0 = not reached)."""

    finish: Finish
    error: ErrorCode
    n_tokens: int
    n_cached: int
    t_queued: float
    t_admitted: float
    t_prefill_done: float
    t_first_token: float
    t_finished: float
    step_admitted: int
    step_finished: int


class Mailboxes:
    """Every verb of the mailbox protocol, for the three parties that use it.

    Args:
        arrays: the transport (``mailboxes``, ``tokens``, ``logprobs``, ``top_ids``,
            ``top_logprobs`` arrays). ring: the request ring. lock: the cross-process lock.
            wakeups: the FIFOs.
    """

    def __init__(self, arrays, ring: RequestRing, lock: FlockLock, wakeups: Wakeups):
        self.boxes = arrays.mailboxes
        self.tokens, self.logprobs = arrays.tokens, arrays.logprobs
        self.top_ids, self.top_logprobs = arrays.top_ids, arrays.top_logprobs
        self.ring, self.lock, self.wakeups = ring, lock, wakeups
        # Field views made once: the per-token paths (publish, read_new) index them directly.
        self._state, self._n_tokens = self.boxes["state"], self.boxes["n_tokens"]
        self._t_first_token = self.boxes["t_first_token"]

    # -- front end ----------------------------------------------------------------------------
    def lease(self, tenant: int = 0, max_per_tenant: int | None = None) -> Lease | None:
        """Take a free mailbox for this process and ``tenant``; None when every one is in use
        (saturated).

        Raises:
            TenantBusy: ``tenant`` already holds ``max_per_tenant`` mailboxes (counted across
            every process of this node, under the lock).
        """
        mb = self.boxes
        with self.lock:
            if max_per_tenant is not None and \
                    np.count_nonzero((mb["state"] != FREE) & (mb["tenant"] == tenant)) >= max_per_tenant:
                raise TenantBusy(tenant)
            free = np.flatnonzero(mb["state"] == FREE)
            if free.size == 0:
                return None
            i = int(free[0])
            box = mb[i]
            number = int(box["lease"]) + 1
            box["lease"] = number
            box["owner_pid"], box["tenant"] = os.getpid(), tenant
            box["cancel"] = box["n_tokens"] = box["n_prompt_logprobs"] = 0
            box["finish"], box["error"] = Finish.NONE, ErrorCode.NONE
            box["slot"], box["n_cached"] = -1, 0
            box["step_admitted"] = box["step_finished"] = 0
            for name in ("t_queued", "t_admitted", "t_first_token", "t_finished", "t_prefill_done"):
                box[name] = 0.0
            box["state"] = LEASED
        self.wakeups.drain(i)  # wake-ups left over from the previous lease
        return Lease(i, number)

    def submit(self, lease: Lease, n_prompt: int, write: Callable[[np.ndarray], None]) -> None:
        """LEASED -> QUEUED, push the request's record (``write`` fills its payload), wake the
        engine. On failure the mailbox is released and the error re-raised."""
        box = self.boxes[lease.index]
        box["n_prompt"], box["t_queued"] = n_prompt, time.monotonic()
        box["state"] = QUEUED  # before the record is visible: the engine ingests QUEUED only
        try:
            self.ring.push(lease.index, lease.number, write)
        except BaseException:
            self.release(lease)
            raise
        self.wakeups.wake(Wakeups.ENGINE)

    def read_new(self, lease: Lease) -> tuple[int, bool]:
        """After a wake-up: ``(tokens published so far, finished)``. State is read before the
        counter, so ``finished`` implies the count is final."""
        i = lease.index
        self.wakeups.drain(i)
        done = int(self._state[i]) == DONE
        return int(self._n_tokens[i]), done

    def token(self, lease: Lease, k: int, n_logprobs: int | None):
        """Token ``k`` (covered by the counter): ``(id, logprob, ((id, logprob), ...))``, the
        last two None/() when ``n_logprobs`` is None."""
        i = lease.index
        tok = int(self.tokens[i, k])
        if n_logprobs is None:
            return tok, None, ()
        top = tuple(zip(self.top_ids[i, k, :n_logprobs].tolist(), self.top_logprobs[i, k, :n_logprobs].tolist()))
        return tok, float(self.logprobs[i, k]), top

    def prompt_logprobs(self, lease: Lease, n_logprobs: int) -> list[tuple[float, tuple]]:
        """The prompt entries published so far (scoring), in order (entry ``i`` is prompt token
        ``i + 1``): ``(logprob, ((id, logprob), ...))`` each, with ``n_logprobs`` alternatives.
        Counter first, then the data it covers (the rule above)."""
        i = lease.index
        n = int(self.boxes["n_prompt_logprobs"][i])
        last = self.tokens.shape[1] - 1
        return [(float(self.logprobs[i, last - p]),
                 tuple(zip(self.top_ids[i, last - p, :n_logprobs].tolist(),
                           self.top_logprobs[i, last - p, :n_logprobs].tolist()))) for p in range(n)]

    def vector(self, lease: Lease) -> np.ndarray:
        """An embedding's vector as published so far: float32 ``[n]`` (a copy), ``n`` the
        counter; whole once the mailbox is DONE (read the state first: :meth:`read_new`)."""
        i = lease.index
        n = int(self._n_tokens[i])
        return self.logprobs[i, :n].copy()

    def wait(self, leases: Iterable[Lease], timeout: float | None, extra_fd: int | None = None):
        """Block until a wake-up of one of ``leases`` or ``extra_fd`` hangs up; see
        :meth:`shm.wakeup.Wakeups.wait`. Returns ``(mailbox indices woken, hung up)``."""
        return self.wakeups.wait([lease.index for lease in leases], timeout, extra_fd)

    def cancel(self, lease: Lease) -> None:
        """Ask the engine to finish the sequence (it does within one step). Atomic with leasing:
        a mailbox leased again is never cancelled by a stale holder."""
        box = self.boxes[lease.index]
        with self.lock:
            if int(box["lease"]) != lease.number or int(box["state"]) in (FREE, DONE):
                return
            box["cancel"] = 1
        self.wakeups.wake(Wakeups.ENGINE)

    def outcome(self, lease: Lease) -> Outcome:
        box = self.boxes[lease.index]
        return Outcome(Finish(int(box["finish"])), ErrorCode(int(box["error"])), int(box["n_tokens"]),
                       int(box["n_cached"]), *(float(box[f]) for f in ("t_queued", "t_admitted", "t_prefill_done",
                                                 "t_first_token", "t_finished")),
                       int(box["step_admitted"]), int(box["step_finished"]))

    def release(self, lease: Lease) -> None:
        """Give back a mailbox that is DONE (or was never submitted)."""
        mb = self.boxes
        with self.lock:
            if int(mb["lease"][lease.index]) == lease.number:
                mb["owner_pid"][lease.index] = 0
                mb["state"][lease.index] = FREE

    def in_use(self) -> int:
        """Number of mailboxes not FREE."""
        return int(np.count_nonzero(self.boxes["state"] != FREE))

    # -- engine -------------------------------------------------------------------------------
    def is_queued(self, index: int, lease: int) -> bool:
        """The record's lease is still current and QUEUED (not reclaimed or failed meanwhile)."""
        return int(self.boxes["lease"][index]) == lease and int(self.boxes["state"][index]) == QUEUED

    def cancelled(self, index: int, lease: int) -> bool:
        """The holder asked to cancel, or the lease is gone."""
        return bool(self.boxes["cancel"][index]) or int(self.boxes["lease"][index]) != lease

    def admit(self, index: int, slot: int, step: int, now: float, n_cached: int = 0) -> None:
        """QUEUED -> RUNNING in ``slot``; ``n_cached`` prompt tokens came from the prefix cache."""
        box = self.boxes[index]
        box["slot"], box["t_admitted"], box["step_admitted"] = slot, now, step
        box["n_cached"] = n_cached
        box["state"] = RUNNING

    def move(self, index: int, slot: int) -> None:
        self.boxes["slot"][index] = slot

    def prefill_done(self, index: int, now: float) -> None:
        self.boxes["t_prefill_done"][index] = now

    def publish(self, tokens: list[Published], now: float) -> None:
        """Write every token's data, then its counter, then wake every reader (the rule above)."""
        for i, k, tok, lp in tokens:
            if lp is not None:
                logprob, top_ids, top_lp = lp
                self.logprobs[i, k] = logprob
                self.top_ids[i, k, :len(top_ids)] = top_ids
                self.top_logprobs[i, k, :len(top_lp)] = top_lp
            self.tokens[i, k] = tok
            if k == 0:
                self._t_first_token[i] = now
            self._n_tokens[i] = k + 1
        for p in tokens:
            self.wakeups.wake(p.index)

    def publish_vector(self, index: int, vector: np.ndarray, now: float) -> None:
        """An embedding engine's answer: ``vector`` (float32 ``[n]``, ``n <= max_seq_len``) into
        mailbox ``index``'s ``logprobs`` row, then the counter (``n_tokens = n``; the time of the
        first token is now), then the wake-up. Once per lease: the row is never rewritten while
        the counter covers it.

        Raises:
            ValueError: ``vector`` is longer than a row.
        """
        n = len(vector)
        if n > self.logprobs.shape[1]:
            raise ValueError(f"a vector of {n} values does not fit a mailbox row of {self.logprobs.shape[1]}")
        self.logprobs[index, :n] = vector
        self._t_first_token[index] = now
        self._n_tokens[index] = n
        self.wakeups.wake(index)

    def publish_prompt_logprobs(self, index: int, start: int, logprob: np.ndarray, top_ids: np.ndarray,
                                top_logprobs: np.ndarray) -> None:
        """Prompt entries ``start .. start + m - 1`` of mailbox ``index``: ``logprob`` float32
        ``[m]``, ``top_ids`` int32 ``[m, k]``, ``top_logprobs`` float32 ``[m, k]``, stored from the
        arrays' far end (module doc); then the counter, then the wake-up."""
        m, k = len(logprob), top_ids.shape[1]
        hi = self.tokens.shape[1] - start  # entry start goes to index hi - 1, the next ones below it
        self.logprobs[index, hi - m:hi] = logprob[::-1]
        self.top_ids[index, hi - m:hi, :k] = top_ids[::-1]
        self.top_logprobs[index, hi - m:hi, :k] = top_logprobs[::-1]
        self.boxes["n_prompt_logprobs"][index] = start + m
        self.wakeups.wake(index)

    def finish(self, index: int, lease: int, finish: Finish, error: ErrorCode = ErrorCode.NONE,
               step: int = 0) -> None:
        """QUEUED/RUNNING -> DONE with ``finish`` (and ``error``), then wake the reader. A stale
        ``lease`` (the mailbox was reclaimed) is ignored."""
        box = self.boxes[index]
        if int(box["lease"]) != lease:
            return
        box["finish"], box["error"] = finish, error
        box["t_finished"], box["step_finished"] = time.monotonic(), step
        box["state"] = DONE
        self.wakeups.wake(index)

    # -- supervisor ---------------------------------------------------------------------------
    def reclaim(self, is_alive) -> list[int]:
        """Recover the leases of dead owners (called periodically and on a worker's exit).

        A dead owner's LEASED or DONE mailbox is freed at once; a QUEUED or RUNNING one gets its
        cancel flag, so the engine finishes it and a later call frees it.

        Args:
            is_alive: ``pid -> bool``.
        Returns:
            indices freed by this call.
        """
        mb = self.boxes
        freed = []
        with self.lock:
            for i in np.flatnonzero(mb["state"] != FREE):
                pid = int(mb["owner_pid"][i])
                if pid == 0 or is_alive(pid):
                    continue
                if int(mb["state"][i]) in (LEASED, DONE):
                    mb["owner_pid"][i] = 0
                    mb["state"][i] = FREE
                    freed.append(int(i))
                else:
                    mb["cancel"][i] = 1
        return freed

    def fail(self, lease: Lease, error: ErrorCode) -> None:
        """Finish ``lease``'s mailbox with ``error`` if it is still QUEUED or RUNNING under that
        lease, and wake its reader: its engine is gone (``engine.stream.Stream.check_engine``)."""
        mb = self.boxes
        with self.lock:
            if int(mb["lease"][lease.index]) != lease.number or int(mb["state"][lease.index]) not in (QUEUED, RUNNING):
                return
            mb["error"][lease.index], mb["finish"][lease.index] = error, Finish.ERROR
            mb["state"][lease.index] = DONE
        self.wakeups.wake(lease.index)

    def fail_in_flight(self, error: ErrorCode) -> int:
        """Finish every QUEUED/RUNNING mailbox with ``error`` and wake its reader (the engine
        died or stopped, so no client waits forever). Returns the number failed."""
        mb = self.boxes
        with self.lock:
            failed = [int(i) for i in np.flatnonzero((mb["state"] == QUEUED) | (mb["state"] == RUNNING))]
            for i in failed:
                mb["error"][i], mb["finish"][i] = error, Finish.ERROR
                mb["state"][i] = DONE
        for i in failed:
            self.wakeups.wake(i)
        return len(failed)
