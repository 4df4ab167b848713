"""Log-probabilities of tokens under the model's raw distribution (before logit bias and any
constraint, as OpenAI reports them), for many logits rows at once: a generated token's row, or
every row of a scoring sequence's prompt chunk.

One function computes both, so a token scored as part of a prompt and the same token generated
get the same number from the same logits (the engine keeps logits batch-invariant:
docs/architecture.md, "Prefix cache"). A chunk of 63 rows over a 49,152-token vocabulary is three
million exponentials, so the rows are taken in blocks of about 1.5 MiB that stay in the core's
cache (8 rows of SmolLM2's 49,152 logits, 1 of Gemma 3's 262,144), split over
two threads (numpy releases the GIL inside its loops; llama.cpp's threads are idle between
decodes), and the shift by the row's maximum (log-sum-exp) is skipped when no exponential can
overflow or vanish, which saves a pass.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

#: Bytes of float32 logits per block: about one core's L2 cache (8 rows of 49,152).
BLOCK_BYTES = 8 * 49152 * 4
#: Rows below which one thread is faster than handing blocks to a second one.
THREADED_ROWS = 16
#: A row whose maximum logit is within these bounds is exponentiated unshifted: in float32,
#: 262,144 * e**70 (6.6e35) does not overflow and e**-60 is far from the smallest normal number.
UNSHIFTED = (-60.0, 70.0)


class LogProbs:
    """Log-probabilities of chosen tokens in rows of logits, and the top ``k`` of each row.

    Args:
        n_vocab: columns of a logits row. threads: 1 or 2 workers for large inputs.
    """

    def __init__(self, n_vocab: int, threads: int = 2):
        self.n_vocab = n_vocab
        self.block_rows = max(1, BLOCK_BYTES // (4 * n_vocab))
        self.pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="logprobs") if threads > 1 else None
        self._buffers: dict[int, np.ndarray] = {}

    def rows(self, logits: np.ndarray, tokens: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``log softmax(logits[i])[tokens[i]]`` for every row, and the top ``k`` of each row.

        Args:
            logits: float32 ``[n, n_vocab]`` (a view of llama.cpp's output buffer is fine; it is
                only read). tokens: int ``[n]``. k: alternatives per row, 0..20.
        Returns:
            ``(logprob float32 [n], top_ids int32 [n, k], top_logprobs float32 [n, k])``, the top
            sorted by decreasing probability (ties: lower id first).
        """
        n = len(logits)
        lse, best = np.empty(n, np.float64), np.empty(n, np.int64)
        blocks = [(a, min(n, a + self.block_rows)) for a in range(0, n, self.block_rows)]
        if self.pool is not None and n >= THREADED_ROWS:
            half = len(blocks) // 2
            other = self.pool.submit(self._lse, logits, lse, best, blocks[half:], 1)
            self._lse(logits, lse, best, blocks[:half], 0)
            other.result()
        else:
            self._lse(logits, lse, best, blocks, 0)
        picked = logits[np.arange(n), np.asarray(tokens, np.int64)].astype(np.float64)
        logprob = (picked - lse).astype(np.float32)
        if k == 0:
            return logprob, np.empty((n, 0), np.int32), np.empty((n, 0), np.float32)
        if k == 1:
            top = best[:, None]
        else:  # by block: argpartition makes a negated copy and int64 indices of its whole input
            top = np.empty((n, k), np.int64)
            for a, b in blocks:
                part = np.argpartition(-logits[a:b], k - 1, axis=1)[:, :k]
                order = np.lexsort((part, -np.take_along_axis(logits[a:b], part, axis=1)), axis=1)
                top[a:b] = np.take_along_axis(part, order, axis=1)
        top_lp = (np.take_along_axis(logits, top, axis=1).astype(np.float64) - lse[:, None]).astype(np.float32)
        return logprob, top.astype(np.int32), top_lp

    def one(self, logits: np.ndarray, token: int, k: int) -> tuple[float, np.ndarray, np.ndarray]:
        """:meth:`rows` for one row ``logits`` (float32 ``[n_vocab]``): ``(logprob, top_ids[k],
        top_logprobs[k])``."""
        lp, ids, top = self.rows(logits[None, :], np.array([token]), k)
        return float(lp[0]), ids[0], top[0]

    def _lse(self, logits: np.ndarray, out: np.ndarray, best: np.ndarray, blocks: list[tuple[int, int]],
             worker: int) -> None:
        """``out[a:b] = logsumexp(logits[a:b], axis=1)`` and ``best[a:b]`` the rows' argmax
        (the top 1, found in the pass that finds the shift) for each block, in float32 with a
        float64 result."""
        buf = self._buffers.get(worker)
        if buf is None:
            buf = self._buffers[worker] = np.empty((self.block_rows, self.n_vocab), np.float32)
        lo, hi = UNSHIFTED
        for a, b in blocks:
            x, e = logits[a:b], buf[:b - a]
            best[a:b] = x.argmax(axis=1)
            m = x[np.arange(b - a), best[a:b]]
            # Each row's result depends on that row alone (the choice is per row), so a token
            # scored in a block of eight gets the number it gets generated, alone.
            shift = np.where((m >= lo) & (m <= hi), np.float32(0), m)
            if shift.any():
                np.subtract(x, shift[:, None], out=e)
                np.exp(e, out=e)
            else:
                np.exp(x, out=e)
            out[a:b] = np.log(e.sum(axis=1, dtype=np.float32).astype(np.float64)) + shift

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False)
            self.pool = None
