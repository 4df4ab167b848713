"""The one module front ends use to talk to the engine (over :mod:`shm`).

Usage::

    client = EngineClient.attach(transport_name)
    stream = client.submit(prompt_ids, SamplingParams(max_new_tokens=32, temperature=0))
    for token in stream:          # Token(id, logprob, top) as the engine publishes them
        ...
    stream.finish_reason          # "stop" | "length" | "deadline" | "cancelled"

A stream must be consumed or closed (``with client.submit(...) as stream``): closing an
unfinished stream cancels the sequence, waits for the engine to retire it (one step) and
returns the mailbox.
"""
from __future__ import annotations

import math
import random
import select
import socket
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence as Seq

import numpy as np

from shm.layout import (DONE, ENGINE_READY, ERR_BAD_REQUEST, ERR_DECODE, ERR_ENGINE_DIED,
                        FINISH_DEADLINE, FINISH_ERROR, FINISH_REASONS, MAX_STOP_IDS,
                        MAX_TOP_LOGPROBS, PRIORITIES, QUEUED)
from shm.mailbox import Mailboxes
from shm.ring import RequestRing
from shm.transport import Transport


_ERROR_MESSAGES = {ERR_ENGINE_DIED: "engine died while serving the request",
                   ERR_DECODE: "engine failed to decode the request's batch"}


class EngineError(RuntimeError):
    """Base of the errors the engine client raises."""


class Saturated(EngineError):
    """Every mailbox is leased: the server is full. ``retry_after`` is seconds (int >= 1)."""

    def __init__(self, retry_after: int = 1):
        super().__init__("server saturated: every request slot and queue place is in use")
        self.retry_after = retry_after


class EngineUnavailable(EngineError):
    """The engine is loading, died, or is shutting down."""


class DeadlineExceeded(EngineError):
    """The request's deadline passed before it produced any token."""


class ClientDisconnected(EngineError):
    """The watched client socket closed; the sequence was cancelled."""


