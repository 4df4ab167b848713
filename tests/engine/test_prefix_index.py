"""The prefix cache's index (engine/prefix_cache.py) without the model: lookups per tenant and
longest first; an entry replaced by the turn that extends it; least recently used entries evicted
within the token budget."""
from __future__ import annotations

import numpy as np


def _toks(*ids) -> np.ndarray:
    return np.array(ids, np.int32)


def test_prefix_cache_lookup_is_per_tenant_and_longest():
    from engine.prefix_cache import PrefixCache

    cache = PrefixCache(first_stream=4, n_streams=3, max_tokens=100)
    assert cache.insert(1, _toks(1, 2, 3, 4)) == (4, [])
    assert cache.insert(1, _toks(1, 2, 9)) == (5, [])
    assert cache.insert(2, _toks(1, 2, 3, 4, 5)) == (6, [])
    entry, n = cache.lookup(1, _toks(1, 2, 3, 4, 5, 6))
    assert (entry.stream, n) == (4, 4)  # tenant 2's longer entry is not a candidate
    assert cache.lookup(3, _toks(1, 2, 3)) == (None, 0)


def test_prefix_cache_keeps_the_latest_turn_and_evicts_least_recently_used():
    from engine.prefix_cache import PrefixCache

    cache = PrefixCache(first_stream=2, n_streams=2, max_tokens=8)
    assert cache.insert(1, _toks(1, 2, 3)) == (2, [])
    assert cache.insert(1, _toks(1, 2)) == (None, [])  # already covered
    assert cache.insert(1, _toks(1, 2, 3, 4)) == (2, [2])  # extends turn 1: replaces it
    assert cache.insert(1, _toks(7, 8)) == (3, [])
    cache.lookup(1, _toks(1, 2, 3, 4, 5))  # stream 2 is now the most recently used
    assert cache.insert(1, _toks(5, 6, 7)) == (3, [3])  # 4 + 2 + 3 > 8: the LRU entry goes
    assert cache.n_tokens == 7 and len(cache.entries) == 2
    assert cache.insert(1, _toks(*range(20, 29))) == (None, [])  # longer than the whole cache


def test_a_windowed_or_recurrent_source_gives_only_what_it_keeps():
    """engine.prefix_cache.reusable: full attention gives any prefix; a sliding window of 512
    tokens any prefix of a source under 512 tokens and only all of a longer one; a recurrent state
    only all of it. The cache's lookups, coverage and reuse follow it."""
    from engine.prefix_cache import PrefixCache, reusable

    assert reusable(5000, 10, None)
    assert reusable(511, 10, 512) and not reusable(512, 10, 512) and reusable(600, 600, 512)
    assert not reusable(600, 599, 512) and reusable(20, 20, 0) and not reusable(20, 19, 0)
    long, short = np.arange(100, 700, dtype=np.int32), np.arange(1000, 1300, dtype=np.int32)
    cache = PrefixCache(first_stream=4, n_streams=3, max_tokens=2000, window=512)
    assert cache.insert(1, long)[0] == 4 and cache.insert(1, short)[0] == 5
    assert cache.lookup(1, np.concatenate([long, [1, 2]]))[1] == 600  # all of it
    assert cache.lookup(1, np.concatenate([long[:550], [1, 2]])) == (None, 0)  # a part of it: no
    assert cache.lookup(1, np.concatenate([short[:250], [1, 2]]))[1] == 250  # under the window: any part
    assert cache.insert(1, long[:550])[0] == 6  # not covered by the longer entry, which cannot give it


def test_a_sibling_prefilling_a_shared_prefix_is_waited_for_unless_the_cache_gives_more():
    """PrefixCache.awaits: a prompt waits a step for a running sibling of its tenant that is
    prefilling a prefix they share, unless what a copy from the cache would give it is more
    than the sibling has done. An entry sharing only the template's opening (under
    MIN_REUSE_TOKENS: no copy) gives nothing, so it must not send the prompt to prefill the
    prefix beside the sibling."""
    from engine.prefix_cache import MIN_REUSE_TOKENS, PrefixCache
    from engine.request import EngineRequest, Priority, SamplingParams
    from engine.sequence import Sequence, SequenceStatus

    def sequence(prompt, n_past=0):
        request = EngineRequest(np.asarray(prompt, np.int32), SamplingParams(max_new_tokens=4), Priority.NORMAL,
                                0.0, 1, 1.0)
        seq = Sequence(mailbox=0, lease=1, request=request, arrival=0.0)
        seq.status, seq.n_past = SequenceStatus.PREFILL, n_past
        return seq

    shared = np.arange(100, 400)
    cache = PrefixCache(first_stream=4, n_streams=3, max_tokens=2000)
    cache.insert(1, np.concatenate([shared[:MIN_REUSE_TOKENS - 3], np.full(100, 7)]))
    sibling, seq = sequence(np.concatenate([shared, [1, 2]])), sequence(np.concatenate([shared, [3, 4]]))
    assert cache.awaits(seq, [sibling])
    cache.insert(1, shared[:200])  # a copy would give it 200 tokens: admitted now, it starts ahead
    assert not cache.awaits(seq, [sibling])
    sibling.n_past = 250
    assert cache.awaits(seq, [sibling])
    assert not cache.awaits(seq, [sequence(np.arange(1000, 1300))])  # nothing shared
