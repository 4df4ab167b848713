"""The errors a request can end with, for every front end.

They are raised once, where the fault is found (the parser, :class:`engine.request.SamplingParams`,
the engine client) and translated once per protocol: HTTP in ``server/errors.py``. The front
end's own refusals (an API key, a permission, a model name) are ``server/api/errors.py``'s. Each carries
what a protocol needs to answer: ``param`` (the request field at fault) and ``code`` (a
machine-readable reason, as in OpenAI's error object).
"""
from __future__ import annotations


class RequestError(Exception):
    """A client mistake. Attributes: ``message``, ``param`` (field at fault or None), ``code``."""

    code: str | None = None

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param
        self.code = code or type(self).code


class InvalidRequest(RequestError, ValueError):
    """A field is missing, of the wrong type or out of range (HTTP 400, gRPC INVALID_ARGUMENT)."""


class PromptTooLong(InvalidRequest):
    """The prompt, or prompt plus ``max_new_tokens``, does not fit one sequence.

    Attributes: ``n_prompt`` (a lower bound when ``at_least``: found before tokenizing),
    ``max_new_tokens`` (None when the prompt alone is too long), ``limit`` (tokens per
    sequence), ``param`` (the request field at fault). ``room``: tokens that must follow the
    prompt (1; 0 for an embedding's input, which may fill the sequence).
    """

    code = "context_length_exceeded"

    def __init__(self, n_prompt: int, limit: int, max_new_tokens: int | None = None, at_least: bool = False,
                 param: str | None = None, room: int = 1):
        self.n_prompt, self.limit, self.max_new_tokens = n_prompt, limit, max_new_tokens
        if max_new_tokens is None and not room:
            msg = f"input has {'at least ' if at_least else ''}{n_prompt} tokens, more than the limit of {limit}"
        elif max_new_tokens is None:
            msg = (f"prompt has {'at least ' if at_least else ''}{n_prompt} tokens, more than the per-sequence "
                   f"limit of "
                   f"{limit - room} prompt tokens ({limit} tokens in all)")
        else:
            msg = (f"prompt ({n_prompt} tokens) + {param or 'max_tokens'} ({max_new_tokens}) = "
                   f"{n_prompt + max_new_tokens} tokens exceeds the per-sequence limit of {limit}")
        super().__init__(msg, param)


class EngineError(RuntimeError):
    """The server could not serve the request (not the client's fault)."""


class Saturated(EngineError):
    """Every mailbox is leased: the server is full. ``retry_after`` is seconds (int >= 1)."""

    message = "server saturated: every request slot and queue place is in use"

    def __init__(self, retry_after: int = 1):
        super().__init__(self.message)
        self.retry_after = retry_after


class EngineUnavailable(EngineError):
    """The engine is loading, died, or is shutting down. ``retry_after`` is seconds."""

    retry_after = 1


class ShuttingDown(EngineUnavailable):
    """The server is draining (SIGTERM): it takes no new request, and a request still running at
    the end of the drain is ended with this."""


class ConstraintFailed(EngineError):
    """A constrained sequence's grammar failed mid-way (nothing it allows was left to sample, or
    the constraint library hit a limit): the sequence ended rather than go on unconstrained
    (HTTP 400 ``constraint_failed``: a grammar with no way on, such as a schema whose every
    instance is infinite, or a regex longer than the library's limits, is the client's to fix).
    ``param``: the request field the grammar came from; None until the front end names it."""

    code = "constraint_failed"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


class DeadlineExceeded(EngineError):
    """The request's deadline passed before it produced any token."""


class ClientDisconnected(EngineError):
    """The watched client connection closed; the request's sequences were cancelled."""


class RateLimited(RequestError):
    """Over the tenant's quota (HTTP 429, gRPC RESOURCE_EXHAUSTED).

    Attributes: ``retry_after_s`` (seconds until the request could be admitted), ``buckets``
    (``{"requests" | "tokens": (limit, remaining, reset seconds)}``, for the ``x-ratelimit-*``
    headers), ``kind`` (``rate`` or ``concurrency``).
    """

    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: float, buckets: dict | None = None, kind: str = "rate"):
        super().__init__(message)
        self.retry_after_s, self.buckets, self.kind = retry_after_s, buckets or {}, kind
