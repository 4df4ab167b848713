"""Embeddings, front-end-neutral (``POST /v1/embeddings`` and gRPC ``Embed``): each input
tokenized as llama-server does (``add_special`` and special-token text parsed:
``tools/server``'s ``tokenize_input_prompts``), checked, admitted against the tenant's quota,
and sent to the model's embedding engine one sequence per input, at most ``max_slots`` of a
request in flight at once (the others follow as those finish, so a request of 2,048 inputs
passes through an engine of 80 mailboxes); the engine batches what every request has in flight
into its decodes (``engine/embed_core.py``) and answers unit vectors.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine.client import EngineClient
from engine.errors import ClientDisconnected, InvalidRequest, PromptTooLong, RateLimited, Saturated
from engine.llama.tokenizer import Tokenizer
from engine.request import FieldNames, RequestKind, SamplingParams
from server.generation.generation import GenerationStats
from server.generation.request import EmbeddingRequest, Usage
from server.generation.submission import Submission
from server.tenancy.ratelimit import RateLimiter
from server.tenancy.tenants import DEFAULT_TENANT, Tenant

if TYPE_CHECKING:  # injected by the front ends; the control plane imports the request schema
    from server.control.accounting import Accounting


def window(engine: EngineClient, tenant: Tenant) -> int:
    """Inputs of one request in flight at once: the engine's batch of sequences, within the
    tenant's ``max_concurrent`` (its sequences in flight on this node)."""
    return min(engine.max_slots, tenant.max_concurrent or engine.max_slots)


@dataclass(frozen=True)
class Embeddings:
    """The answer: one float32 unit vector per input (``[n_inputs, dimensions]``), and the
    input tokens used (OpenAI's ``usage.prompt_tokens``)."""

    vectors: np.ndarray
    prompt_tokens: int


class Embedder:
    """Embeds inputs with one embedding model.

    Args:
        engine: its engine's client. tokenizer: its vocabulary. dimensions: its vectors'
        length as its GGUF says (``embedding_length``), until the engine says it
        (``EngineClient.n_embd``). limiter, accounting: as :class:`Generator`'s.
    """

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, dimensions: int,
                 limiter: RateLimiter | None = None, accounting: "Accounting | None" = None):
        self.engine, self.tokenizer, self.dimensions = engine, tokenizer, dimensions
        self.limiter, self.accounting = limiter, accounting

    def start(self, req: EmbeddingRequest, tenant: Tenant = DEFAULT_TENANT, deadline_ms: float | None = None,
              watch_socket: socket.socket | None = None) -> "EmbeddingRun":
        """Check every input, admit the request, and submit its first inputs
        (:class:`EmbeddingRun`; its :meth:`~EmbeddingRun.result` reads them and submits the rest).

        Raises:
            InvalidRequest: ``dimensions`` other than the model's; a token id outside the
                vocabulary (``input[i]``). PromptTooLong: an input over the model's context
                without ``truncate_prompt_tokens`` (``input[i]``). As ``Submission.start``
                otherwise (RateLimited, Saturated, EngineUnavailable...).
        """
        dims = self.engine.n_embd or self.dimensions  # the engine's, once it loaded (llama_model_n_embd_out)
        if req.dimensions is not None and req.dimensions != dims:
            raise InvalidRequest(f"dimensions: this model's vectors have {dims} dimensions and it cannot "
                                 "shorten them", "dimensions")
        ids = [self._ids(x, req.truncate, self._param(req, i)) for i, x in enumerate(req.inputs)]
        sub = Submission(self.engine, tenant, self.limiter, self.accounting)
        inputs_at_once = window(self.engine, tenant)
        sub.start(ids, 1, SamplingParams(max_new_tokens=0), RequestKind.EMBED, FieldNames(prompt="input"),
                  req.priority, deadline_ms, watch_socket, window=inputs_at_once)
        return EmbeddingRun(sub, sum(len(x) for x in ids), dims, inputs_at_once)

    def _ids(self, value: str | tuple[int, ...], truncate: int | None, param: str) -> list[int]:
        """One input's tokens, checked against the vocabulary and the context (an input may fill
        the model's ``max_seq_len``), truncated from the start if asked."""
        longest = self.engine.max_seq_len
        if isinstance(value, str):
            at_least = len(value) // self.tokenizer.max_piece_bytes
            if truncate is None and at_least > longest:  # refused before tokenizing
                raise PromptTooLong(at_least, longest, at_least=True, param=param, room=0)
            ids = self.tokenizer.encode(value, special=True, add_special=True)
        else:
            ids = list(value)
            outside = next((t for t in ids if t >= self.tokenizer.n_vocab), None)
            if outside is not None:
                raise InvalidRequest(f"{param} holds token id {outside}, outside this model's vocabulary "
                                     f"(0..{self.tokenizer.n_vocab - 1})", param)
        if truncate is not None:
            if truncate > longest:
                raise InvalidRequest(f"truncate_prompt_tokens must be at most {longest} (the model's context), or -1",
                                     "truncate_prompt_tokens")
            ids = ids[-(longest if truncate == -1 else truncate):]
        if len(ids) > longest:
            raise PromptTooLong(len(ids), longest, param=param, room=0)
        return ids

    @staticmethod
    def _param(req: EmbeddingRequest, i: int) -> str:
        return "input" if len(req.inputs) == 1 else f"input[{i}]"


