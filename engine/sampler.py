"""Per-sequence sampling with llama.cpp's sampler chain, and log-probabilities."""
from __future__ import annotations


import llama_cpp
import numpy as np

from engine.request import SamplingParams


class Sampler:
    """A ``llama_sampler`` chain built from one request's settings.

    Order follows llama.cpp's common sampler: logit bias (ignore_eos), penalties, top-k, top-p,
    min-p, temperature, then ``dist`` (seeded); temperature 0 is ``greedy``. Penalties see the
    prompt: its tokens are accepted into the chain first, as llama.cpp's server does.

    Args:
        sampling: the request's settings; ``seed`` None seeds randomly (``LLAMA_DEFAULT_SEED``).
        banned: token ids never to sample (the EOG tokens when ignore_eos).
        prompt: int32 token ids ``[n_prompt]``.
    """

    def __init__(self, n_vocab: int, sampling: SamplingParams, banned: frozenset, prompt: np.ndarray):
        L = llama_cpp
        self.chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        add = lambda s: L.llama_sampler_chain_add(self.chain, s)  # noqa: E731
        if banned:
            bias = (L.llama_logit_bias * len(banned))(*[L.llama_logit_bias(t, float("-inf")) for t in banned])
            add(L.llama_sampler_init_logit_bias(n_vocab, len(banned), bias))
        p = sampling
        penalized = p.repeat_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
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
        """Sample from batch row ``row``'s logits and accept the token into the chain."""
        return llama_cpp.llama_sampler_sample(self.chain, ctx, row)

    def free(self) -> None:
        if self.chain:
            llama_cpp.llama_sampler_free(self.chain)
            self.chain = None


def logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, np.ndarray, np.ndarray]:
    """Log-probability of ``token`` under the model's raw distribution, and the top ``k``.

    Args:
        logits: float32 ``[n_vocab]``.
    Returns:
        ``(logprob, top_ids[k], top_logprobs[k])``, top sorted by decreasing probability.
    """
    x = logits.astype(np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    if k:
        top = np.argpartition(-x, k - 1)[:k]
        top = top[np.argsort(-x[top], kind="stable")]
    else:
        top = np.empty(0, np.int64)
    return float(x[token] - lse), top.astype(np.int32), (x[top] - lse).astype(np.float32)
