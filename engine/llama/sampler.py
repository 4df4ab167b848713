"""Per-sequence sampling: llama.cpp's sampler chain and an optional constraint kept apart from it
(log-probabilities are :mod:`engine.llama.logprobs`).

The shape is llama.cpp's ``common_sampler`` (common/sampling.cpp): a chain of samplers plus an
optional grammar that is not in the chain. The chain picks a token; the constraint checks that
one token first, and only when it rejects it does the chain pick again, among the tokens the
constraint allows only (the same choice as over the whole vocabulary with every other logit at
``-inf``, since those have probability 0 in every sampler of the chain, but over a few entries
instead of the whole vocabulary; 16 constrained streams ran at 0.92 of the speed of 16 free
ones, bench/structured.py). A sequence without a constraint takes llama.cpp's own
``llama_sampler_sample`` (apply and accept in C): unconstrained sequences pay nothing.

Greedy sampling with nothing but bans (temperature 0, no penalties, no ``logit_bias`` other than
the banned tokens' ``-inf``: what ``ignore_eos`` adds) needs no chain: its choice is llama.cpp's
greedy sampler's (the first of the highest logits, ``llama_sampler_greedy_apply``) over logits
where the banned are ``-inf`` (``llama_sampler_logit_bias_apply``), i.e. numpy's ``argmax``, which
also takes the first. That is 6 µs a row here against the chain's 60 µs (which fills a
49,152-entry candidate array first): a 16-row decode step samples in 0.1 ms, not 1 ms.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Protocol

import llama_cpp
import numpy as np

from engine.request import SamplingParams

#: Picks a constraint may refuse after its allowed set gave them (:meth:`Sampler.sample`); the
#: last pick stands after these.
RECHECKS = 8
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])  # llama_token_data


@functools.cache
def _candidates(n_vocab: int) -> tuple[ctypes.Array, np.ndarray, np.ndarray]:
    """The ``llama_token_data [n_vocab]`` array a chain picks from on the constrained path, as
    ctypes and numpy views, and the token ids ``0 .. n_vocab - 1``: one for every sampler of a
    vocabulary size, not one per sequence (3 MiB each for Gemma 3's 262,144 tokens), since the
    engine samples on its one loop thread and a pick fills the array before it reads it."""
    buffer = (llama_cpp.llama_token_data * n_vocab)()
    return buffer, np.frombuffer(buffer, _TOKEN_DATA), np.arange(n_vocab, dtype=np.int32)


class Constraint(Protocol):
    """What a sequence may generate next (a grammar, a JSON schema's automaton...).

    The engine calls :meth:`allows` on the token the chain picked, :meth:`allowed` only when that
    token was refused, then :meth:`accept` on the token finally chosen, and reads ``error`` and
    ``complete`` after it: a constraint with an ``error`` (str, "" when none) ends its sequence
    with an error, never unconstrained; a ``complete`` one (bool) ends it with ``stop``.
    :class:`engine.llama.grammar.GrammarConstraint` is the grammar one (llguidance);
    :class:`AllowAll` is the no-op one.
    """

    error: str
    complete: bool

    def allows(self, token: int) -> bool:
        """Whether ``token`` may come next."""

    def allowed(self, excluded: np.ndarray | None = None) -> np.ndarray:
        """The token ids that may come next, none of ``excluded`` (int32 ids, the sampler's bans;
        None: none): int32 ``[k]``, ascending."""

    def accept(self, token: int) -> None:
        """``token`` was generated: advance."""

    def free(self) -> None:
        """Release what the constraint holds."""


class AllowAll:
    """The constraint that allows every token (no-op; tests check the constrained path with it)."""

    error, complete = "", False

    def allows(self, token: int) -> bool:
        return True

    def allowed(self, excluded: np.ndarray | None = None) -> np.ndarray:
        raise AssertionError("AllowAll refuses nothing: never asked")

    def accept(self, token: int) -> None:
        pass

    def free(self) -> None:
        pass


class Sampler:
    """A ``llama_sampler`` chain built from one request's settings, and its constraint.

    Order follows llama.cpp's common sampler: logit bias (the request's ``logit_bias``, and
    ``-inf`` on ``banned``), penalties, top-k, top-p, min-p, temperature, then ``dist`` (seeded);
    temperature 0 is ``greedy``, and with nothing but bans no chain at all (``greedy`` True: the
    argmax path, module doc). Penalties see the prompt: its tokens are accepted into the chain
    first, as llama.cpp's server does; a constraint never sees them.

    Args:
        n_vocab: the model's vocabulary size.
        sampling: the request's settings; ``seed`` None seeds randomly (``LLAMA_DEFAULT_SEED``).
        banned: token ids never to sample (the EOG tokens when ignore_eos); a ``logit_bias`` of
            -100 bans its token too (OpenAI's "a ban"), also where a constraint allows only it.
        prompt: int32 token ids ``[n_prompt]``.
        constraint: what the sequence may generate (None: anything, the fast path).
    """

    def __init__(self, n_vocab: int, sampling: SamplingParams, banned: frozenset, prompt: np.ndarray,
                 constraint: Constraint | None = None):
        L = llama_cpp
        self.n_vocab, self.constraint = n_vocab, constraint
        # Never picked, even where the constraint allows nothing else (the constraint then fails):
        # a grammar that admits one text allows only its canonical tokens (llguidance), so a
        # -100 on one of them was emitted anyway.
        self._banned = np.array(sorted({*banned, *(t for t, b in sampling.logit_bias if b <= -100)}), np.int32)
        p = sampling
        penalized = p.repeat_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        self.greedy = p.temperature <= 0.0 and not penalized and not p.logit_bias  # the argmax path (module doc)
        self.chain = None
        if self.greedy:
            return
        self.chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        add = lambda s: L.llama_sampler_chain_add(self.chain, s)  # noqa: E731
        biases = [(t, float("-inf")) for t in sorted(banned)] + list(sampling.logit_bias)
        if biases:
            bias = (L.llama_logit_bias * len(biases))(*[L.llama_logit_bias(t, b) for t, b in biases])
            add(L.llama_sampler_init_logit_bias(n_vocab, len(biases), bias))
        if penalized:
            add(L.llama_sampler_init_penalties(n_vocab, p.penalty_last_n, p.repeat_penalty,
                                               p.frequency_penalty, p.presence_penalty))
        if p.temperature <= 0.0:
            add(L.llama_sampler_init_greedy())
        else:
            if p.top_k > 0:
                add(L.llama_sampler_init_top_k(p.top_k))
            if p.top_p < 1.0:
                add(L.llama_sampler_init_top_p(p.top_p, 1))
            if p.min_p > 0.0:
                add(L.llama_sampler_init_min_p(p.min_p, 1))
            add(L.llama_sampler_init_temp(p.temperature))
            add(L.llama_sampler_init_dist(L.LLAMA_DEFAULT_SEED if p.seed is None else p.seed))
        if penalized:
            for tok in prompt.tolist():
                L.llama_sampler_accept(self.chain, tok)

    def sample(self, ctx, row: int) -> int:
        """Sample from batch row ``row``'s logits; the token is accepted into the chain (where
        there is one: the argmax path has none) and the constraint."""
        if self.constraint is None and not self.greedy:
            return llama_cpp.llama_sampler_sample(self.chain, ctx, row)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, row), shape=(self.n_vocab,))
        token = self._pick(logits)
        if self.constraint is None:
            return token
        if not self.constraint.allows(token):  # rejected: pick again among the allowed tokens
            # never a banned token, even one the constraint allows
            allowed = self.constraint.allowed(self._banned if len(self._banned) else None)
            if len(allowed):  # else the refused token stands, and the constraint fails on it
                token = self._pick(logits, allowed)
                # A constraint may judge a token by more than its allowed set says (UniqueKeys
                # looks past the token): a pick it refuses gives way to the next, a few times.
                for _ in range(RECHECKS):
                    if len(allowed) == 1 or self.constraint.allows(token):
                        break
                    allowed = allowed[allowed != token]
                    token = self._pick(logits, allowed)
        if self.chain is not None:
            llama_cpp.llama_sampler_accept(self.chain, token)
        self.constraint.accept(token)
        return token

    def _pick(self, logits: np.ndarray, ids: np.ndarray | None = None) -> int:
        """The chain's choice over ``logits`` (``llama_sampler_apply``, nothing accepted), among
        the token ids ``ids`` only (ascending; None: all)."""
        if self.greedy:
            return self._argmax(logits, ids)
        buffer, candidates, all_ids = _candidates(self.n_vocab)
        n = self.n_vocab if ids is None else len(ids)
        c = candidates[:n]
        if ids is None:
            c["id"], c["logit"] = all_ids, logits
        else:
            c["id"], c["logit"] = ids, logits[ids]
        c["p"] = 0.0
        array = llama_cpp.llama_token_data_array(buffer, n, -1, False)
        llama_cpp.llama_sampler_apply(self.chain, ctypes.byref(array))
        return int(buffer[array.selected].id)

    def _argmax(self, logits: np.ndarray, ids: np.ndarray | None) -> int:
        """The greedy chain's choice (module doc): the first highest of ``logits`` (among
        ``ids``), a banned token only where every candidate is banned (all ``-inf``: the
        chain's greedy then keeps the first)."""
        x = logits if ids is None else logits[ids]
        best = int(x.argmax())
        token = best if ids is None else int(ids[best])
        if len(self._banned) and token in self._banned:  # rare: copy and mask only then
            x = x.copy()
            x[np.isin(np.arange(self.n_vocab) if ids is None else ids, self._banned)] = -np.inf
            best = int(x.argmax())
            token = best if ids is None else int(ids[best])
        return token

    def free(self) -> None:
        if self.chain:
            llama_cpp.llama_sampler_free(self.chain)
            self.chain = None
        if self.constraint is not None:
            self.constraint.free()
            self.constraint = None

