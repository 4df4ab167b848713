"""The sampler's constraint slot and logit_bias, on the real model's logits (no engine process):
llama.cpp's ``common_sampler`` shape, a constraint checked against the chain's token first and a
masked resample only when it refuses it."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.llama.batch import Batch
from engine.llama.model import Model
from engine.llama.sampler import AllowAll, Sampler
from engine.request import SamplingParams

GREEDY = SamplingParams(max_new_tokens=8, temperature=0)
PROMPT = np.array([1, 504, 3458, 314, 4763, 30, 2], np.int32)


class Forbid:
    """A test constraint: never the tokens in ``banned``; records what the sampler asked."""

    def __init__(self, banned):
        self.banned, self.asked, self.masked, self.accepted = set(banned), [], 0, []

    def allows(self, token):
        self.asked.append(token)
        return token not in self.banned

    def allowed(self, excluded=None):
        self.masked += 1
        return np.array(sorted(set(range(49152)) - self.banned - set(excluded if excluded is not None else ())),
                        np.int32)

    def accept(self, token):
        self.accepted.append(token)

    def free(self):
        pass


@pytest.fixture(scope="module")
def model():
    m = Model.from_config(EngineConfig(max_slots=1, max_seq_len=256, prefix_cache_tokens=0, n_threads=1))
    yield m
    m.close()


def greedy_tokens(model, sampling=GREEDY, constraint=None, n=6):
    """Greedy continuation of PROMPT, ``n`` tokens, through a fresh Sampler."""
    model.free_sequence(0)
    sampler, batch = Sampler(model.n_vocab, sampling, frozenset(), PROMPT, constraint), Batch(64)
    batch.add(PROMPT, 0, 0, True)
    out = []
    try:
        for k in range(n):
            model.decode(batch)
            out.append(sampler.sample(model.ctx, batch.n - 1))
            batch.clear()
            batch.add(np.array([out[-1]], np.int32), len(PROMPT) + k, 0, True)
    finally:
        sampler.free()
    return out


def test_the_constrained_path_with_a_no_op_constraint_samples_what_the_chain_samples(model):
    assert greedy_tokens(model, constraint=AllowAll()) == greedy_tokens(model)


def test_a_refused_token_is_resampled_from_the_masked_vocabulary(model):
    free = greedy_tokens(model)
    forbid = Forbid({free[0]})
    constrained = greedy_tokens(model, constraint=forbid)
    assert constrained[0] != free[0] and free[0] not in constrained
    assert forbid.asked[0] == free[0] and forbid.masked >= 1  # checked first, masked on refusal only
    assert forbid.accepted == constrained  # the constraint saw exactly the generated tokens
    # The resampled token is the model's best allowed one: what a -inf bias on the refused gives.
    assert constrained[0] == greedy_tokens(model, SamplingParams(temperature=0, logit_bias=((free[0], -100),)))[0]


def test_logit_bias_bans_and_forces(model):
    free = greedy_tokens(model)
    banned = greedy_tokens(model, SamplingParams(temperature=0, logit_bias=((free[0], -100),)))
    assert banned[0] != free[0]
    forced = greedy_tokens(model, SamplingParams(temperature=0, logit_bias=((42, 100),)), n=3)
    assert forced == [42, 42, 42]


def chain_greedy(sampling, banned=frozenset(), constraint=None):
    """A Sampler that keeps llama.cpp's greedy chain where the argmax path would apply: the same
    settings plus a zero bias on a token (a no-op that makes the chain)."""
    sampler = Sampler(49152, dataclasses.replace(sampling, logit_bias=((0, 0.0),)), banned, PROMPT, constraint)
    assert not sampler.greedy and sampler.chain
    return sampler


def test_the_argmax_path_picks_what_llama_cpp_s_greedy_chain_picks(model):
    """Greedy with only bans skips the chain (engine/llama/sampler.py): on the real logits of 24
    positions its token equals the chain's, with EOG-style bans that include the best token, and
    with a constraint that refuses the first pick."""
    model.free_sequence(0)
    batch = Batch(64)
    text = np.array([1, 504, 3458, 314, 4763, 30, 2, 1078, 314, 253, 1848, 28, 2565, 30, 378, 260, 3117, 282,
                     260, 1535, 314, 4763, 30, 2], np.int32)
    batch.add(text, 0, 0, True, all_logits=True)
    model.decode(batch)
    rows = range(len(text))
    best = [Sampler(model.n_vocab, GREEDY, frozenset(), PROMPT).sample(model.ctx, r) for r in rows]
    for banned in (frozenset(), frozenset(best[:3]), frozenset(best)):
        for make in (lambda: None, lambda: Forbid({best[0], best[5]})):
            fast = Sampler(model.n_vocab, GREEDY, banned, PROMPT, make())
            slow = chain_greedy(GREEDY, banned, make())
            assert fast.greedy and fast.chain is None
            try:
                assert [fast.sample(model.ctx, r) for r in rows] == [slow.sample(model.ctx, r) for r in rows]
            finally:
                fast.free()
                slow.free()
    assert any(b != t for b, t in zip(best, [Sampler(model.n_vocab, GREEDY, frozenset(best), PROMPT).sample(
        model.ctx, r) for r in rows]))  # the bans did change tokens: the comparison above is not vacuous