class PromptTooLong(ValueError):
    """The prompt, or prompt plus ``max_new_tokens``, does not fit one sequence.

    Attributes: ``n_prompt``, ``max_new_tokens`` (may be None), ``limit`` (tokens).
    """

    def __init__(self, n_prompt: int, limit: int, max_new_tokens: int | None = None):
        self.n_prompt, self.limit, self.max_new_tokens = n_prompt, limit, max_new_tokens
        if max_new_tokens is None:
            msg = (f"prompt has {n_prompt} tokens, more than the per-sequence limit of "
                   f"{limit - 1} prompt tokens ({limit} tokens in all)")
        else:
            msg = (f"prompt ({n_prompt} tokens) + max_tokens ({max_new_tokens}) = "
                   f"{n_prompt + max_new_tokens} tokens exceeds the per-sequence limit of {limit}")
        super().__init__(msg)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (llama.cpp sampler chain semantics).

    Attributes:
        max_new_tokens: generated tokens at most; None = up to the sequence limit.
        temperature: 0 = greedy. top_k: 0 = off. top_p, min_p: 1.0 / 0.0 = off.
        repeat_penalty (1 = off), presence_penalty, frequency_penalty (0 = off) over the last
        ``penalty_last_n`` tokens. seed: None = random.
        stop_ids: extra token ids that end the sequence (EOS/EOG always do unless ignore_eos).
        ignore_eos: never sample end-of-generation tokens (fixed-length benchmarks).
        logprobs: None, or k in 0..20: return the sampled token's log-probability and the top-k.
    """

    max_new_tokens: int | None = None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}")
        if len(self.stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")


@dataclass(frozen=True)
class Token:
    """One generated token: id, its log-probability and ``top`` ``[(id, logprob)]`` (if asked)."""

    id: int
    logprob: float | None = None
    top: tuple = ()


@dataclass
class Timings:
    """``time.monotonic()`` seconds from the mailbox (0 where not reached)."""

    queued: float = 0.0
    admitted: float = 0.0
    prefill_done: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    step_admitted: int = 0
    step_finished: int = 0


class EngineClient:
    """Submit token ids to the engine and read results; safe to share between threads.

    Args:
        transport: an attached or created :class:`shm.Transport`.
    """

    def __init__(self, transport: Transport):
        self.t = transport
        self.max_seq_len = transport.layout.max_seq_len
        self.max_slots = transport.layout.max_slots
        self._mailboxes = Mailboxes(transport)
        self._ring = RequestRing(transport)

    @classmethod
    def attach(cls, name: str) -> "EngineClient":
        return cls(Transport.attach(name))

    def ready(self, stall_s: float = 30.0) -> bool:
        """True when the engine has loaded the model and has stepped within ``stall_s``
        seconds (it steps at least every 0.5 s, even when idle)."""
        c = self.t.control[0]
        return int(c["engine_state"]) == ENGINE_READY and time.monotonic() - float(c["heartbeat"]) < stall_s

    def check_fits(self, n_prompt: int, max_new_tokens: int | None) -> int:
        """Validate lengths before anything reaches the engine.

        Returns:
            the effective ``max_new_tokens`` (the rest of the sequence when None).
        Raises:
            ValueError: empty prompt. PromptTooLong: it does not fit.
        """
        if n_prompt < 1:
            raise ValueError("prompt is empty")
        if n_prompt > self.max_seq_len - 1:
            raise PromptTooLong(n_prompt, self.max_seq_len)
        if max_new_tokens is None:
            return self.max_seq_len - n_prompt
        if n_prompt + max_new_tokens > self.max_seq_len:
            raise PromptTooLong(n_prompt, self.max_seq_len, max_new_tokens)
        return max_new_tokens

    def submit(self, prompt_ids: Seq[int], params: SamplingParams, *, priority: str = "normal",
               deadline_ms: float | None = None, tenant: int = 0, weight: float = 1.0,
               watch_socket: socket.socket | None = None) -> "Stream":
        """Queue one sequence.

        Args:
            prompt_ids: token ids, 1..max_seq_len-1 of them.
            priority: ``high`` | ``normal`` | ``low``.
            deadline_ms: milliseconds from now after which the engine gives up; None = none.
            tenant, weight: fair-share identity and weight (VTC).
            watch_socket: the client's connection; if it closes, the sequence is cancelled.
        Raises:
            ValueError / PromptTooLong: bad request. Saturated: no free mailbox.
            EngineUnavailable: the engine is not ready. ClientDisconnected: ``watch_socket`` is
            already closed.
        """
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}")
        if deadline_ms is not None and not (deadline_ms > 0 and math.isfinite(deadline_ms)):
            raise ValueError("deadline_ms must be a positive number")
        max_new = self.check_fits(len(prompt_ids), params.max_new_tokens)
        if watch_socket is not None and _hung_up(watch_socket):
            raise ClientDisconnected("client closed the connection before its request was queued")
        if not self.ready():
            raise EngineUnavailable("engine is not ready")
        lease = self._mailboxes.lease()
        if lease is None:
            raise Saturated(retry_after=1)
        index, generation = lease
        now = time.monotonic()
        seed = params.seed if params.seed is not None else random.getrandbits(32)

        def fill(rec):
            rec["mailbox"], rec["generation"] = index, generation
            rec["tenant"], rec["weight"] = tenant, weight
            rec["priority"] = PRIORITIES.index(priority)
            rec["ignore_eos"] = params.ignore_eos
            rec["n_logprobs"] = -1 if params.logprobs is None else params.logprobs
            rec["n_prompt"], rec["max_new_tokens"] = len(prompt_ids), max_new
            rec["deadline"] = 0.0 if deadline_ms is None else now + deadline_ms / 1000.0
            for name in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                         "presence_penalty", "frequency_penalty", "penalty_last_n"):
                rec[name] = getattr(params, name)
            rec["seed"] = seed & 0xFFFFFFFF
            rec["n_stop"] = len(params.stop_ids)
            rec["stop_ids"][:len(params.stop_ids)] = params.stop_ids
            rec["prompt"][:len(prompt_ids)] = np.asarray(prompt_ids, dtype=np.int32)

        box = self.t.mailboxes[index]
        box["n_prompt"], box["t_queued"] = len(prompt_ids), now
        box["state"] = QUEUED
        try:
            self._ring.push(fill)
        except BaseException:
            self._mailboxes.release(index, generation)
            raise
        return Stream(self, index, generation, len(prompt_ids), params.logprobs, watch_socket)

    @property
    def capacity(self) -> int:
        """Sequences that can be in flight at once (running plus queued): the mailboxes."""
        return self.t.layout.n_mailboxes

    def snapshot(self) -> tuple[int, list[int], list[int]]:
        """A consistent ``(step, slot -> mailbox (-1 free), slot -> highest KV position (-1
        none))`` as of the engine's last completed step (see the control block's seqlock)."""
        c = self.t.control[0]
        while True:
            step = int(c["step"])
            if not c["publishing"]:
                slots, kv = c["slot_mailbox"].tolist(), c["slot_kv_pos_max"].tolist()
                if not c["publishing"] and int(c["step"]) == step:
                    return step, slots, kv
            time.sleep(0)

    def slot_mailboxes(self) -> list[int]:
        """Mailbox index held by each KV slot (-1: free), as of the engine's last step."""
        return self.snapshot()[1]

    def step(self) -> int:
        """The engine's last completed step number."""
        return int(self.t.control["step"][0])

    def kv_pos_max(self) -> list[int]:
        """Highest KV position of each slot (-1: no cells), as of the engine's last step."""
        return self.snapshot()[2]

    def mailboxes_in_use(self) -> int:
        return self._mailboxes.in_use()

    def close(self) -> None:
        self.t.close()


