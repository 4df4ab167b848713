"""A request's choices from submission to their last delta (:class:`Generation`): a
:class:`~server.generation.submission.Submission` and one
:class:`~server.generation.choice.ChoiceState` per sequence, read by one output loop
(``engine.stream.follow``); how it went is a :class:`GenerationStats` value for telemetry.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from engine.client import EngineClient
from engine.request import FieldNames, RequestKind, SamplingParams
from engine.stream import Stream, Timings, follow
from server.generation.choice import ChoiceState, ToolParser
from server.generation.request import Choice, Delta, GenerationRequest, ToolCall, Usage
from server.generation.submission import Submission, check_choices
from server.tenancy.ratelimit import RateLimiter
from server.tenancy.tenants import DEFAULT_TENANT, Tenant

if TYPE_CHECKING:  # injected by the front ends; the control plane imports the request schema
    from server.control.accounting import Accounting


@dataclass(frozen=True)
class GenerationStats:
    """How a generation went, read once it is closed (``server/observability/telemetry.py``).

    Attributes:
        usage: its token counts. timings: choice 0's engine timings (None: nothing submitted).
        finish_reasons: each choice's (None: it did not finish). tool_calls: calls per choice.
        first_token_at: ``time.monotonic()`` when the first token of any choice reached the
            front end (None: none did). token_gaps: seconds between consecutive tokens of a
            choice, every choice's. error: what ended the output loop (None: its own end).
    """

    usage: Usage
    timings: Timings | None
    finish_reasons: tuple[str | None, ...]
    tool_calls: tuple[int, ...]
    first_token_at: float | None
    token_gaps: tuple[float, ...]
    error: BaseException | None


class Generation:
    """``n`` sequences for each prompt, read by one output loop. Choice ``p * n + j`` is choice
    ``j`` of prompt ``p`` (OpenAI's numbering).

    Building one only prepares it (checks the number of choices, talks to nothing);
    :meth:`submit` submits it (:meth:`Submission.start`). ``max_tokens`` 0 generates nothing:
    each prompt is still checked, then submitted only to be scored (``echo`` with logprobs: the
    engine's scoring kind, ``max_new_tokens`` 0), and each choice ends at once with ``length``.

    Args:
        pieces: ``token id -> bytes`` each choice's text is read with.
        prompts: token ids of each prompt. prompt_param: the request field they came from.
        req: the request; its ``n``, ``stop``, ``echo``, ``max_tokens``, ``max_tokens_param``,
            ``priority`` and ``deadline_ms`` are read here.
        tenant: who asks. limiter: its rate limits (None: none). accounting: its spend and usage
            (None: not recorded).
        watch_socket: the client connection; when it closes, every choice is cancelled.
        echo_texts: with ``req.echo``, each prompt's text, which starts each of its choices.
        sampling: the engine's settings to submit (with the request's final grammar).
        grammar_param: the request field a grammar's refusal or failure names (None: no grammar).
        new_tool_parser: makes a fresh tool-call parser for one choice (None: no tools).
    Raises:
        InvalidRequest: more choices than the capacity or the tenant's ``max_concurrent``.
    """

    def __init__(self, engine: EngineClient, pieces: list[bytes], prompts: list[list[int]],
                 req: GenerationRequest, prompt_param: str, tenant: Tenant = DEFAULT_TENANT,
                 limiter: RateLimiter | None = None, watch_socket=None, echo_texts: list[str] | None = None, *,
                 sampling: SamplingParams, grammar_param: str | None = None,
                 new_tool_parser: Callable[[], ToolParser] | None = None, accounting: Accounting | None = None):
        self.n_choices = check_choices(engine, len(prompts), req.n, tenant)
        self.req, self.prompts, self.watch_socket = req, prompts, watch_socket
        self.fields = FieldNames(prompt_param, req.max_tokens_param, grammar_param)
        scores = req.echo and sampling.logprobs is not None
        # the one max_tokens 0 rule: the engine's scoring kind with max_new_tokens 0 (prepared so
        # that every prompt is still checked), submitted only when the prompt is to be scored
        generates = req.max_tokens != 0
        self.kind = RequestKind.SCORE if scores or not generates else RequestKind.GENERATE
        self.sampling = sampling if generates else dataclasses.replace(sampling, max_new_tokens=0)
        self.submits = generates or scores
        self.submission = Submission(engine, tenant, limiter, accounting)
        #: The submitted sequences, choice by choice (empty: nothing submitted).
        self.streams: list[Stream] = self.submission.streams
        self.choices = [ChoiceState(k, pieces, req.stop, new_tool_parser() if new_tool_parser else None,
                                    echo_texts[k // req.n] if req.echo else None,
                                    (lambda k=k: self._prompt_entries(k)) if scores else list)
                        for k in range(self.n_choices)]
        #: What ended the output loop (None: its own end, or not run).
        self.error: BaseException | None = None

    @property
    def rate_buckets(self) -> dict:
        """The tenant's buckets at admission, for the answer's ``x-ratelimit-*`` headers."""
        return self.submission.rate_buckets

    def submit(self) -> Generation:
        """Admit the request and submit its sequences (:meth:`Submission.start`; raises as it).
        Returns itself."""
        req = self.req
        self.submission.start(self.prompts, req.n, self.sampling, self.kind, self.fields, req.priority,
                              req.deadline_ms, self.watch_socket, self.submits)
        return self

    def deltas(self, keepalive_s: float | None = None) -> Iterator[Delta | None]:
        """Deltas of every choice as they come; each choice ends with one ``finish_reason``.
        With ``keepalive_s``, None is yielded whenever that long passed without a delta (queued,
        or in a long prefill), so a stream can show it is alive.

        Raises:
            ClientDisconnected: the client left (every choice was cancelled).
            EngineUnavailable: the engine failed meanwhile. ConstraintFailed: a grammar failed.
        """
        if not self.streams:
            yield from (choice.finish("length") for choice in self.choices)
            return
        try:
            for k, tokens in follow(self.streams, self.watch_socket, keepalive_s):
                if self.submission.reservation is not None:
                    self.submission.reservation.renew()
                if k < 0:
                    yield None
                    continue
                self.submission.charge(len(tokens))
                choice, stream = self.choices[k], self.streams[k]
                if choice.ended:
                    continue  # a stop string ended it; its cancellation is being followed
                yield from choice.push(tokens)
                if choice.ended:  # a stop string or the tool parser ended it within these tokens
                    stream.cancel()
                elif stream.finished:
                    yield choice.finish(stream.finish_reason)
        except BaseException as e:  # GeneratorExit too: the reader stopped (a stream's client left)
            self.error = e
            raise
        finally:
            self.close()

    def _prompt_entries(self, k: int) -> list:
        """Choice ``k``'s scored prompt: one entry per prompt token (the first without a
        log-probability)."""
        return self.streams[k].prompt_logprobs(self.prompts[k // self.req.n])

    def collect(self) -> list[Choice]:
        """Run every choice to its end and close. Raises as :meth:`deltas`."""
        choices = [Choice() for _ in range(self.n_choices)]
        texts = [[] for _ in range(self.n_choices)]
        for d in self.deltas():
            choice = choices[d.index]
            texts[d.index].append(d.text)
            choice.tokens.extend(d.tokens)
            choice.prompt_entries += len(d.tokens) if d.echo else 0
            choice.finish_reason = d.finish_reason or choice.finish_reason
            for c in d.tool_calls:  # the same pieces a stream sends, joined
                if c.id is not None:
                    choice.tool_calls.append(ToolCall(c.id, c.name, ""))
                choice.tool_calls[c.index].arguments += c.arguments
        for choice, text in zip(choices, texts):
            choice.text = "".join(text)
        return choices

    def close(self) -> None:
        """Cancel every unfinished choice, then wait for each and release it, charge what is
        left to charge, and settle the spend to the usage (idempotent)."""
        self.submission.close()
        reservation = self.submission.reservation
        if reservation is not None and not reservation.done:
            usage = self.usage()
            reservation.settle(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)

    def usage(self) -> Usage:
        """Prompt tokens counted once per prompt, and as cached those the prefix cache gave every
        choice of their prompt (the smallest reuse among a prompt's ``n`` choices). Read after
        :meth:`close`."""
        n = self.req.n
        cached = sum(min(s.n_cached for s in self.streams[i:i + n]) for i in range(0, len(self.streams), n))
        return Usage(sum(len(p) for p in self.prompts), sum(c.completion_tokens for c in self.choices), cached)

    def timings(self, choice: int = 0) -> Timings:
        """The engine's timings of one choice's sequence (choice 0 by default)."""
        return self.streams[choice].timings()

    def stats(self) -> GenerationStats:
        """How it went (read after :meth:`close`)."""
        firsts = [c.first_token_at for c in self.choices if c.first_token_at is not None]
        return GenerationStats(self.usage(), self.timings() if self.streams else None,
                               tuple(c.finish_reason for c in self.choices), tuple(c.tool_calls for c in self.choices),
                               min(firsts, default=None), tuple(g for c in self.choices for g in c.token_gaps),
                               self.error)
