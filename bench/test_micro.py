"""Micro-benchmarks of the hot-path verbs (pytest-benchmark; ``make bench`` runs them with
``--benchmark-enable``, ``make test`` once each as tests):

- submitting one request: its record into the request ring (``EngineRequest.encode`` through
  ``RequestRing.push``) and the engine's ``pop_all`` + ``EngineRequest.decode`` of it;
- incremental detokenization, per token, with and without stop strings.

Token delivery (publish -> reader awake) is ``bench/test_delivery.py``; the rate-limit check is
``bench/test_ratelimit.py``.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from engine.request import EngineRequest, SamplingParams
from engine.stream import Token
from server.generation.choice import ChoiceState
from shm import Transport


@pytest.fixture(scope="module")
def transport():
    from engine.config import EngineConfig

    t = Transport.create(EngineConfig(max_slots=4, max_queued=4, max_seq_len=512).layout())
    yield t
    t.close()


def test_ring_submit_and_ingest(benchmark, transport):
    request = EngineRequest(np.arange(1000, 1064, dtype=np.int32), SamplingParams(max_new_tokens=16)).resolved(512)

    def round_trip():
        transport.ring.push(0, 1, functools.partial(request.encode, max_seq_len=512))
        (rec,) = transport.ring.pop_all()
        return EngineRequest.decode(rec.payload, 512)

    got = benchmark(round_trip)
    assert np.array_equal(got.prompt, request.prompt) and got.sampling.max_new_tokens == 16


@pytest.mark.parametrize("stops", [[], ["\n\n", "The end"]], ids=["no-stop", "two-stops"])
def test_detokenize_per_token(benchmark, tokenizer, stops):
    ids = tokenizer.encode("Once upon a time, in a land of ünïcödé and emoji 🌊, a sailor sang. " * 8)

    tokens = [Token(i) for i in ids]

    def detokenize():  # a choice without tools: detokenizer, then stop strings
        choice = ChoiceState(0, tokenizer.pieces, stops)
        text = "".join(d.text for t in tokens for d in choice.push([t]))
        return text + ("" if choice.ended else choice.finish("length").text)

    text = benchmark(detokenize)
    assert "sailor sang" in text
    benchmark.extra_info["tokens"] = len(ids)