@dataclass
class Stream:
    """Tokens of one submitted sequence, in order, as they arrive. Iterate, then read
    ``finish_reason``, ``n_prompt``, ``n_generated`` and ``timings()``."""

    client: EngineClient
    index: int
    generation: int
    n_prompt: int
    n_logprobs: int | None
    watch_socket: socket.socket | None = None
    finish_reason: str | None = None
    n_generated: int = 0
    _released: bool = field(default=False, repr=False)
    _timings: Timings | None = field(default=None, repr=False)

    def __iter__(self) -> Iterator[Token]:
        t, i = self.client.t, self.index
        box = t.mailboxes[i]
        watch_fd = self.watch_socket.fileno() if self.watch_socket is not None else None
        try:
            while True:
                t.bells.drain(i)
                done = int(box["state"]) == DONE  # state before count: DONE implies final count
                n = int(box["n_tokens"])
                while self.n_generated < n:
                    yield self._token(self.n_generated)
                    self.n_generated += 1
                if done:
                    self._finish(box)
                    return
                ready = t.bells.wait(i, timeout=1.0, extra_fd=watch_fd)
                if watch_fd is not None and watch_fd in ready:
                    # POLLRDHUP: the client closed (or shut down) its side. Even if it pipelined
                    # another request first, nobody is left to read this answer.
                    self.cancel()
                    raise ClientDisconnected("client closed the connection")
        finally:
            self.close()

    def _token(self, k: int) -> Token:
        t, i = self.client.t, self.index
        tok = int(t.tokens[i, k])
        if self.n_logprobs is None:
            return Token(tok)
        top = tuple(zip(t.top_ids[i, k, :self.n_logprobs].tolist(),
                        t.top_logprobs[i, k, :self.n_logprobs].tolist()))
        return Token(tok, float(t.logprobs[i, k]), top)

    def _finish(self, box) -> None:
        finish = int(box["finish"])
        if finish == FINISH_ERROR:
            error = int(box["error"])
            if error == ERR_BAD_REQUEST:
                raise ValueError("engine rejected the request")
            raise EngineUnavailable(_ERROR_MESSAGES.get(error, "engine stopped"))
        if finish == FINISH_DEADLINE and self.n_generated == 0:
            self.finish_reason = "deadline"
            raise DeadlineExceeded("deadline passed before the first token")
        self.finish_reason = FINISH_REASONS[finish]

    def timings(self) -> Timings:
        """Timestamps of this request (kept from the mailbox when the stream closed)."""
        if self._timings is not None:
            return self._timings
        box = self.client.t.mailboxes[self.index]
        return Timings(float(box["t_queued"]), float(box["t_admitted"]),
                       float(box["t_prefill_done"]), float(box["t_first_token"]),
                       float(box["t_finished"]), int(box["step_admitted"]),
                       int(box["step_finished"]))

    def cancel(self) -> None:
        """Ask the engine to stop this sequence (it retires it within one step)."""
        t = self.client.t
        box = t.mailboxes[self.index]
        with t.lock:  # leases take this lock too: a mailbox leased again is never cancelled
            if self._released or int(box["generation"]) != self.generation:
                return
            box["cancel"] = 1
        t.bells.ring(t.bells.ENGINE)

    def close(self, timeout: float = 30.0) -> None:
        """Cancel if unfinished, wait until the engine retired it, and return the mailbox."""
        if self._released:
            return
        t, i = self.client.t, self.index
        box = t.mailboxes[i]
        if int(box["state"]) != DONE:
            self.cancel()
            end = time.monotonic() + timeout
            while int(box["state"]) != DONE and time.monotonic() < end:
                t.bells.wait(i, timeout=0.1)
                t.bells.drain(i)
        self._timings = self.timings()  # the mailbox may be leased again right after release
        self._released = True
        Mailboxes(t).release(i, self.generation)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _hung_up(sock: socket.socket) -> bool:
    """True if the client has already closed its side (a request read from a pipeline after the
    client left must not be decoded)."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLRDHUP)
    return bool(poller.poll(0))
