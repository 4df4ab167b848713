"""One sequence: a request's prompt, sampling state and progress inside the engine."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

_order = itertools.count()


@dataclass(eq=False)
class Sequence:
    """A request as the engine sees it (token ids only).

    Life cycle (llama.cpp server calls these slot states): waiting -> prefill (prompt chunks
    fed, ``n_prefilled < len(prompt)``) -> decode (one token per step) -> retired.

    Attributes:
        mailbox, generation: where results go; a generation mismatch means the request is stale.
        prompt: int32 token ids ``[n_prompt]``.
        deadline: ``time.monotonic()`` seconds, 0 for none.
        slot: KV slot / llama ``seq_id`` while running, -1 otherwise.
        n_prefilled: prompt tokens already in the KV cache.
        last_token: token to feed at the next decode step.
    """

    mailbox: int
    generation: int
    tenant: int
    weight: float
    priority: int
    deadline: float
    arrival: float
    prompt: np.ndarray
    max_new_tokens: int
    ignore_eos: bool
    n_logprobs: int
    stop_ids: frozenset
    sampling: dict
    order: int = field(default_factory=lambda: next(_order))
    slot: int = -1
    n_prefilled: int = 0
    n_generated: int = 0
    last_token: int = -1
    sampler: object = None

    @classmethod
    def from_record(cls, rec: np.void, now: float) -> "Sequence":
        """Build from a request-ring record (see ``shm.layout.Layout.record_dtype``)."""
        n = int(rec["n_prompt"])
        return cls(
            mailbox=int(rec["mailbox"]), generation=int(rec["generation"]),
            tenant=int(rec["tenant"]), weight=max(float(rec["weight"]), 1e-6),
            priority=int(rec["priority"]), deadline=float(rec["deadline"]), arrival=now,
            prompt=np.array(rec["prompt"][:n], dtype=np.int32),
            max_new_tokens=int(rec["max_new_tokens"]), ignore_eos=bool(rec["ignore_eos"]),
            n_logprobs=int(rec["n_logprobs"]),
            stop_ids=frozenset(int(t) for t in rec["stop_ids"][:int(rec["n_stop"])]),
            sampling={k: rec[k].item() for k in (
                "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "presence_penalty",
                "frequency_penalty", "penalty_last_n", "seed")},
        )

    @property
    def prefilling(self) -> bool:
        return self.n_prefilled < len(self.prompt)
