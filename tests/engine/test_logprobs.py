"""engine/llama/logprobs.py: the log-softmax of many rows at the chosen token and its top k,
against float64."""
from __future__ import annotations

import numpy as np


def test_logprobs_of_many_rows_match_float64():
    """engine.llama.logprobs: every row's log-softmax at the chosen token and its top k, in both
    of its branches (logits within the unshifted bounds, and not), on one thread and two."""
    from engine.llama.logprobs import LogProbs

    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((37, 5000)) * 4).astype(np.float32)
    logits[3] += 200  # past UNSHIFTED: this row is shifted by its maximum
    logits[5, 7] = logits[5, 9] = logits[5].max() + 1  # a tie: the lower id first
    tokens = rng.integers(0, 5000, 37)
    x = logits.astype(np.float64)
    ref = x - (x.max(1, keepdims=True) + np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)))
    for threads in (1, 2):
        lp = LogProbs(5000, threads)
        got, ids, top = lp.rows(logits, tokens, 3)
        assert np.abs(got - ref[np.arange(37), tokens]).max() < 1e-5
        assert ids[5, :2].tolist() == [7, 9]
        assert (ids == np.argsort(-x, axis=1, kind="stable")[:, :3]).all()
        assert np.abs(top - np.take_along_axis(ref, ids.astype(np.int64), 1)).max() < 1e-5
        for row in (3, 4):  # a row alone gets what it got in a block (the shifted row too)
            one = lp.one(logits[row], int(tokens[row]), 1)
            assert one[0] == got[row] and one[1].tolist() == [ids[row, 0]]
        assert lp.rows(logits, tokens, 0)[1].shape == (37, 0)
        lp.close()
