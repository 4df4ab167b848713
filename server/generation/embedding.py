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
from engine.errors import InvalidRequest, PromptTooLong, Saturated
from engine.llama.tokenizer import Tokenizer
from engine.request import FieldNames, RequestKind, SamplingParams
from server.generation.request import EmbeddingRequest
from server.generation.submission import Submission
from server.tenancy.ratelimit import RateLimiter
from server.tenancy.tenants import DEFAULT_TENANT, Tenant

if TYPE_CHECKING:  # injected by the front ends; the control plane imports the request schema
    from server.control.accounting import Accounting


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

    def embed(self, req: EmbeddingRequest, tenant: Tenant = DEFAULT_TENANT, deadline_ms: float | None = None,
              watch_socket: socket.socket | None = None) -> Embeddings:
        """Every input's vector, in order.

        Raises:
            InvalidRequest: ``dimensions`` other than the model's; a token id outside the
                vocabulary (``input[i]``). PromptTooLong: an input over the model's context
                without ``truncate_prompt_tokens`` (``input[i]``). As ``Submission.start`` and
                ``Stream.embedding`` otherwise (RateLimited, Saturated, EngineUnavailable...).
        """
        dims = self.engine.n_embd or self.dimensions  # the engine's, once it loaded (llama_model_n_embd_out)
        if req.dimensions is not None and req.dimensions != dims:
            raise InvalidRequest(f"dimensions: this model's vectors have {dims} dimensions and it cannot "
                                 "shorten them", "dimensions")
        ids = [self._ids(x, req.truncate, self._param(req, i)) for i, x in enumerate(req.inputs)]
        sub = Submission(self.engine, tenant, self.limiter, self.accounting)
        sub.start(ids, 1, SamplingParams(max_new_tokens=0), RequestKind.EMBED, FieldNames(prompt="input"),
                  req.priority, deadline_ms, watch_socket, window=self.engine.max_slots)
        vectors = np.empty((len(ids), dims), np.float32)
        try:
            for i in range(len(ids)):
                vectors[i] = sub.streams[i].embedding()  # which releases its mailbox
                self._submit_more(sub, i + 1)
        except BaseException:
            if sub.reservation is not None:  # nothing answered, nothing spent
                sub.reservation.release()
            raise
        finally:
            sub.close()
        tokens = sum(len(x) for x in ids)
        if sub.reservation is not None:
            sub.reservation.settle(tokens, 0, 0)
        return Embeddings(vectors, tokens)

    @staticmethod
    def _submit_more(sub: Submission, read: int) -> None:
        """Submit pending inputs while mailboxes are free: one for each read; when every mailbox
        is taken (other requests'), later, as long as one of ours is still in flight."""
        while sub.pending and len(sub.streams) - read < sub.engine.max_slots:
            try:
                sub.submit_next()
            except Saturated:
                if len(sub.streams) > read:  # ours free one soon: submit then
                    return
                raise

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
