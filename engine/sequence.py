"""One sequence: a request's prompt, sampling state and progress inside the engine."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from engine.request import EngineRequest

_order = itertools.count()


@dataclass(eq=False)
class Sequence:
    """A request as the engine sees it (token ids only).

    Life cycle (llama.cpp's server calls these slot states): waiting -> prefill (prompt chunks
    fed, ``n_prefilled < len(prompt)``) -> decode (one token per step) -> retired.

    Attributes:
        mailbox, lease: where results go; a lease mismatch means the request is stale.
        request: what was asked (prompt, sampling settings, priority, deadline, tenant).
        arrival: ``time.monotonic()`` seconds when the engine ingested it.
        slot: KV slot / llama ``seq_id`` while running, -1 otherwise.
        n_prefilled: prompt tokens already in the KV cache.
        last_token: token to feed at the next decode step.
    """

    mailbox: int
    lease: int
    request: EngineRequest
    arrival: float
    order: int = field(default_factory=lambda: next(_order))
    slot: int = -1
    n_prefilled: int = 0
    n_generated: int = 0
    last_token: int = -1
    sampler: object = None

    @property
    def prompt(self) -> np.ndarray:
        return self.request.prompt

    @property
    def prefilling(self) -> bool:
        return self.n_prefilled < len(self.request.prompt)
