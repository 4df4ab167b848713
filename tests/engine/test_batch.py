"""engine/llama/batch.py's ``lone_tokens``: the sequences llama.cpp's micro-batch split leaves
alone in a micro-batch."""
from __future__ import annotations


def test_lone_tokens_mirrors_llama_cpp_micro_batch_split():
    from engine.llama.batch import lone_tokens

    assert lone_tokens({0: 1, 1: 1, 2: 1}, 512) == []  # one micro-batch of three sequences
    assert lone_tokens({0: 1}, 512) == [0]
    assert lone_tokens({0: 1, 2: 1}, 512) == [0, 2]  # a gap in the ids splits the batch
    assert lone_tokens({0: 1, 1: 2}, 512) == [1]  # one token each, then 1's second alone
    assert lone_tokens({0: 1, 1: 3, 2: 2}, 512) == [1]
    assert lone_tokens({0: 40}, 512) == []