class EmbeddingRun:
    """One request's inputs on their way through the engine: the first window submitted by
    :meth:`Embedder.start`, the rest as those finish (:meth:`result`). :meth:`cancel` (a gRPC
    call that ended, from another thread) cancels what runs and submits nothing more.

    Args:
        sub: the admitted submission (its ``pending`` inputs not submitted yet). tokens: the
            inputs' tokens together. dims: the vectors' length. window: inputs in flight at most.
    """

    def __init__(self, sub: Submission, tokens: int, dims: int, window: int):
        self.sub, self.tokens, self.dims, self.window = sub, tokens, dims, window
        self.cancelled = False
        self.finished = False

    @property
    def streams(self):
        return self.sub.streams

    @property
    def rate_buckets(self) -> dict:
        """The tenant's buckets at admission, for the ``x-ratelimit-*`` headers (as a generation's)."""
        return self.sub.rate_buckets

    def result(self) -> Embeddings:
        """Every input's vector, in order; the spend settled to the tokens embedded, or given
        back when the request fails.

        Raises:
            ClientDisconnected: cancelled (:meth:`cancel`, the client's socket). As
            ``Stream.embedding`` and ``EngineClient.submit`` otherwise.
        """
        sub = self.sub
        n = len(sub.streams) + len(sub.pending)
        vectors = np.empty((n, self.dims), np.float32)
        try:
            for i in range(n):
                vectors[i] = sub.streams[i].embedding()  # which releases its mailbox
                self._submit_more(i + 1)
        except BaseException:
            if sub.reservation is not None:  # nothing answered, nothing spent
                sub.reservation.release()
            raise
        finally:
            sub.close()
        if sub.reservation is not None:
            sub.reservation.settle(self.tokens, 0, 0)
        self.finished = True
        return Embeddings(vectors, self.tokens)

    def cancel(self) -> None:
        """Stop: cancel every unfinished input, submit no more (a gRPC call's end; idempotent)."""
        self.cancelled = True
        for stream in list(self.sub.streams):
            stream.cancel()

    def _submit_more(self, read: int) -> None:
        """Submit pending inputs while this request has fewer than its window in flight; when
        every mailbox is taken (other requests'), or the tenant is at its ``max_concurrent``,
        later, as long as one of ours is still in flight."""
        sub = self.sub
        while sub.pending and len(sub.streams) - read < self.window:
            if self.cancelled:
                raise ClientDisconnected("the embedding request was cancelled")
            try:
                sub.submit_next()
            except (Saturated, RateLimited) as e:
                if isinstance(e, RateLimited) and e.kind != "concurrency":
                    raise
                if len(sub.streams) > read:  # ours free one soon: submit then
                    return
                raise

    def stats(self) -> GenerationStats:
        """How it went, for the request's log line and metrics (``server/observability/telemetry.py``):
        its input tokens, and ``stop`` once every vector was read."""
        return GenerationStats(usage=Usage(prompt_tokens=self.tokens), timings=None,
                               finish_reasons=("stop" if self.finished else None,), tool_calls=(0,),
                               first_token_at=None, token_gaps=(), error=None)
