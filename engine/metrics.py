"""The engine's Prometheus metrics, recorded once per engine step (never per token).

``inference_batch_size`` counts sequences and ``inference_batch_tokens`` tokens (decode tokens
plus prefill chunks) in each ``llama_decode``. Under the server, prometheus-client's
multiprocess mode writes them to this process's files in ``PROMETHEUS_MULTIPROC_DIR``, which
the front ends' ``/metrics`` adds up (``server/observability/metrics.py``). Measured cost:
docs/metrics.md, "What it costs".
"""
from __future__ import annotations

from prometheus_client import Histogram

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH_TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

BATCH_SIZE = Histogram("inference_batch_size", "Sequences in one llama_decode", buckets=BATCH_SIZE_BUCKETS)
BATCH_TOKENS = Histogram("inference_batch_tokens", "Tokens in one llama_decode (decode tokens + prefill chunks)",
                         buckets=BATCH_TOKENS_BUCKETS)


def observe_step(n_sequences: int, n_tokens: int) -> None:
    """Record one ``llama_decode`` of ``n_tokens`` tokens over ``n_sequences`` sequences."""
    BATCH_SIZE.observe(n_sequences)
    BATCH_TOKENS.observe(n_tokens)
