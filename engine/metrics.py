"""The engine's Prometheus metrics, recorded once per engine step (never per token).

``inference_batch_size`` counts sequences and ``inference_batch_tokens`` tokens (decode tokens
plus prefill chunks) in each ``llama_decode``, labelled by the model (``model``: its id).
Under the server, prometheus-client's
multiprocess mode writes them to this process's files in ``PROMETHEUS_MULTIPROC_DIR``, which
the front ends' ``/metrics`` adds up (``server/observability/metrics.py``). Measured cost:
docs/metrics.md, "What it costs".
"""
from __future__ import annotations

from prometheus_client import Histogram

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH_TOKENS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

BATCH_SIZE = Histogram("inference_batch_size", "Sequences in one llama_decode", ["model"], buckets=BATCH_SIZE_BUCKETS)
BATCH_TOKENS = Histogram("inference_batch_tokens", "Tokens in one llama_decode (decode tokens + prefill chunks)",
                         ["model"], buckets=BATCH_TOKENS_BUCKETS)


def step_observer(model: str):
    """``observe(n_sequences, n_tokens)``: record one ``llama_decode`` of ``n_tokens`` tokens over
    ``n_sequences`` sequences of the engine of ``model`` (its id: the ``model`` label)."""
    size, tokens = BATCH_SIZE.labels(model), BATCH_TOKENS.labels(model)

    def observe(n_sequences: int, n_tokens: int) -> None:
        size.observe(n_sequences)
        tokens.observe(n_tokens)

    return observe
